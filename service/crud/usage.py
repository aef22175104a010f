"""The storage ledger: bytes each project causes, by artifact key, and upload reservations.

Every writer records what it stored (`record_usage`, the worker's hook at each publish point; the API for
datasets), and every delete goes through `keys_freed_by_job` / `forget_key`, so that a project's usage is
one query and a DELETE or retention frees what it counted. Writes here take no lock themselves: callers
that check a cap hold `service.crud.locks.lock_project`; `record_usage` takes it for the worker.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import delete, func, or_, select
from sqlalchemy.orm import Session

from service.crud.locks import lock_project
from service.db.models import Project, StorageUsage, utcnow

# What the ledger counts (the `kind` column): a reservation is an upload in flight.
KINDS = frozenset(
    {
        "dataset",
        "checkpoint",
        "training_checkpoint",
        "prepared",
        "regenerated",
        "cache",
        "tracker",
        "reservation",
    }
)
# An upload that never settles (its API process died) stops counting after this long.
RESERVATION_TTL = timedelta(hours=6)


def _live():
    return or_(StorageUsage.expires_at.is_(None), StorageUsage.expires_at > utcnow())


def storage_used(session: Session, project_id: str) -> int:
    """Bytes the project stores or has reserved: each key counted once, at its largest recorded size."""
    per_key = (
        select(func.max(StorageUsage.bytes).label("b"))
        .where(StorageUsage.project_id == project_id, _live())
        .group_by(StorageUsage.key)
        .subquery()
    )
    return int(session.scalar(select(func.coalesce(func.sum(per_key.c.b), 0))) or 0)


def _row(session: Session, project_id: str, key: str, job_id: str | None) -> StorageUsage | None:
    job = StorageUsage.job_id.is_(None) if job_id is None else StorageUsage.job_id == job_id
    return session.scalar(
        select(StorageUsage).where(StorageUsage.project_id == project_id, StorageUsage.key == key, job)
    )


def set_usage(
    session: Session, project_id: str, kind: str, key: str, nbytes: int, *, job_id: str | None = None
) -> StorageUsage:
    """Insert or update the ledger row of (`key`, `job_id`); the caller holds the project lock and commits."""
    if kind not in KINDS:
        raise ValueError(f"unknown storage kind {kind!r}")
    row = _row(session, project_id, key, job_id)
    if row is None:
        row = StorageUsage(project_id=project_id, kind=kind, key=key, job_id=job_id, bytes=0)
        session.add(row)
    row.kind, row.bytes, row.updated_at = kind, max(0, int(nbytes)), utcnow()
    return row


def record_usage(
    session: Session, project_id: str, kind: str, key: str, nbytes: int, *, job_id: str | None = None
) -> None:
    """Record that `key` holds `nbytes` of the project's data (for `job_id`, when a job caused it), under
    the project lock; the caller commits. The worker calls this where it publishes (or reuses) an
    artifact, so a delete racing it either sees the row or runs first and leaves nothing to reuse."""
    if lock_project(session, project_id) is None:
        return
    set_usage(session, project_id, kind, key, nbytes, job_id=job_id)


def reserve(session: Session, project: Project, nbytes: int, key: str) -> StorageUsage:
    """A reservation of `nbytes` for an upload to `key` (the caller checked the cap under the lock)."""
    row = StorageUsage(
        project_id=project.id,
        kind="reservation",
        key=key,
        job_id=None,
        bytes=max(0, int(nbytes)),
        expires_at=utcnow() + RESERVATION_TTL,
        updated_at=utcnow(),
    )
    session.add(row)
    return row


def release(session: Session, reservation_id: int) -> None:
    """Drop a reservation (settled or abandoned); the caller commits."""
    session.execute(delete(StorageUsage).where(StorageUsage.id == reservation_id))


def forget_key(session: Session, project_id: str, key: str) -> None:
    """Drop every ledger row of `key` (its files are deleted); the caller commits."""
    session.execute(
        delete(StorageUsage).where(StorageUsage.project_id == project_id, StorageUsage.key == key)
    )


def keys_freed_by_job(session: Session, project_id: str, job_id: str) -> list[str]:
    """The keys only `job_id` references: deleting the job deletes their files (the caller holds the
    project lock, deletes the files, then calls `forget_job`)."""
    mine = select(StorageUsage.key).where(StorageUsage.job_id == job_id).distinct()
    keys = list(session.scalars(mine))
    if not keys:
        return []
    shared = select(StorageUsage.key).where(
        StorageUsage.project_id == project_id,
        StorageUsage.key.in_(keys),
        or_(StorageUsage.job_id.is_(None), StorageUsage.job_id != job_id),
    )
    others = set(session.scalars(shared))
    return sorted(k for k in keys if k not in others)


def forget_job(session: Session, job_id: str) -> None:
    """Drop the job's ledger rows; the caller commits."""
    session.execute(delete(StorageUsage).where(StorageUsage.job_id == job_id))


def purge_expired_reservations(session: Session) -> int:
    """Delete reservations past their expiry; the caller commits."""
    result = session.execute(
        delete(StorageUsage).where(StorageUsage.expires_at.is_not(None), StorageUsage.expires_at <= utcnow())
    )
    return int(result.rowcount or 0)
