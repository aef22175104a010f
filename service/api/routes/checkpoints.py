"""/v1/checkpoints: inspect, download the directory as a tar stream, or one file with HTTP Range."""

from __future__ import annotations

import base64
import mimetypes
import re
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Header, Request
from fastapi.responses import StreamingResponse

from service.api import schemas
from service.api.body_route import BodyRoute
from service.api.byte_ranges import parse_range
from service.api.deps import DB, AppStore, CurrentProject
from service.api.errors import ApiError, not_found
from service.api.tarstream import tar_plan, tar_stream
from service.crud.checkpoints import get_checkpoint
from service.db.models import Checkpoint
from service.lifecycle import delete_checkpoint_with_files

router = APIRouter(prefix="/v1/checkpoints", tags=["checkpoints"], route_class=BodyRoute)

_ERRORS = schemas.error_responses(401, 404)


def _checkpoint_or_404(db: DB, project_id: str, checkpoint_id: str) -> Checkpoint:
    row = get_checkpoint(db, project_id, checkpoint_id)
    if row is None:
        raise not_found("checkpoint", checkpoint_id)
    return row


@router.get(
    "/{checkpoint_id}",
    response_model=schemas.CheckpointPublic,
    responses=_ERRORS,
    summary="Inspect a checkpoint",
)
def checkpoint(checkpoint_id: str, db: DB, project: CurrentProject) -> schemas.CheckpointPublic:
    return schemas.CheckpointPublic.model_validate(_checkpoint_or_404(db, project.id, checkpoint_id))


@router.delete(
    "/{checkpoint_id}",
    response_model=schemas.Deleted,
    responses=_ERRORS,
    summary="Delete a checkpoint (its files, then its row)",
)
def delete_checkpoint(
    checkpoint_id: str, db: DB, store: AppStore, project: CurrentProject
) -> schemas.Deleted:
    delete_checkpoint_with_files(db, store, _checkpoint_or_404(db, project.id, checkpoint_id))
    db.commit()
    return schemas.Deleted(id=checkpoint_id, object="checkpoint")


@router.get(
    "/{checkpoint_id}/archive",
    responses={
        **_ERRORS,
        200: {"content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}},
    },
    response_class=StreamingResponse,
    summary="Download the checkpoint directory as a tar stream",
)
def archive(checkpoint_id: str, db: DB, store: AppStore, project: CurrentProject) -> StreamingResponse:
    ckpt = _checkpoint_or_404(db, project.id, checkpoint_id)
    # The checkpoint's files under a top directory named after it, stamped with its publication time.
    plan, total = tar_plan(ckpt.id, ckpt.files, int(ckpt.created_at.timestamp()))
    return StreamingResponse(
        tar_stream(store, ckpt.uri, plan, total),
        media_type="application/x-tar",
        headers={
            "Content-Length": str(total),
            "Content-Disposition": _attachment(f"{ckpt.id}.tar"),
            "X-Content-Type-Options": "nosniff",
            "X-Checkpoint-Sha256": ckpt.sha256,
        },
    )


def _attachment(name: str) -> str:
    """`attachment` with an ASCII fallback name and the exact UTF-8 name (RFC 6266 / 5987)."""
    base = name.rsplit("/", 1)[-1]
    ascii_name = re.sub(r"[^A-Za-z0-9._-]", "_", base) or "download"
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(base, safe='')}"


@router.get(
    "/{checkpoint_id}/files/{name}",
    responses={
        **_ERRORS,
        200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        206: {"description": "Partial content (single byte range)."},
        **schemas.error_responses(416),
    },
    response_class=StreamingResponse,
    summary="Download one checkpoint file (HTTP Range supported)",
)
def file(
    checkpoint_id: str,
    name: str,
    request: Request,
    db: DB,
    store: AppStore,
    project: CurrentProject,
    range: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> StreamingResponse:
    ckpt = _checkpoint_or_404(db, project.id, checkpoint_id)
    # Only names in the recorded file list are served, so `..` or absolute paths never reach the store.
    entry = next((f for f in ckpt.files if f["name"] == name), None)
    if entry is None:
        raise ApiError(404, f"checkpoint {ckpt.id} has no file {name!r}", code="file_not_found")
    size = int(entry["size"])
    digest = base64.b64encode(bytes.fromhex(entry["sha256"])).decode()
    headers = {
        "Accept-Ranges": "bytes",
        # A download, never a page: a checkpoint file (README.md, any name a worker wrote) must not be
        # rendered or sniffed into HTML by a browser on the API's origin.
        "Content-Disposition": _attachment(name),
        "X-Content-Type-Options": "nosniff",
        "ETag": f'"{entry["sha256"]}"',
        "X-Checksum-Sha256": entry["sha256"],
        "Repr-Digest": f"sha-256=:{digest}:",
    }
    span = parse_range(range, size) if range else None
    if span is not None and request.headers.get("if-range") not in (None, headers["ETag"]):
        span = None  # the client's copy is stale: send the whole file
    media = mimetypes.guess_type(name)[0] or "application/octet-stream"
    key = f"{ckpt.uri}/{name}"
    if span is None:
        headers["Content-Length"] = str(size)
        return StreamingResponse(store.iter_range(key, 0, None), media_type=media, headers=headers)
    start, end = span
    headers["Content-Length"] = str(end - start)
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    return StreamingResponse(
        store.iter_range(key, start, end), status_code=206, media_type=media, headers=headers
    )
