"""Fan-in and unique-key races, forced with two real connections (method of ``test_races``).

PostgreSQL and MariaDB only: SQLite serialises whole write transactions.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import OperationalError, connection, transaction  # noqa: F401  (skipif reads it)
from django.utils import timezone

from django_jobs import enqueue_batch
from django_jobs import task as jobs_task
from django_jobs.core import admission, batches, claimed
from django_jobs.core import enqueue as enqueue_module
from django_jobs.core.claimed import finish_job
from django_jobs.core.processes import register_process
from django_jobs.core.queues import QueueSelector
from django_jobs.core.ready import claim_jobs
from django_jobs.core.scheduling import promote_due_jobs
from django_jobs.core.starting import start_job
from django_jobs.models import Batch, Job, ReadyExecution, ScheduledExecution
from tests import batch_tasks as bt
from tests.test_races import ALL, DB, Paused, Runner, wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        "connection.vendor == 'sqlite'", reason="SQLite serialises writers: no row locks to race"
    ),
]

CALLBACK = "tests.batch_tasks.callback"


@pytest.fixture
def worker():
    return register_process(DB, "worker")


# --- N items of a batch finishing at the same instant --------------------------------


def race_last_two_items(monkeypatch, worker) -> int:
    """Item 1's finish pauses holding the batch row; item 2's finish runs meanwhile."""
    made = enqueue_batch([(bt.item, [n], {}) for n in range(2)], on_finish=bt.callback)
    jobs = claim_jobs(DB, worker.pk, ALL, 2)
    for job in jobs:
        assert start_job(DB, job, worker.pk, worker.name)
    paused = Paused(monkeypatch, claimed, "count_outcomes")
    first = Runner(lambda: finish_job(DB, jobs[0].pk, worker.pk, 0), paused)
    first.start()
    assert paused.reached.wait(10)  # item 1 counted, not committed
    second = Runner(lambda: finish_job(DB, jobs[1].pk, worker.pk, 1))
    second.start()
    wait_for(second.blocked_or_done, "the second finish to block or end")
    paused.resume.set()
    assert first.finish() is True
    assert second.finish() is True
    return made.id


def test_items_finishing_at_once_fire_the_callback_once(monkeypatch, worker):
    """Attune with_items fan-in. Protection: select_for_update of the batch row in
    ``batches.count_outcomes``, inside each item's finalisation transaction."""
    batch_id = race_last_two_items(monkeypatch, worker)
    batch = Batch.objects.get(pk=batch_id)
    assert (batch.pending, batch.succeeded) == (0, 2)
    fired = Job.objects.filter(task_path=CALLBACK)
    assert fired.count() == 1
    assert fired.get().kwargs == {"batch_id": batch_id, "succeeded": 2, "failed": 0}


def test_unprotected_items_finishing_at_once_lose_a_count_and_never_fire(monkeypatch, worker):
    def unlocked(db, outcomes):
        for batch_id, (succeeded, failed) in sorted(outcomes.items()):
            batch = Batch.objects.using(db).get(pk=batch_id)  # no FOR UPDATE: a stale read
            batch.pending -= succeeded + failed
            batch.succeeded += succeeded
            batch.failed += failed
            fields = ["pending", "succeeded", "failed"]
            if batch.pending == 0:
                batches.complete(db, batch)
                fields += ["finished_at", "callback_jobs"]
            batch.save(using=db, update_fields=fields)

    monkeypatch.setattr(batches, "count_outcomes", unlocked)
    monkeypatch.setattr(claimed, "count_outcomes", unlocked)
    batch_id = race_last_two_items(monkeypatch, worker)
    batch = Batch.objects.get(pk=batch_id)
    assert (batch.pending, batch.succeeded) == (1, 1)  # a lost update: both items succeeded
    assert not Job.objects.filter(task_path=CALLBACK).exists()


# --- two enqueues of the same unique key at the same instant -------------------------


def race_two_unique_enqueues(monkeypatch) -> tuple[str, str]:
    paused = Paused(monkeypatch, enqueue_module, "admit_jobs", before=True)
    first = Runner(lambda: bt.unique_report.enqueue(42).id, paused)
    first.start()
    assert paused.reached.wait(10)  # the first job's row is inserted, not committed
    second = Runner(lambda: bt.unique_report.enqueue(42).id)
    second.start()
    wait_for(second.blocked_or_done, "the second enqueue to block or end")
    paused.resume.set()
    return first.finish(), second.finish()


