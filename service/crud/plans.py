"""Plan requests: one row per `POST /v1/jobs/plan`, queued until a worker answers, then its result or error.

Rows are written by the API only (it reads the worker's answer from RQ when asked); plans still in flight
(queued or running, before their deadline) are what the per-key and per-project plan limits count.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from service.db.models import Plan, utcnow

IN_FLIGHT = ("queued", "running")
TERMINAL = ("succeeded", "failed")
# Finished plans are kept this long for their askers to read, then purged by housekeeping.
KEEP = timedelta(days=1)


def create_plan_row(session: Session, project_id: str, key_hash: str, queue: str, timeout_s: float) -> Plan:
    """Add a queued plan whose answer is due within `timeout_s` (the caller commits)."""
    now = utcnow()
    plan = Plan(
        project_id=project_id,
        key_hash=key_hash,
        queue=queue,
        status="queued",
        created_at=now,
        deadline_at=now + timedelta(seconds=timeout_s),
    )
    session.add(plan)
    session.flush()
    return plan


def get_plan_row(session: Session, project_id: str, plan_id: str) -> Plan | None:
    return session.scalar(select(Plan).where(Plan.id == plan_id, Plan.project_id == project_id))


def in_flight(session: Session, project_id: str) -> list[Plan]:
    """The project's plans not answered yet (oldest first), overdue ones included."""
    query = select(Plan).where(Plan.project_id == project_id, Plan.status.in_(IN_FLIGHT))
    return list(session.scalars(query.order_by(Plan.created_at)))


def count_in_flight(session: Session, *, project_id: str | None = None, key_hash: str | None = None) -> int:
    """Plans in flight (before their deadline) of a project or of an API key."""
    query = select(func.count()).where(Plan.status.in_(IN_FLIGHT), Plan.deadline_at > utcnow())
    if project_id is not None:
        query = query.where(Plan.project_id == project_id)
    if key_hash is not None:
        query = query.where(Plan.key_hash == key_hash)
    return int(session.scalar(query) or 0)


def set_running(plan: Plan) -> None:
    plan.status = "running"


def finish_plan(
    plan: Plan, *, result: dict[str, Any] | None = None, error: dict[str, Any] | None = None
) -> None:
    """Record the answer: `result` (succeeded) or `error` `{code, message, param}` (failed); the caller
    commits."""
    plan.status = "failed" if error is not None else "succeeded"
    plan.result, plan.error, plan.finished_at = result, error, utcnow()


def purge_finished(session: Session, before: datetime | None = None) -> int:
    """Delete plans that ended (or were due) before `before` (default: `KEEP` ago); the caller commits."""
    cutoff = before or utcnow() - KEEP
    result = session.execute(delete(Plan).where(Plan.deadline_at < cutoff))
    return int(result.rowcount or 0)
