"""Errors this package raises, each a subclass of Django's task exceptions where one fits."""

from django.tasks.exceptions import InvalidTask


class InvalidTaskArguments(InvalidTask, TypeError):
    """Arguments the task's function would not accept, or that would not come back from
    JSON as they went in: raised at enqueue, so nothing is written and the caller still
    has the values (a ``TypeError`` too, as Python raises for a bad call)."""


class TaskNotFound(Exception):
    """A job's task path no longer imports, or names something that is not a Task."""


class UnreadableJob(Exception):
    """A job's stored arguments (or other input) are JSON that Python cannot read back: an
    integer of more than 4,300 digits, nesting past the recursion limit, text that is not
    JSON. Only a row written by something other than an enqueue holds such a value; the job
    fails for good, its body never run (``db/json_values.py``)."""


class ProcessDied(Exception):
    """Recorded as a job's error when the process running it stopped heartbeating or exited."""


class JobInterrupted(BaseException):
    """Raised inside a running job's thread to stop it (see docs/control.md).

    A ``BaseException``, like ``KeyboardInterrupt``: the ``except Exception`` of a
    task's retry loop or error handler does not swallow it by accident.
    """


class JobCancelled(JobInterrupted):
    """Recorded as a job's error when ``django_jobs.cancel()`` stopped it; never retried."""


class JobTimeout(JobInterrupted):
    """Recorded as a job's error when an attempt ran past the task's ``timeout``;
    retried while attempts remain."""


class WorkerShutdown(JobInterrupted):
    """Raised in a job still running at its worker's shutdown deadline
    (``shutdown_timeout``), and recorded as the attempt's error; retried while
    attempts remain.

    A ``JobInterrupted``: a task's ``except Exception:`` must not swallow it and
    go on, or the body outlives the deadline and its process has to leave it
    behind. The error row's message is built by the worker, which knows the
    timeout; this default is what the task itself sees.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or ("interrupted: the worker is shutting down",)))


class JobNotFound(LookupError):
    """``cancel()`` was given the id of no job."""


class JobAlreadyFinished(ValueError):
    """``cancel()`` was given a job that has already ended: nothing to cancel."""


class Snooze(Exception):
    """Raise from a task to run it again in ``seconds``, without using up an attempt.

    The start that raised it is real and counted in ``attempts``; ``max_attempts``
    grows by one with it, so the retries left are unchanged (docs/control.md).
    """

    def __init__(self, seconds: float = 0) -> None:
        # Checked here, in the task, so a NaN or a century-long snooze fails the attempt
        # with this message instead of reaching the worker's datetime arithmetic.
        from django_jobs.limits import declared_seconds

        self.seconds = declared_seconds(seconds, "Snooze seconds")
        super().__init__(f"snoozed for {self.seconds:g}s")


class ResultNotStored(Exception):
    """Recorded as a job's error when its task returned a value the database cannot store
    (not JSON, a NUL character on PostgreSQL, nested too deeply, over
    ``max_result_size``, or refused by the database itself). The body ran to its end,
    so the job is not retried: running it again would most likely return the same."""


class DependencyFailed(Exception):
    """Recorded as the error of a job that never ran because a job it waited for failed
    for good (failed, cancelled or discarded) and its ``on_dependency_failure`` was
    ``"cancel"`` or ``"fail"``, or because its workflow was cancelled or failed. It made
    no attempt; retrying the failed dependency from the admin brings it back
    (docs/workflows.md)."""


class InvalidDependency(InvalidTask):
    """An ``after=`` the enqueue refuses: a job that does not exist, one in another
    database, or a graph with a cycle. Nothing is enqueued."""


class NeedsJobsBackend(InvalidTask, TypeError):
    """A call that only a django-jobs backend can carry out (a workflow, a batch, ``after=``)
    made with a task whose backend is another one, such as Django's ``ImmediateBackend``
    in a project's test settings. Nothing is enqueued. A ``TypeError`` too, as the
    refusal was before it had a class of its own."""


class IgnoredJobOptions(UserWarning):
    """Tasks declared with django-jobs options whose backend is not django-jobs' (Django's
    ``ImmediateBackend`` or ``DummyBackend`` in test settings): the tasks import and run,
    and the options are ignored. Warned once per process (docs/testing.md)."""
