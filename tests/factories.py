"""factory-boy factories for the jobs tables, for tests that need rows in a given state."""

from __future__ import annotations

import factory
from django.utils import timezone

from django_jobs.models import (
    AwaitingExecution,
    BlockedExecution,
    ClaimedExecution,
    FailedExecution,
    Job,
    JobStatus,
    Pause,
    Process,
    ReadyExecution,
    ScheduledExecution,
    Semaphore,
)


class JobFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Job

    task_path = "tests.tasks.add"
    queue_name = "default"
    args = factory.LazyFunction(lambda: [1, 2])
    kwargs = factory.LazyFunction(dict)
    status = JobStatus.READY


class FinishedJobFactory(JobFactory):
    status = JobStatus.SUCCEEDED
    attempts = 1
    worker_ids = factory.LazyFunction(lambda: ["worker-test"])
    started_at = factory.LazyFunction(timezone.now)
    last_attempted_at = factory.SelfAttribute("started_at")
    finished_at = factory.LazyFunction(timezone.now)
    return_value = 3


class ProcessFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Process

    kind = Process.Kind.WORKER
    name = factory.Sequence(lambda n: f"worker-test-{n}")
    hostname = "test-host"
    pid = factory.Sequence(lambda n: 100_000 + n)


class ReadyExecutionFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ReadyExecution

    job = factory.SubFactory(JobFactory)
    queue_name = factory.SelfAttribute("job.queue_name")
    priority = factory.SelfAttribute("job.priority")
    concurrency_key = factory.SelfAttribute("job.concurrency_key")


class ScheduledExecutionFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ScheduledExecution

    job = factory.SubFactory(JobFactory, status=JobStatus.SCHEDULED)
    queue_name = factory.SelfAttribute("job.queue_name")
    priority = factory.SelfAttribute("job.priority")
    scheduled_at = factory.LazyFunction(timezone.now)


class BlockedExecutionFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = BlockedExecution

    job = factory.SubFactory(
        JobFactory, status=JobStatus.BLOCKED, concurrency_key="key", concurrency_limit=1
    )
    queue_name = factory.SelfAttribute("job.queue_name")
    priority = factory.SelfAttribute("job.priority")
    concurrency_key = factory.SelfAttribute("job.concurrency_key")


class AwaitingExecutionFactory(factory.django.DjangoModelFactory):
    """A job waiting for the jobs it depends on; no edge rows (count tests need none)."""

    class Meta:
        model = AwaitingExecution

    job = factory.SubFactory(JobFactory, status=JobStatus.AWAITING)
    queue_name = factory.SelfAttribute("job.queue_name")
    priority = factory.SelfAttribute("job.priority")
    remaining = 1


class ClaimedExecutionFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ClaimedExecution

    job = factory.SubFactory(JobFactory, status=JobStatus.CLAIMED)
    process = factory.SubFactory(ProcessFactory)
    concurrency_key = factory.SelfAttribute("job.concurrency_key")


class FailedExecutionFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = FailedExecution

    job = factory.SubFactory(JobFactory, status=JobStatus.FAILED, attempts=1)
    attempt = 1
    exception_class_path = "builtins.ValueError"
    message = "boom"
    traceback = "Traceback (most recent call last):\nValueError: boom\n"


class SemaphoreFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Semaphore

    key = factory.Sequence(lambda n: f"key-{n}")
    limit = 1
    value = 1


class PauseFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Pause

    queue_name = "default"
