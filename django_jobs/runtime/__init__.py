"""The ``run_jobs`` runtime: supervisor, worker and dispatcher loops."""
