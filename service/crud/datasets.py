"""Uploaded datasets: rows are inserted only after the JSONL is stored and validated."""

from __future__ import annotations

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from service.crud.pagination import newest_first_page
from service.crud.usage import set_usage
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
    """Add the row of a JSONL already stored under `uri`, and its bytes to the project's storage ledger
    (the caller commits)."""
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
    set_usage(session, project_id, "dataset", uri, size)
    return row


def get_dataset_row(session: Session, project_id: str, dataset_id: str) -> Dataset | None:
    return session.scalar(select(Dataset).where(Dataset.id == dataset_id, Dataset.project_id == project_id))


def lock_dataset(session: Session, project_id: str, dataset_id: str) -> Dataset | None:
    """The dataset row, locked until the transaction ends, or None if it does not exist (any more).

    A DELETE and a job create naming the dataset both take this lock first, so one of them sees the
    other's commit: a job is never queued on a deleted dataset. Postgres locks the row; SQLite has no row
    locks, so a no-op UPDATE takes its database write lock (pysqlite opens the transaction at that first
    write, so what is read after it is current). Lock order: the dataset before the project row."""
    if session.get_bind().dialect.name == "sqlite":
        session.execute(
            update(Dataset)
            .where(Dataset.id == dataset_id, Dataset.project_id == project_id)
            .values(id=Dataset.id)
            .execution_options(synchronize_session=False)
        )
        return session.scalar(
            select(Dataset)
            .where(Dataset.id == dataset_id, Dataset.project_id == project_id)
            .execution_options(populate_existing=True)
        )
    return session.scalar(
        select(Dataset)
        .where(Dataset.id == dataset_id, Dataset.project_id == project_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )


def delete_dataset_row(session: Session, dataset_id: str) -> None:
    """Delete the row (the caller has removed its file and commits)."""
    session.execute(delete(Dataset).where(Dataset.id == dataset_id))


def list_dataset_rows(
    session: Session, project_id: str, *, after: str | None, limit: int
) -> tuple[list[Dataset], bool] | None:
    return newest_first_page(
        session, Dataset, select(Dataset).where(Dataset.project_id == project_id), after, limit
    )
