"""Project limits: set them (`peagle projects set`), lock a project to check one, and read what it uses."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.crud.jobs import UNFINISHED_STATUSES
from service.crud.usage import storage_used
from service.db.models import Job, Project

__all__ = ["UNSET", "lock_project", "set_limits", "storage_used", "unfinished_job_count"]

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


def lock_project(session: Session, project_id: str) -> Project | None:
    """The project row, locked until the transaction ends, so that checks of its limits and the writes
    they admit happen one request at a time.

    Postgres: `SELECT ... FOR UPDATE` on the row. SQLite ignores FOR UPDATE, and its default deferred
    transaction lets two readers both pass a check before either writes; `BEGIN IMMEDIATE` takes the
    database's write lock first (waiting out the busy timeout), so the reads after it see every earlier
    commit and no other writer until ours ends.
    """
    conn = session.connection()
    if conn.dialect.name == "sqlite":
        dbapi = conn.connection.dbapi_connection
        # pysqlite opens a transaction only before its first write; one already open holds the lock.
        if dbapi is not None and not dbapi.in_transaction:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
    query = select(Project).where(Project.id == project_id).with_for_update()
    # populate_existing: the request loaded the row before the lock; read its limits again under it.
    return session.scalar(query.execution_options(populate_existing=True))


def unfinished_job_count(session: Session, project_id: str) -> int:
    query = select(func.count()).where(Job.project_id == project_id, Job.status.in_(UNFINISHED_STATUSES))
    return int(session.scalar(query) or 0)
