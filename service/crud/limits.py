"""Project limits: set them (`peagle projects set`) and read what a project uses against them."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from peagle_core.spec import ResourcesSpec
from service.crud.jobs import UNFINISHED_STATUSES
from service.crud.locks import lock_project
from service.crud.usage import storage_used
from service.db.models import Job, Project

__all__ = [
    "UNSET",
    "lock_project",
    "set_limits",
    "storage_used",
    "unfinished_job_count",
    "unfinished_machine_count",
]

UNSET = object()


def set_limits(
    session: Session,
    project: Project,
    *,
    allowed_queues: list[str] | object | None = UNSET,
    max_running_jobs: int | object | None = UNSET,
    storage_cap_bytes: int | object | None = UNSET,
) -> Project:
    """Change the given limits (None clears one: unlimited); the caller commits."""
    if allowed_queues is not UNSET:
        project.allowed_queues = allowed_queues  # type: ignore[assignment]
    if max_running_jobs is not UNSET:
        project.max_running_jobs = max_running_jobs  # type: ignore[assignment]
    if storage_cap_bytes is not UNSET:
        project.storage_cap_bytes = storage_cap_bytes  # type: ignore[assignment]
    return project


def unfinished_job_count(session: Session, project_id: str) -> int:
    query = select(func.count()).where(Job.project_id == project_id, Job.status.in_(UNFINISHED_STATUSES))
    return int(session.scalar(query) or 0)


def unfinished_machine_count(session: Session, project_id: str) -> int:
    """Machines the project's queued and running jobs hold or wait for: a job across N machines (up to N
    for an elastic one) counts N, so `max_running_jobs` caps capacity, not just rows."""
    query = select(Job.spec).where(Job.project_id == project_id, Job.status.in_(UNFINISHED_STATUSES))
    return sum(
        ResourcesSpec.model_validate(spec.get("resources", {})).nodes_max for spec in session.scalars(query)
    )
