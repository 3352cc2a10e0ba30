"""Prometheus metrics read from the jobs database at scrape time.

Nothing here counts in process memory: every value is read from the database when
Prometheus scrapes, so one endpoint on any web process tells the truth about every
worker process on every host. ``facts`` gathers the numbers (no dependency),
``collector`` turns them into Prometheus metric families (``prometheus_client``, the
``prometheus`` extra), ``views``/``urls`` serve them behind a bearer token or an admin
login. See docs/metrics.md.
"""
