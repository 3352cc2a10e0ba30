"""Signals a worker sends about the jobs it runs, beyond ``django.tasks``' own.

Django's ``task_finished`` says how an attempt ended but not why: it carries no exception.
Error trackers (``django_jobs.contrib.sentry``) and anything else that wants the exception
connect to :data:`job_attempt_failed` instead.

Imports nothing but Django's dispatcher, so a project's settings can import it (as an error
tracker's ``init`` in the settings does) before the apps are loaded.
"""

from __future__ import annotations

from django.dispatch import Signal

# Sent by the worker that ran an attempt, after that attempt's failure is recorded (and
# committed): its body raised, it was interrupted (timeout, cancel, shutdown deadline), its
# return value could not be stored, or its task could not be imported. Not sent for a
# ``Snooze``, nor for a failure recorded by anyone else (recovery of a dead process's claims,
# an operator's action), nor for an error of the worker's own, which is logged with its
# traceback. Sent in the worker thread that ran the job, inside the job's tracing scopes
# (django_jobs/observability/tracing.py); for a success the database refused to record
# (``ResultNotStored``), in the completer thread that tried, outside them. Arguments, all
# by keyword:
#
#   sender          the ``Job`` model class
#   job             the ``Job`` as the worker holds it: ``task_path``, ``pk``, ``queue_name``,
#                   ``max_attempts``, ``concurrency_key``, ``workflow_id``, ``args``... (its
#                   ``status`` is the one it ran with, not the recorded outcome)
#   exception       what ended the attempt: the exception the body raised, ``ResultNotStored``,
#                   or ``TaskNotFound`` for a task that could not be imported
#   error           the ``ErrorInfo`` recorded in the job's failure row: for an interrupted
#                   attempt it names the interruption (``JobTimeout``...) whatever the body
#                   raised on the way out
#   attempt         the number of the attempt that failed (1 for the first); for a task that
#                   could not be imported, the number the attempt would have had
#   will_retry      whether another attempt is scheduled
#   retry_at        when it is due (an aware datetime), or None
#   interrupted_by  ``JobCancelled``, ``JobTimeout`` or ``WorkerShutdown`` when the worker's
#                   watchdog stopped the attempt, else None
#
# Receivers run in turn through ``send_robust``: one that raises is logged on
# ``django_jobs.worker`` and changes nothing else, neither the recorded outcome nor the worker
# (docs/design.md invariant 10). One that raises ``SystemExit`` (any ``BaseException`` but
# ``KeyboardInterrupt``), which ``send_robust`` lets through, is logged too and ends neither
# the worker nor its thread; the receivers after it are not sent that failure. A receiver
# runs in the thread that would run the next job: keep it short.
job_attempt_failed = Signal()

# The attribute the worker's "job failed" log record carries (``extra``), set to the job's
# id: a receiver that reports the failure itself (with its exception) can tell the log line's
# copy of it apart, and drop it.
ATTEMPT_FAILED_LOG_MARK = "django_jobs_attempt_failed"
