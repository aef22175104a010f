"""Job rows: create (with its first status event), fetch within a project, list newest first."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.crud.pagination import newest_first_page
from service.db.models import Job, JobEvent, utcnow


def create_job(session: Session, project_id: str, spec: dict[str, Any], *, max_attempts: int) -> Job:
    """Add a queued job and its `queued` event to the session (the caller commits)."""
    now = utcnow()
    job = Job(
        project_id=project_id,
        name=spec.get("name"),
        status="queued",
        spec=spec,
        attempt=0,
        max_attempts=max_attempts,
        queue=spec.get("resources", {}).get("queue", "default"),
        created_at=now,
        queued_at=now,
        updated_at=now,
    )
    session.add(job)
    session.flush()
    session.add(
        JobEvent(
            job_id=job.id, created_at=now, type="status", message="job queued", data={"status": "queued"}
        )
    )
    return job


def get_job(session: Session, project_id: str, job_id: str) -> Job | None:
    """The job if it exists in this project (another project's job is indistinguishable from none)."""
    return session.scalar(select(Job).where(Job.id == job_id, Job.project_id == project_id))


def list_jobs(
    session: Session, project_id: str, *, status: str | None, after: str | None, limit: int
) -> tuple[list[Job], bool] | None:
    query = select(Job).where(Job.project_id == project_id)
    if status is not None:
        query = query.where(Job.status == status)
    return newest_first_page(session, Job, query, after, limit)


def count_by_status(session: Session) -> dict[str, int]:
    """Jobs per status over all projects (for /metrics)."""
    return dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
