"""The one job status machine: legal transitions, applied as a conditional UPDATE plus a status event.

`transition()` is the only way any process changes `jobs.status`. It runs
`UPDATE jobs SET status=:to, ... WHERE id=:id AND status IN (:expect)`; the row count decides who won, so
two workers can never both claim one job and a cancel can never overwrite a finished job.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import ColumnElement, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.util import identity_key

from service.crud.clock import db_now_sql
from service.crud.events import add_event
from service.db.models import JOB_STATUSES, TERMINAL_STATUSES, Job
from service.redact import redact_paths

# from-status -> statuses it may move to.
TRANSITIONS: dict[str, frozenset[str]] = {
    # queued -> failed: the reconciler gives up on a job that can never run (attempts exhausted).
    "queued": frozenset({"running", "cancelled", "failed"}),
    # running -> queued: the worker died or was interrupted; the job resumes from its last checkpoint.
    "running": frozenset({"succeeded", "failed", "cancelling", "queued"}),
    # cancelling -> succeeded: training finished before the cancel was seen. Never -> queued: a cancel
    # cannot be undone, so a worker that dies or is interrupted mid-cancel ends the job `cancelled`.
    "cancelling": frozenset({"cancelled", "failed", "succeeded"}),
    "succeeded": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset(),
}

# Timestamp columns stamped when a job enters a status (unless the caller passes them).
_STAMPS = {
    "queued": "queued_at",
    "running": "started_at",
    "cancelling": "cancel_requested_at",
    "succeeded": "finished_at",
    "failed": "finished_at",
    "cancelled": "finished_at",
}


class IllegalTransition(ValueError):
    """A transition the status machine forbids (a programming error, not a lost race)."""


def sources_of(to: str) -> frozenset[str]:
    """Every status from which `to` may be entered."""
    return frozenset(s for s, targets in TRANSITIONS.items() if to in targets)


def is_terminal(status: str) -> bool:
    return status in TERMINAL_STATUSES


def transition(
    session: Session,
    job_id: str,
    to: str,
    *,
    expect: Iterable[str] | None = None,
    event: str | None = None,
    event_data: dict[str, Any] | None = None,
    level: str = "info",
    commit: bool = True,
    fence: int | None = None,
    where: Iterable[ColumnElement[bool]] = (),
    **fields: Any,
) -> bool:
    """Move `job_id` to status `to` if it is currently in one of `expect`; return whether it moved.

    `expect` defaults to every status that may legally enter `to`; naming a status that may not raises
    IllegalTransition. `fields` are extra column values (they may be SQL expressions, e.g.
    `attempt=Job.attempt + 1`). The entry timestamp for `to` is set unless given. On success a `status`
    event (message `event`, data `event_data`) is added in the same transaction, which is committed
    unless `commit=False`. A False return means another process changed the job first: nothing is written.

    `fence` is the caller's attempt number (its claim's fencing token): the move only happens while the
    job's `attempt` still equals it, so a worker whose job was taken from it (and claimed again) can
    change nothing. `where` adds further conditions.
    """
    expected = _checked_sources(to, expect)
    if not expected or not _update_status(session, job_id, to, expected, fence, where, fields):
        return False
    add_event(
        session,
        job_id,
        "status",
        event or f"job {to}",
        level=level,
        data={"status": to, **(event_data or {})},
    )
    if commit:
        session.commit()
    else:
        session.flush()
    return True


def _checked_sources(to: str, expect: Iterable[str] | None) -> frozenset[str]:
    """`expect`, else every status that may enter `to`; IllegalTransition names one that may not."""
    if to not in JOB_STATUSES:
        raise IllegalTransition(f"unknown job status {to!r}")
    allowed = sources_of(to)
    expected = frozenset(expect) if expect is not None else allowed
    bad = expected - allowed
    if bad:
        raise IllegalTransition(f"a job cannot go from {sorted(bad)} to {to!r}")
    return expected


def _update_status(
    session: Session,
    job_id: str,
    to: str,
    expected: frozenset[str],
    fence: int | None,
    where: Iterable[ColumnElement[bool]],
    fields: dict[str, Any],
) -> bool:
    """The conditional UPDATE behind `transition`; whether it changed the row."""
    if isinstance(fields.get("error"), dict):
        # A stored error is read by the project: no server path in its message, nor in its param.
        fields["error"] = redact_paths(fields["error"])
    now = db_now_sql(session)
    values: dict[str, Any] = {"status": to, "updated_at": now, **fields}
    values.setdefault(_STAMPS[to], now)
    conditions = [Job.id == job_id, Job.status.in_(sorted(expected)), *where]
    if fence is not None:
        conditions.append(Job.attempt == fence)
    result = session.execute(
        update(Job).where(*conditions).values(**values).execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return False
    # The UPDATE bypassed the ORM: make a Job already loaded in this session re-read its row.
    loaded = session.identity_map.get(identity_key(Job, job_id))
    if loaded is not None:
        session.expire(loaded)
    return True


def claim(session: Session, job_id: str, worker_name: str) -> bool:
    """`queued -> running` for `worker_name`: the one place `attempt` grows (it counts claims, so a
    reconciler handing a job back never spends an attempt; the new value is the claim's fencing token).
    False: the job was not queued. A queued job with a cancel request is never started: it is cancelled."""
    if transition(
        session,
        job_id,
        "running",
        expect=("queued",),
        where=[Job.cancel_requested_at.is_(None)],
        event=f"running on {worker_name}",
        event_data={"worker": worker_name},
        attempt=Job.attempt + 1,
        worker_name=worker_name,
        heartbeat_at=db_now_sql(session),
        error=None,
    ):
        return True
    transition(
        session,
        job_id,
        "cancelled",
        expect=("queued",),
        where=[Job.cancel_requested_at.is_not(None)],
        event=f"cancelled: worker {worker_name} found a cancel request and did not start it",
    )
    return False
