"""/v1/datasets: upload a JSONL dataset (streamed, size-capped, validated, checksummed), list, inspect."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.exc import SQLAlchemyError

from peagle_core.errors import DataError
from service.api import schemas
from service.api.deps import DB, AppSettings, CurrentProject, Store
from service.api.errors import ApiError, not_found
from service.api.quotas import reserve_upload, settle_upload
from service.api.upload import SpooledFile, spool_multipart_file
from service.artifacts import ArtifactStore
from service.crud import datasets as crud
from service.crud.jobs import jobs_using_dataset
from service.db.models import Dataset, new_id
from service.lifecycle import delete_dataset as delete_dataset_files_and_row

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

_ERRORS = schemas.error_responses(401, 404)
_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary", "description": "JSONL data"}
                    },
                }
            }
        },
    }
}


def _chunks(path: Path, size: int = 1 << 20) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(size):
            yield block


@router.post(
    "",
    status_code=201,
    response_model=schemas.Dataset,
    responses={
        **_ERRORS,
        201: schemas.id_links("dataset_id", *schemas.DATASET_OPS),
        **schemas.error_responses(403, 413, 415, 422),
    },
    openapi_extra=_UPLOAD_BODY,
    summary="Upload a JSONL dataset",
    description="multipart/form-data with a `file` field holding JSONL chat data (`messages` or ShareGPT "
    "`conversations`, or pre-tokenized). Larger than the service's cap: 413. Structurally invalid: 422 "
    "naming the line. Conversations without an assistant turn are counted in `prompts_only_records`: "
    "a job trains on them only with `dataset.regenerate`.",
)
async def upload_dataset(
    request: Request,
    db: DB,
    store: Store,
    settings: AppSettings,
    project: CurrentProject,
    format: Annotated[Literal["auto", "messages", "sharegpt", "tokenized"], Query()] = "auto",
) -> schemas.Dataset:
    project_id = project.id
    declared = request.headers.get("content-length", "")
    # Room is reserved (under the project lock) before a byte is spooled: concurrent uploads each hold
    # their own share of the cap, and the upload may write no more than it reserved.
    reservation, room = await run_in_threadpool(
        reserve_upload,
        db,
        project_id,
        int(declared) if declared.isdigit() else None,
        settings.max_upload_bytes,
    )
    try:
        spool_dir = Path(settings.data_dir) / "tmp"
        spool_dir.mkdir(parents=True, exist_ok=True)
        spooled = await spool_multipart_file(
            request,
            "file",
            spool_dir / f"upload-{uuid.uuid4().hex}",
            min(room, settings.max_upload_bytes),
            over_limit=None if room >= settings.max_upload_bytes else _over_reservation,
        )
        try:
            row = await run_in_threadpool(
                _store_and_record,
                store,
                db,
                project_id,
                spooled,
                format,
                settings.max_line_bytes,
                reservation,
            )
        finally:
            with contextlib.suppress(OSError):
                spooled.path.unlink()
    except BaseException:
        await run_in_threadpool(_release, db, reservation)
        raise
    return schemas.Dataset.model_validate(row)


def _over_reservation(limit: int) -> ApiError:
    return ApiError(
        403,
        f"the upload passes the {limit} bytes left under this project's storage cap "
        "(limit storage_cap_bytes); delete datasets or jobs to make room",
        code="storage_quota_exceeded",
        param="file",
    )


def _release(db: DB, reservation: int) -> None:
    db.rollback()
    with contextlib.suppress(SQLAlchemyError):  # an unsettled reservation expires on its own
        settle_upload(db, reservation)
        db.commit()


def _store_and_record(
    store: ArtifactStore,
    db: DB,
    project_id: str,
    spooled: SpooledFile,
    fmt: str,
    max_line_bytes: int,
    reservation: int,
) -> Dataset:
    """Validate (line by line), copy to the store, insert the row and settle the reservation (its ledger
    row replaced by the dataset's); runs on a worker thread."""
    from peagle_core.data import validate_jsonl

    try:
        # Prompts-only conversations are stored and counted: a job trains on them only with regeneration.
        report = validate_jsonl(spooled.path, fmt=fmt, max_line_bytes=max_line_bytes, prompts_only_ok=True)
    except DataError as exc:
        raise ApiError(422, exc.message, code=exc.code, param="file") from None
    dataset_id = new_id("ds")
    key = f"datasets/{dataset_id}/data.jsonl"
    sha, size = store.write_stream(key, _chunks(spooled.path))
    if sha != spooled.sha256 or size != spooled.size:
        store.delete(key)
        raise ApiError(500, "stored dataset failed its checksum", code="checksum_mismatch")
    settle_upload(db, reservation)
    row = crud.add_dataset(
        db,
        dataset_id=dataset_id,
        project_id=project_id,
        filename=spooled.filename or "data.jsonl",
        uri=key,
        sha256=sha,
        size=size,
        num_records=report.rows,
        format=str(report.format),
        prompts_only_records=report.prompts_only_rows,
    )
    try:
        db.commit()
    except BaseException:
        db.rollback()
        store.delete(key)
        raise
    return row


@router.get("", response_model=schemas.DatasetList, responses=_ERRORS, summary="List datasets, newest first")
def list_datasets(
    db: DB,
    project: CurrentProject,
    after: Annotated[str | None, Query(max_length=64, description="Cursor: a dataset id.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> schemas.DatasetList:
    page = crud.list_datasets(db, project.id, after=after, limit=limit)
    if page is None:
        raise ApiError(422, f"unknown cursor {after!r}", code="invalid_cursor", param="after")
    rows, has_more = page
    return schemas.DatasetList.of(rows, has_more)


@router.get("/{dataset_id}", response_model=schemas.Dataset, responses=_ERRORS, summary="Inspect a dataset")
def get_dataset(dataset_id: str, db: DB, project: CurrentProject) -> schemas.Dataset:
    row = crud.get_dataset(db, project.id, dataset_id)
    if row is None:
        raise not_found("dataset", dataset_id)
    return schemas.Dataset.model_validate(row)


@router.delete(
    "/{dataset_id}",
    response_model=schemas.Deleted,
    responses={**_ERRORS, **schemas.error_responses(409)},
    summary="Delete a dataset (its file, then its row)",
    description="A dataset that a queued or running job will read answers 409 naming the job.",
)
def delete_dataset(dataset_id: str, db: DB, store: Store, project: CurrentProject) -> schemas.Deleted:
    # Locked before the in-use check: a job create naming it waits, then finds it gone (or we see its job).
    row = crud.lock_dataset(db, project.id, dataset_id)
    if row is None:
        raise not_found("dataset", dataset_id)
    if users := jobs_using_dataset(db, project.id, dataset_id):
        raise ApiError(
            409,
            f"dataset {dataset_id} is used by unfinished job {users[0]}; cancel it or wait until it ends",
            code="dataset_in_use",
            param="dataset_id",
        )
    delete_dataset_files_and_row(db, store, row)
    db.commit()
    return schemas.Deleted(id=dataset_id, object="dataset")
