"""Multi-node jobs: the leader's rendezvous record and the machines that joined an attempt, all fenced by
the attempt (a node of an older attempt can neither join nor vouch for a newer one)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import exists, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.crud.clock import db_now, db_now_sql
from service.crud.jobs import ACTIVE_STATUSES, hold
from service.db.models import Job, JobNode


def _held(job_id: str, attempt: int) -> tuple[Any, ...]:
    return (Job.id == job_id, Job.attempt == attempt, Job.status.in_(ACTIVE_STATUSES))


def set_gang(session: Session, job_id: str, attempt: int, gang: dict[str, Any]) -> bool:
    """Record the rendezvous of `attempt` (its leader calls this before asking for members); the caller
    commits. False: the attempt no longer holds the job."""
    result = session.execute(
        update(Job)
        .where(*_held(job_id, attempt))
        .values(gang={**gang, "attempt": attempt}, updated_at=db_now_sql(session))
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def gang_of(session: Session, job_id: str, attempt: int) -> dict[str, Any] | None:
    """The rendezvous of `attempt` while that attempt holds the job, else None (a stale join is dropped)."""
    row = session.execute(select(Job.gang).where(*_held(job_id, attempt))).one_or_none()
    if row is None or row.gang is None or row.gang.get("attempt") != attempt:
        return None
    return row.gang


def join(session: Session, job_id: str, attempt: int, slot: int, worker_name: str) -> bool:
    """Register `worker_name` as member `slot` of `attempt` (the caller's transaction is committed here).
    False when the attempt no longer holds the job or the slot is taken (a duplicate delivery)."""
    if not hold(session, job_id, attempt):  # locks the job row: no newer claim lands before this insert
        session.rollback()
        return False
    session.add(
        JobNode(
            job_id=job_id,
            attempt=attempt,
            slot=slot,
            worker_name=worker_name,
            joined_at=db_now(session),
            heartbeat_at=db_now(session),
        )
    )
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        return False
    return True


def node_heartbeat(session: Session, job_id: str, attempt: int, slot: int) -> bool:
    """Stamp member `slot`'s heartbeat while `attempt` holds the job (the caller commits); False: the job
    is no longer that attempt's."""
    held = exists().where(*_held(job_id, attempt))
    result = session.execute(
        update(JobNode)
        .where(JobNode.job_id == job_id, JobNode.attempt == attempt, JobNode.slot == slot, held)
        .values(heartbeat_at=db_now_sql(session))
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def leave(session: Session, job_id: str, attempt: int, slot: int, exit_code: int) -> None:
    """Note that member `slot`'s torchrun ended with `exit_code` (the caller commits)."""
    session.execute(
        update(JobNode)
        .where(JobNode.job_id == job_id, JobNode.attempt == attempt, JobNode.slot == slot)
        .values(left_at=db_now_sql(session), exit_code=exit_code)
        .execution_options(synchronize_session=False)
    )


def members(session: Session, job_id: str, attempt: int) -> list[JobNode]:
    """The machines that joined `attempt` besides its leader, in slot order."""
    query = select(JobNode).where(JobNode.job_id == job_id, JobNode.attempt == attempt).order_by(JobNode.slot)
    return list(session.scalars(query))


def lost_members(session: Session, job_id: str, attempt: int, stale_s: float) -> list[JobNode]:
    """Members of `attempt` that are gone without leaving: their heartbeat is older than `stale_s` by the
    database's clock (a machine killed with its worker)."""
    cutoff: datetime = db_now(session) - timedelta(seconds=stale_s)
    return [m for m in members(session, job_id, attempt) if m.left_at is None and m.heartbeat_at < cutoff]
