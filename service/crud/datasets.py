"""Uploaded datasets: rows are inserted only after the JSONL is stored and validated."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.crud.pagination import newest_first_page
from service.db.models import Dataset


def get_dataset(session: Session, project_id: str, dataset_id: str) -> Dataset | None:
    return session.scalar(select(Dataset).where(Dataset.id == dataset_id, Dataset.project_id == project_id))


def list_datasets(
    session: Session, project_id: str, *, after: str | None, limit: int
) -> tuple[list[Dataset], bool] | None:
    return newest_first_page(
        session, Dataset, select(Dataset).where(Dataset.project_id == project_id), after, limit
    )
