"""Job metrics: one row per logged step (training) or evaluation, read back as a step series."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import JobMetric, utcnow


def add_metrics(
    session: Session, job_id: str, step: int, values: dict[str, Any], *, created_at: datetime | None = None
) -> JobMetric:
    """Add one metrics row to the session (the caller commits). `created_at` defaults to now; the
    worker passes the time the trainer reported the step, which precedes the batched write."""
    row = JobMetric(job_id=job_id, step=step, values=values, created_at=created_at or utcnow())
    session.add(row)
    return row


def metrics_after(
    session: Session, job_id: str, after: int | None, limit: int
) -> tuple[list[JobMetric], bool]:
    """Up to `limit` rows logged after row id `after`, in logging order (= step order), and whether more follow.

    The cursor is the row id, not the step: a step can carry several rows (train and eval metrics).
    """
    query = select(JobMetric).where(JobMetric.job_id == job_id)
    if after is not None:
        query = query.where(JobMetric.id > after)
    rows = list(session.scalars(query.order_by(JobMetric.id).limit(limit + 1)))
    return rows[:limit], len(rows) > limit
