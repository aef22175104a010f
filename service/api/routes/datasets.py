"""/v1/datasets: upload a JSONL dataset (streamed, size-capped, validated, checksummed), list, inspect."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from service.api import actions, schemas
from service.api.body_route import BodyRoute
from service.api.deps import DB, AppSettings, AppStore, CurrentProject
from service.api.errors import ApiError, not_found
from service.crud import datasets as crud

router = APIRouter(prefix="/v1/datasets", tags=["datasets"], route_class=BodyRoute)

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


@router.post(
    "",
    status_code=201,
    response_model=schemas.DatasetPublic,
    responses={
        **_ERRORS,
        201: schemas.id_links("dataset_id", *schemas.DATASET_OPS),
        **schemas.error_responses(400, 403, 413, 415, 422),
    },
    openapi_extra=_UPLOAD_BODY,
    summary="Upload a JSONL dataset",
    description="multipart/form-data with a `file` field holding JSONL chat data (`messages` or ShareGPT "
    "`conversations`, or pre-tokenized). Malformed framing (a boundary RFC 2046 does not allow, broken part "
    "headers): 400 naming it. Larger than the service's cap: 413. Structurally invalid: 422 "
    "naming the line. Conversations without an assistant turn are counted in `prompts_only_records`: "
    "a job trains on them only with `dataset.regenerate`.",
)
async def upload_dataset(
    request: Request,
    db: DB,
    store: AppStore,
    settings: AppSettings,
    project: CurrentProject,
    format: Annotated[actions.DataFormat, Query()] = "auto",
) -> schemas.DatasetPublic:
    upload = actions.UploadDataset(project=project, request=request, format=format)
    row = await actions.upload_dataset_request(upload, db=db, store=store, settings=settings)
    return schemas.DatasetPublic.model_validate(row)


@router.get(
    "", response_model=schemas.DatasetsPublic, responses=_ERRORS, summary="List datasets, newest first"
)
def list_datasets(
    db: DB,
    project: CurrentProject,
    after: Annotated[str | None, Query(max_length=64, description="Cursor: a dataset id.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> schemas.DatasetsPublic:
    page = crud.list_dataset_rows(db, project.id, after=after, limit=limit)
    if page is None:
        raise ApiError(422, f"unknown cursor {after!r}", code="invalid_cursor", param="after")
    rows, has_more = page
    return schemas.DatasetsPublic.of(rows, has_more)


@router.get(
    "/{dataset_id}",
    response_model=schemas.DatasetPublic,
    responses={**_ERRORS, 200: schemas.id_links("dataset_id", *schemas.DATASET_OPS)},
    summary="Inspect a dataset",
)
def get_dataset(dataset_id: str, db: DB, project: CurrentProject) -> schemas.DatasetPublic:
    row = crud.get_dataset_row(db, project.id, dataset_id)
    if row is None:
        raise not_found("dataset", dataset_id)
    return schemas.DatasetPublic.model_validate(row)


@router.delete(
    "/{dataset_id}",
    response_model=schemas.Deleted,
    responses={**_ERRORS, **schemas.error_responses(409)},
    summary="Delete a dataset (its file, then its row)",
    description="A dataset that a queued or running job will read answers 409 naming the job.",
)
def delete_dataset(dataset_id: str, db: DB, store: AppStore, project: CurrentProject) -> schemas.Deleted:
    actions.delete_dataset_request(
        actions.DeleteDataset(project=project, dataset_id=dataset_id), db=db, store=store
    )
    return schemas.Deleted(id=dataset_id, object="dataset")
