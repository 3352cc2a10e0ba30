"""The job state machine: enqueue, admission to a concurrency key, claim, start, finish, fail,
snooze, release, recovery, and the operator's retry, discard and cancel.

Lock order, obeyed by every path here (docs/design.md, "The concurrency protocol"): one
``ClaimedExecution`` row, then one ``Semaphore`` row (several only in ascending key order), then
the ``BlockedExecution`` / ``ReadyExecution`` rows of that key, then ``RateLimit`` rows in
ascending key order. No transaction locks a claimed row after a semaphore.

Code here asks ``django_jobs.db`` for anything one database does differently; it never tests a
vendor name itself.
"""
