"""The process registry: registering, heartbeating, and pruning the dead."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from datetime import timedelta

from django.utils import timezone
from django.utils.crypto import get_random_string

from django_jobs.core.recovery import recover_process_claims
from django_jobs.models import ClaimedExecution, Process
from django_jobs.text import jobs_logger

logger = jobs_logger("django_jobs.processes")


def register_process(
    db: str, kind: str, *, supervisor_id: int | None = None, metadata: dict | None = None
) -> Process:
    hostname = socket.gethostname()
    pid = os.getpid()
    return Process.objects.using(db).create(
        kind=kind,
        name=f"{kind}-{hostname}-{pid}-{get_random_string(6).lower()}"[:128],
        hostname=hostname[:255],
        pid=pid,
        supervisor_id=supervisor_id,
        metadata=metadata or {},
    )


def heartbeat(db: str, process_id: int) -> bool:
    """Refresh the heartbeat; False if the row is gone (this process was pruned as dead)."""
    return bool(
        Process.objects.using(db).filter(pk=process_id).update(last_heartbeat_at=timezone.now())
    )


def deregister_process(db: str, process_id: int, reason: str) -> dict[int, str]:
    """Settle whatever claims are left, then remove the row."""
    outcomes = recover_process_claims(db, process_id, reason)
    Process.objects.using(db).filter(pk=process_id).delete()
    return outcomes


def prune_dead_processes(
    db: str, alive_threshold: float, *, exclude: Iterable[int] = ()
) -> dict[int, str]:
    """Delete every process past the alive threshold, then recover its claims.

    The row goes first: every claim checks its process's row before it takes a job
    (``core.ready.claim_jobs``), so once the delete has committed a process that is
    still running after all (a long pause, a clock jump) claims nothing more. The
    recovery that follows sees every claim it made (one of PostgreSQL's one-statement
    claims that began before the delete may land after it: the sweep below, at the
    next prune, recovers it; ``db/postgresql/claims.py`` says why that is enough).
    Recovering first let such a process claim again a job just recovered, under the
    same id, and its first attempt's late outcome then ended the second
    (tests/test_pruned_claims.py).
    Also settles claims whose process row is already gone (a crash between a
    prune's delete and its recovery). Safe to run from several dispatchers: each
    claim is recovered once under its row lock. ``exclude``: rows known to be alive
    whatever their heartbeat says (the caller's own, its supervisor's).
    """
    cutoff = timezone.now() - timedelta(seconds=alive_threshold)
    outcomes: dict[int, str] = {}
    stale = Process.objects.using(db).filter(last_heartbeat_at__lt=cutoff)
    for process in stale.exclude(pk__in=[pk for pk in exclude if pk is not None]):
        reason = (
            f"{process.kind} {process.name} (pid {process.pid}) stopped heartbeating "
            f"at {process.last_heartbeat_at.isoformat()}"
        )
        # Unless it beat meanwhile: then it is alive, and its claims are its own.
        deleted, _ = (
            Process.objects.using(db).filter(pk=process.pk, last_heartbeat_at__lt=cutoff).delete()
        )
        if not deleted:
            continue
        recovered = recover_process_claims(db, process.pk, reason)
        outcomes.update(recovered)
        logger.warning(
            "pruned dead process %s; recovered %d claim(s)", process.name, len(recovered)
        )
    orphans = (
        ClaimedExecution.objects.using(db)
        .exclude(process_id__in=Process.objects.using(db).values("pk"))
        .values_list("process_id", flat=True)
        .distinct()
    )
    for process_id in list(orphans):
        outcomes.update(
            recover_process_claims(db, process_id, f"process {process_id} no longer exists")
        )
    return outcomes
