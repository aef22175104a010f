"""Uploaded datasets: rows are inserted only after the JSONL is stored and validated."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.crud.pagination import newest_first_page
from service.db.models import Dataset, utcnow


def add_dataset(
    session: Session,
    *,
    dataset_id: str,
    project_id: str,
    filename: str,
    uri: str,
    sha256: str,
    size: int,
    num_records: int,
    format: str,
    prompts_only_records: int = 0,
) -> Dataset:
    """Add the row of a JSONL already stored under `uri` (the caller commits)."""
    row = Dataset(
        id=dataset_id,
        project_id=project_id,
        filename=filename,
        uri=uri,
        sha256=sha256,
        size=size,
        num_records=num_records,
        format=format,
        prompts_only_records=prompts_only_records,
        created_at=utcnow(),
    )
    session.add(row)
    return row


def get_dataset(session: Session, project_id: str, dataset_id: str) -> Dataset | None:
    return session.scalar(select(Dataset).where(Dataset.id == dataset_id, Dataset.project_id == project_id))


def delete_dataset(session: Session, dataset_id: str) -> None:
    """Delete the row (the caller has removed its file and commits)."""
    session.execute(delete(Dataset).where(Dataset.id == dataset_id))


def list_datasets(
    session: Session, project_id: str, *, after: str | None, limit: int
) -> tuple[list[Dataset], bool] | None:
    return newest_first_page(
        session, Dataset, select(Dataset).where(Dataset.project_id == project_id), after, limit
    )
