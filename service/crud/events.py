"""Job events: append (API, worker, reconciler, status machine) and read in id order (REST pages, SSE)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import JobEvent, utcnow
from service.redact import redact_paths


def add_event(
    session: Session,
    job_id: str,
    type: str,
    message: str,
    *,
    level: str = "info",
    data: dict[str, Any] | None = None,
    created_at: datetime | None = None,
) -> JobEvent:
    """Add an event to the session (the caller commits). Server paths in its text are redacted: the
    project reads its events, the machine's directory layout is not its business. `created_at` defaults
    to now; a worker that buffered the event passes the time it happened."""
    event = JobEvent(
        job_id=job_id,
        created_at=created_at or utcnow(),
        level=level,
        type=type,
        message=redact_paths(message),
        data=redact_paths(data),
    )
    session.add(event)
    return event


def events_after(session: Session, job_id: str, after: int | None, limit: int) -> tuple[list[JobEvent], bool]:
    """Up to `limit` events with id > `after`, oldest first, and whether more follow."""
    query = select(JobEvent).where(JobEvent.job_id == job_id)
    if after is not None:
        query = query.where(JobEvent.id > after)
    rows = list(session.scalars(query.order_by(JobEvent.id).limit(limit + 1)))
    return rows[:limit], len(rows) > limit