def test_two_enqueues_of_one_unique_key_make_one_job(monkeypatch):
    """Oban OSS unique jobs. Protection: the unique index on ``Job.unique_lock``."""
    first, second = race_two_unique_enqueues(monkeypatch)
    assert first == second
    assert Job.objects.filter(task_path="tests.batch_tasks.unique_report").count() == 1


def test_unprotected_read_then_insert_makes_two_jobs(monkeypatch):
    def read_then_insert(db, job):
        holder = Job.objects.using(db).filter(unique_key=job.unique_key).first()
        if holder is not None:
            return holder
        job.unique_lock = None  # no index to stop a concurrent insert
        job.save(using=db, force_insert=True)
        return None

    monkeypatch.setattr(enqueue_module, "insert_unique", read_then_insert)
    first, second = race_two_unique_enqueues(monkeypatch)
    assert first != second
    assert Job.objects.filter(task_path="tests.batch_tasks.unique_report").count() == 2


# --- a batch item discarded at admission, while another item of the batch finishes -----


@jobs_task(concurrency_key="k:{k}", concurrency_group="race", on_conflict="discard")
def discarding(k: int, n: int = 0) -> int:
    return k


@jobs_task(concurrency_key="k:{k}", concurrency_group="race")
def blocking(k: int, n: int = 0) -> int:
    return k


def race_promotion_against_item_finish(monkeypatch, worker) -> dict[str, BaseException]:
    """The dispatcher promotes a batch item onto full key 1 (it is discarded) and a job
    of key 2, pausing between the two keys; meanwhile an item of the same batch holding
    key 2 finishes (key 2, then the batch row)."""
    later = timezone.now() + timedelta(hours=1)
    made = enqueue_batch(
        [
            (discarding, [1, 0], {}),  # holds key 1
            (discarding.using(run_after=later), [1, 1], {}),  # due later, onto a full key 1
            (discarding, [2, 0], {}),  # holds key 2; finishes during the promotion
        ]
    )
    finishing = int(made.results[2].id)
    blocking.enqueue(2, 9)  # blocked behind the finishing item
    blocking.using(run_after=later).enqueue(2, 10)  # due later, onto key 2
    # Claim exactly the key-2 holder: park the other ready job for the claim.
    ReadyExecution.objects.exclude(job_id=finishing).update(queue_name="parked")
    (claimed,) = claim_jobs(DB, worker.pk, QueueSelector(("default",)), 1)
    ReadyExecution.objects.filter(queue_name="parked").update(queue_name="default")
    assert claimed.pk == finishing
    assert start_job(DB, claimed, worker.pk, worker.name)
    ScheduledExecution.objects.update(scheduled_at=timezone.now() - timedelta(seconds=1))

    paused = Paused(monkeypatch, admission, "admit_to_key")
    dispatcher = Runner(lambda: promote_due_jobs(DB, 10), paused)
    dispatcher.start()
    assert paused.reached.wait(10)  # key 1 done (its item discarded); key 2 not yet locked
    finish = Runner(lambda: finish_job(DB, finishing, worker.pk, None))
    finish.start()
    wait_for(finish.blocked_or_done, "the finish to block or end")
    paused.resume.set()
    errors: dict[str, BaseException] = {}
    for name, runner in (("dispatcher", dispatcher), ("finish", finish)):
        try:
            runner.finish()
        except OperationalError as exc:
            errors[name] = exc
    return errors


def test_a_discard_at_promotion_counts_its_batch_after_every_semaphore(monkeypatch, worker):
    """Lock order (docs/design.md section 4): ``admit_jobs`` counts discarded batch items once
    every key is done, so a promotion never holds a batch row while it waits for a
    semaphore that a finishing item of that batch holds."""
    errors = race_promotion_against_item_finish(monkeypatch, worker)
    assert errors == {}
    batch = Batch.objects.get()
    assert (batch.pending, batch.succeeded, batch.failed) == (1, 1, 1)


def test_unprotected_counting_a_discard_per_key_deadlocks(monkeypatch, worker):
    original = admission.admit_to_key

    def count_per_key(db, key, jobs, admitted):
        batches.count_failed(db, original(db, key, jobs, admitted))
        return []

    monkeypatch.setattr(admission, "admit_to_key", count_per_key)
    errors = race_promotion_against_item_finish(monkeypatch, worker)
    assert len(errors) == 1
    assert "deadlock" in str(next(iter(errors.values()))).lower()
