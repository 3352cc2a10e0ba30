"""``JobsCollector``: the jobs database as Prometheus gauges, read at each scrape.

A custom collector rather than counters updated by the code that runs jobs: those
would live in each process's memory, so one web process would see only its own
enqueues and none of the workers' runs. Reading the database at scrape time gives
the same answer from any process, with any number of workers on any number of hosts.

Register it yourself to add the metrics to an endpoint you already serve::

    from prometheus_client import REGISTRY
    from django_jobs.metrics.collector import JobsCollector

    REGISTRY.register(JobsCollector())

Every scrape of that registry then queries the jobs database (docs/metrics.md says
what it costs).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from django_jobs.conf import JobsSettings
from django_jobs.metrics.facts import Facts, gather
from django_jobs.models import Process
from django_jobs.observability.inspection import OUTCOMES, PENDING_STATES, FairQueue, ProcessInfo

PREFIX = "django_jobs"
PROCESS_LABELS = ["process", "kind", "host"]


def families() -> dict[str, GaugeMetricFamily]:
    """Every metric, empty: ``describe()`` lists them, ``collect()`` fills them."""

    def gauge(name: str, documentation: str, labels: list[str] | None = None) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"{PREFIX}_{name}", documentation, labels=labels or [])

    return {
        "jobs": gauge(
            "jobs",
            "Jobs waiting or running, per queue and state "
            "(ready, scheduled, blocked, awaiting: waiting for the jobs it depends on, "
            "running: claimed by a worker).",
            ["queue", "state"],
        ),
        "oldest_ready": gauge(
            "oldest_ready_job_age_seconds",
            "Seconds since the queue's oldest ready job became ready; 0 with none ready.",
            ["queue"],
        ),
        "paused": gauge("queue_paused", "1 if the queue is paused, else 0.", ["queue"]),
        "minute": gauge(
            "finished_jobs_last_minute",
            "Jobs that finished in the last 60 seconds, per queue and outcome "
            "(succeeded, failed, discarded).",
            ["queue", "status"],
        ),
        "blocked_keys": gauge(
            "blocked_keys", "Concurrency keys with at least one blocked job (all of them)."
        ),
        "key_blocked": gauge(
            "key_blocked_jobs",
            "Blocked jobs of the concurrency keys with the most (top N, DJANGO_JOBS_METRICS).",
            ["key"],
        ),
        "key_oldest": gauge(
            "key_oldest_blocked_job_age_seconds",
            "Seconds the key's oldest blocked job has waited (same top N keys).",
            ["key"],
        ),
        "key_holders": gauge(
            "key_holders",
            "Jobs holding a slot of the key: ready or claimed, leases not expired "
            "(same top N keys).",
            ["key"],
        ),
        "key_limit": gauge("key_limit", "The key's concurrency limit (same top N keys).", ["key"]),
        "fair_group_ready": gauge(
            "fair_group_ready_jobs",
            "Ready jobs of the fair queue's groups with the most (top N, "
            "DJANGO_JOBS_METRICS top_fair_keys), counted among its next ready jobs "
            "(django_jobs_fair_ready_jobs_read); fair_key '' is the group of no key.",
            ["queue", "fair_key"],
        ),
        "fair_group_share": gauge(
            "fair_group_start_share",
            "The group's share (0 to 1) of the fair queue's recent starts (same top N "
            "groups; absent while the queue has none: django_jobs_fair_recent_starts).",
            ["queue", "fair_key"],
        ),
        "fair_other_ready": gauge(
            "fair_other_ready_jobs",
            "Ready jobs counted of the fair queue's other groups, and of its jobs of no "
            "group (enqueued before it was fair).",
            ["queue"],
        ),
        "fair_groups": gauge(
            "fair_groups",
            "Groups among the fair queue's ready jobs counted (at most as many as those).",
            ["queue"],
        ),
        "fair_ready_read": gauge(
            "fair_ready_jobs_read",
            "Ready jobs of the fair queue its groups were counted among: all of them, or its "
            "next ones in claim order, up to the read's cap.",
            ["queue"],
        ),
        "fair_ready_capped": gauge(
            "fair_ready_jobs_capped",
            "1 if the fair queue has more ready jobs than were read (counts are of its next "
            "ones), else 0.",
            ["queue"],
        ),
        "fair_recent_starts": gauge(
            "fair_recent_starts",
            "The fair queue's jobs running now or finished within the last hour (its latest "
            "minutes past the read's cap): the whole the shares are of.",
            ["queue"],
        ),
        "processes": gauge(
            "processes",
            "run_jobs processes registered, per kind and state (alive, dead: heartbeat "
            "older than alive_threshold, not yet pruned).",
            ["kind", "state"],
        ),
        "heartbeat": gauge(
            "process_heartbeat_age_seconds",
            "Seconds since the process's last heartbeat.",
            PROCESS_LABELS,
        ),
        "alive": gauge(
            "process_alive", "1 if the heartbeat is within alive_threshold, else 0.", PROCESS_LABELS
        ),
        "running": gauge("process_running_jobs", "Jobs the process holds claimed.", PROCESS_LABELS),
        "async_jobs": gauge(
            "process_async_jobs",
            "async def jobs the live worker process runs at once on its event loop "
            "(0: they run on its threads).",
            PROCESS_LABELS,
        ),
        "loop_stalls": gauge(
            "event_loop_stalls",
            "Times the live worker process's event loop of async def jobs was blocked longer "
            "than event_loop_block_threshold since the process started.",
            PROCESS_LABELS,
        ),
        "loop_stalled_seconds": gauge(
            "event_loop_stalled_seconds",
            "Seconds the live worker process's event loop was blocked in those stalls, in all.",
            PROCESS_LABELS,
        ),
    }


def seconds_since(moment: datetime | None, now: datetime) -> float:
    """Age in seconds, never negative (another host's clock may run a little ahead)."""
    return max(0.0, (now - moment).total_seconds()) if moment is not None else 0.0


def fill(metrics: dict[str, GaugeMetricFamily], facts: Facts) -> None:
    """Add one sample per series to ``metrics`` from ``facts``."""
    now = facts.taken_at
    for queue in facts.queues:
        counts = facts.pending.get(queue, {})
        for state in PENDING_STATES:
            metrics["jobs"].add_metric([queue, state], counts.get(state, 0))
        metrics["oldest_ready"].add_metric(
            [queue], seconds_since(facts.oldest_ready_at.get(queue), now)
        )
        metrics["paused"].add_metric([queue], 1 if queue in facts.paused else 0)
        minute = facts.finished_last_minute.get(queue, {})
        for status in OUTCOMES:
            metrics["minute"].add_metric([queue, status], minute.get(status, 0))
    metrics["blocked_keys"].add_metric([], facts.blocked_key_count)
    for key in facts.top_blocked_keys:
        metrics["key_blocked"].add_metric([key.key], key.blocked)
        metrics["key_oldest"].add_metric([key.key], seconds_since(key.oldest_blocked_at, now))
        metrics["key_holders"].add_metric([key.key], key.holders)
        if key.limit is not None:
            metrics["key_limit"].add_metric([key.key], key.limit)
    for found in facts.fair_queues:
        add_fair_queue(metrics, found)
    # Every kind and state, also at 0: "no live worker" is a value, not a missing series.
    tally = {(kind, state): 0 for kind in Process.Kind.values for state in ("alive", "dead")}
    for process in facts.processes:
        state = "alive" if process.alive else "dead"
        tally[process.kind, state] = tally.get((process.kind, state), 0) + 1
        labels = [process.name, process.kind, process.hostname]
        metrics["heartbeat"].add_metric(labels, seconds_since(process.last_heartbeat_at, now))
        metrics["alive"].add_metric(labels, 1 if process.alive else 0)
        metrics["running"].add_metric(labels, len(process.running_jobs))
        if process.alive and process.kind == Process.Kind.WORKER:
            add_async_loop(metrics, labels, process)
    for (kind, state), n in sorted(tally.items()):
        metrics["processes"].add_metric([kind, state], n)


def add_fair_queue(metrics: dict[str, GaugeMetricFamily], found: FairQueue) -> None:
    """A fair queue's series: one per group shown (at most ``top_fair_keys``: the labels
    never follow the number of keys), and the queue's own."""
    queue = found.queue
    for group in found.groups:
        metrics["fair_group_ready"].add_metric([queue, group.key], group.ready)
        if group.share is not None:
            metrics["fair_group_share"].add_metric([queue, group.key], group.share)
    metrics["fair_other_ready"].add_metric([queue], found.other_ready + found.ungrouped_ready)
    metrics["fair_groups"].add_metric([queue], found.groups_seen)
    metrics["fair_ready_read"].add_metric([queue], found.ready_read)
    metrics["fair_ready_capped"].add_metric([queue], 1 if found.ready_capped else 0)
    metrics["fair_recent_starts"].add_metric([queue], found.starts)


def add_async_loop(
    metrics: dict[str, GaugeMetricFamily], labels: list[str], process: ProcessInfo
) -> None:
    """A live worker's event loop: its capacity and stalls, each figure its row holds as a
    number in range (``process_metadata``); one its row does not is left out, not guessed.
    Only live workers: a dead one's series end with it, so their number stays that of the
    processes running."""
    figures = (
        ("async_jobs", process.async_jobs),
        ("loop_stalls", process.loop_stalls),
        ("loop_stalled_seconds", process.loop_stalled_seconds),
    )
    for name, figure in figures:
        if figure is not None:
            metrics[name].add_metric(labels, figure)


class JobsCollector(Collector):
    """Collects the jobs metrics from the database on every ``collect()``.

    ``top_keys``: how many concurrency keys get series of their own (those with the
    most blocked jobs); ``conf``: the ``DJANGO_JOBS`` settings to read the database
    alias, alive threshold and fair queues from (loaded at each collect when None);
    ``top_fair_keys``: how many groups of each fair queue get series of their own (those
    with the most ready jobs).
    """

    def __init__(
        self, top_keys: int = 20, conf: JobsSettings | None = None, top_fair_keys: int = 10
    ) -> None:
        self.top_keys = top_keys
        self.conf = conf
        self.top_fair_keys = top_fair_keys

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Without this a registry with auto_describe (the global REGISTRY) would call
        # collect(), and so query the database, when the collector is registered.
        yield from families().values()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        metrics = families()
        fill(metrics, gather(self.top_keys, self.conf, self.top_fair_keys))
        yield from metrics.values()
