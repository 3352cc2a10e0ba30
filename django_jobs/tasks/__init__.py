"""Declaring tasks: a task's options, backoff, rates, schedules, argument and result encoding,
and loading a task back from its path. Nothing here writes a job row; the core does that."""
