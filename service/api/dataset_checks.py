"""What a job spec asks of an uploaded dataset, checked against its stored row before anything is queued."""

from __future__ import annotations

from sqlalchemy.orm import Session

from peagle_core.spec import JobSpec
from service.api.errors import ApiError
from service.crud import datasets as datasets_crud
from service.db.models import Dataset


def dataset_for_spec(db: Session, project_id: str, spec: JobSpec, *, lock: bool = False) -> Dataset:
    """The project's dataset `spec.dataset.id`; 422 when it is unknown, or holds prompts-only conversations
    (no assistant turn) while the spec does not regenerate their answers. With `lock`, the row stays locked
    until the commit, so a concurrent DELETE waits and then sees the job (409)."""
    read = datasets_crud.lock_dataset if lock else datasets_crud.get_dataset_row
    ds = read(db, project_id, spec.dataset.id or "")
    if ds is None:
        raise ApiError(
            422, f"no dataset with id {spec.dataset.id!r}", code="dataset_not_found", param="spec.dataset.id"
        )
    if ds.prompts_only_records and spec.dataset.regenerate is None:
        raise ApiError(
            422,
            f"dataset {ds.id} has {ds.prompts_only_records} of {ds.num_records} conversations without an "
            "assistant turn (prompts only): set dataset.regenerate so that the verifier writes the answers",
            code="prompts_only_dataset",
            param="spec.dataset.regenerate",
        )
    return ds
