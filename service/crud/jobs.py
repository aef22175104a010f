"""Job rows: create (with its first status event), the worker's fenced writes (progress, heartbeat, resume
point), and reads.

Status changes are not here: they go through `service.crud.jobstate.transition`, the status machine.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Row, delete, func, select, update
from sqlalchemy.orm import Session

from service.crud.clock import db_now_sql
from service.crud.events import add_event
from service.crud.pagination import newest_first_page
from service.db.models import TERMINAL_STATUSES, Job, utcnow

ACTIVE_STATUSES = ("running", "cancelling")  # a worker holds the job
UNFINISHED_STATUSES = ("queued", *ACTIVE_STATUSES)


def create_job_row(
    session: Session,
    project_id: str,
    spec: dict[str, Any],
    *,
    max_attempts: int,
    submitted: dict[str, Any] | None = None,
) -> Job:
    """Add a queued job and its `queued` event to the session (the caller commits). `spec` is shown,
    `submitted` (the user's own fields, when the caller kept them apart) is what the worker runs."""
    now = utcnow()
    job = Job(
        project_id=project_id,
        name=spec.get("name"),
        status="queued",
        spec=spec,
        spec_submitted=submitted,
        attempt=0,
        max_attempts=max_attempts,
        queue=spec.get("resources", {}).get("queue", "default"),
        created_at=now,
        queued_at=now,
        updated_at=now,
    )
    session.add(job)
    session.flush()
    add_event(session, job.id, "status", "job queued", data={"status": "queued"})
    return job


def record_enqueued(job: Job) -> None:
    """Note on the row that RQ holds the job (its RQ id is the job id); the caller commits."""
    job.rq_job_id = job.id


def _fenced(job_id: str, attempt: int) -> tuple[Any, ...]:
    # A worker's writes hold only while the job is active and still on the attempt it claimed.
    return (Job.id == job_id, Job.attempt == attempt, Job.status.in_(ACTIVE_STATUSES))


def _update_if_held(session: Session, job_id: str, attempt: int, **values: Any) -> bool:
    """Set `values` on the job if `attempt` still holds it; the caller commits. The UPDATE also locks
    the row, fencing the caller's inserts in this transaction."""
    result = session.execute(
        update(Job)
        .where(*_fenced(job_id, attempt))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def hold(session: Session, job_id: str, attempt: int) -> bool:
    """Fence the rows a worker is about to insert (metrics, events) in this transaction: lock the job row
    if `attempt` still holds it. A claim that would take the job waits for this transaction, so nothing
    the caller adds before committing can land after a newer attempt started. False: not ours any more."""
    return _update_if_held(session, job_id, attempt, updated_at=db_now_sql(session))


def hold_attempt(session: Session, job_id: str, attempt: int) -> bool:
    """Lock the job row if `attempt` is still its newest attempt, whatever its status (the caller commits).
    For what a worker does after the job's final status is written (closing its trackers): a claim of a
    newer attempt waits for this transaction, and False means a newer attempt owns the job's outputs."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempt == attempt)
        .values(attempt=Job.attempt)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def set_progress(session: Session, job_id: str, progress: dict[str, Any], *, attempt: int) -> bool:
    """Replace the job's progress (stage, step, total_steps, eta_s) if `attempt` still holds it, which
    also fences the caller's inserts as `hold` does (the caller commits). False: not ours any more."""
    return _update_if_held(session, job_id, attempt, progress=progress, updated_at=db_now_sql(session))


def heartbeat(session: Session, job_id: str, attempt: int) -> bool:
    """Stamp `heartbeat_at` with the database's clock if `attempt` still holds the job (the caller
    commits); False when the job is no longer its own."""
    return _update_if_held(session, job_id, attempt, heartbeat_at=db_now_sql(session))


def set_resume_point(session: Session, job_id: str, attempt: int, uri: str, step: int) -> bool:
    """Record the newest training checkpoint mirrored to the artifact store (the caller commits). Only
    the attempt holding the job may move it, so a stale worker can never point a resume at its files."""
    return _update_if_held(
        session, job_id, attempt, resume_uri=uri, resume_step=step, updated_at=db_now_sql(session)
    )


def get_job_row(session: Session, project_id: str, job_id: str) -> Job | None:
    """The job if it exists in this project (another project's job is indistinguishable from none)."""
    return session.scalar(select(Job).where(Job.id == job_id, Job.project_id == project_id))


def find_job(session: Session, job_id: str) -> Job | None:
    """The job in any project (for the worker and the reconciler, which act on ids from the queue)."""
    return session.get(Job, job_id)


def holder(session: Session, job_id: str) -> Row[tuple[str, int]] | None:
    """(status, attempt) of the job, read fresh: how a worker checks the job is still its own."""
    return session.execute(select(Job.status, Job.attempt).where(Job.id == job_id)).one_or_none()


def unfinished_jobs(session: Session) -> list[Job]:
    """Every queued, running or cancelling job, oldest first (the reconciler's worklist)."""
    query = select(Job).where(Job.status.in_(UNFINISHED_STATUSES)).order_by(Job.created_at)
    return list(session.scalars(query))


def delete_job_row(session: Session, job_id: str) -> bool:
    """Delete a finished job's row; its events, metrics, checkpoint and idempotency rows go with it (ON
    DELETE CASCADE). Only a terminal job is deleted, so a worker can never write to a vanished row. The
    caller has removed its files and commits; False when the job was not terminal (or is gone)."""
    result = session.execute(
        delete(Job)
        .where(Job.id == job_id, Job.status.in_(TERMINAL_STATUSES))
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def finished_before(session: Session, cutoff: datetime, limit: int = 100) -> list[Job]:
    """Terminal jobs that finished before `cutoff`, oldest first (what retention removes)."""
    query = (
        select(Job)
        .where(Job.status.in_(TERMINAL_STATUSES), Job.finished_at < cutoff)
        .order_by(Job.finished_at)
        .limit(limit)
    )
    return list(session.scalars(query))


def jobs_using_dataset(session: Session, project_id: str, dataset_id: str) -> list[str]:
    """Ids of the project's unfinished jobs whose spec names the dataset."""
    query = select(Job.id, Job.spec).where(Job.project_id == project_id, Job.status.in_(UNFINISHED_STATUSES))
    return [
        job_id
        for job_id, spec in session.execute(query)
        if (spec.get("dataset") or {}).get("id") == dataset_id
    ]


def list_job_rows(
    session: Session, project_id: str, *, status: str | None, after: str | None, limit: int
) -> tuple[list[Job], bool] | None:
    query = select(Job).where(Job.project_id == project_id)
    if status is not None:
        query = query.where(Job.status == status)
    return newest_first_page(session, Job, query, after, limit)


def count_by_status(session: Session) -> dict[str, int]:
    """Jobs per status over all projects (for /metrics)."""
    return dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
