"""Tasks whose jobs fill every admin page: successes, a failure, a keyed pair, a batch."""

from django_jobs import task


@task()
def ping(n: int = 0) -> int:
    return n


@task(max_attempts=2, backoff=0)
def fail(reason: str) -> None:
    raise ValueError(reason)


@task(queue_name="emails", concurrency_key="account:{account_id}")
def sync_account(account_id: int) -> None:
    return None


@task()
def batch_done(batch_id: int, succeeded: int, failed: int) -> int:
    return succeeded
