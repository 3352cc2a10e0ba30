"""The job state machine: enqueue, admission to a concurrency key, claim, start, finish, fail,
snooze, release, recovery, and the operator's retry, discard and cancel.

Lock order, obeyed by every path here (docs/design.md section 4, where each path is listed):
the ``ClaimedExecution`` rows of one process (ascending job id), then the ``RateLimit`` rows of
their rate keys (a start only), then the ``Semaphore`` rows of their concurrency keys, then the
``BlockedExecution`` / ``ReadyExecution`` rows of those keys and their jobs, then the
``JobDependency`` rows of jobs that just ended and the ``AwaitingExecution`` rows
of their dependents (``core/dependencies.py``), then ``Workflow`` rows, then ``Batch`` rows,
last. Several rows of one kind are taken in ascending key order, by code point
(``Operations.lock_in_key_order``). No transaction locks a claimed row after a semaphore.

Code here asks ``django_jobs.db`` for anything one database does differently; it never tests a
vendor name itself.
"""
