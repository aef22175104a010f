"""Published checkpoints: inserted by the worker after the files are in place, read by the API."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.artifacts import FileEntry, manifest_sha256
from service.crud.usage import set_usage
from service.db.models import Checkpoint, utcnow


def add_checkpoint(
    session: Session,
    *,
    job_id: str,
    project_id: str,
    step: int,
    uri: str,
    files: list[FileEntry],
    metrics: dict[str, Any] | None = None,
    servable: str = "unverified",
    checkpoint_id: str | None = None,
) -> Checkpoint:
    """Add the row of a directory `ArtifactStore.publish_dir` has published under `uri`, and its bytes to
    the project's storage ledger (the caller commits). Its sha256 and size are derived from `files`, the
    list `publish_dir` returned."""
    row = Checkpoint(
        job_id=job_id,
        project_id=project_id,
        step=step,
        uri=uri,
        files=list(files),
        sha256=manifest_sha256(files),
        size=sum(int(f["size"]) for f in files),
        metrics=metrics,
        servable=servable,
        created_at=utcnow(),
    )
    if checkpoint_id is not None:
        row.id = checkpoint_id
    session.add(row)
    set_usage(session, project_id, "checkpoint", uri, row.size, job_id=job_id)
    return row


def get_checkpoint(session: Session, project_id: str, checkpoint_id: str) -> Checkpoint | None:
    return session.scalar(
        select(Checkpoint).where(Checkpoint.id == checkpoint_id, Checkpoint.project_id == project_id)
    )


def delete_checkpoint_row(session: Session, checkpoint_id: str) -> bool:
    """Delete the row (the caller has removed its files and commits); False when it was gone already."""
    result = session.execute(delete(Checkpoint).where(Checkpoint.id == checkpoint_id))
    return result.rowcount == 1


def find_checkpoint(session: Session, checkpoint_id: str) -> Checkpoint | None:
    """The checkpoint in any project (for the worker, which publishes by id)."""
    return session.get(Checkpoint, checkpoint_id)


def list_for_job(session: Session, job_id: str) -> list[Checkpoint]:
    return list(
        session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step))
    )


def list_for_jobs(session: Session, job_ids: list[str]) -> list[Checkpoint]:
    """The checkpoints of several jobs (a page of the dashboard's job list), by job and step."""
    if not job_ids:
        return []
    query = (
        select(Checkpoint).where(Checkpoint.job_id.in_(job_ids)).order_by(Checkpoint.job_id, Checkpoint.step)
    )
    return list(session.scalars(query))
