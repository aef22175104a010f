"""/v1/jobs/{id}/tensorboard: a job's TensorBoard event files as a tar stream (`tensorboard --logdir`)."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from service.api import schemas
from service.api.body_route import BodyRoute
from service.api.deps import DB, AppStore, CurrentProject
from service.api.errors import ApiError, not_found
from service.api.tarstream import tar_plan, tar_stream
from service.crud.jobs import get_job_row
from service.tracking import tensorboard_key

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=BodyRoute)


@router.get(
    "/{job_id}/tensorboard",
    responses={
        **schemas.error_responses(401, 404),
        200: {"content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}},
    },
    response_class=StreamingResponse,
    summary="Download the job's TensorBoard event files as a tar stream",
    description="Present when the spec has `tracking.report_to: [tensorboard]`; while the job runs, the "
    "archive holds the events logged so far.",
)
def tensorboard_archive(job_id: str, db: DB, store: AppStore, project: CurrentProject) -> StreamingResponse:
    job = get_job_row(db, project.id, job_id)
    if job is None:
        raise not_found("job", job_id)
    key = tensorboard_key(job.id)
    names = store.list_files(key)
    if not names:
        raise ApiError(
            404,
            f"job {job.id} has no TensorBoard event files (tracking.report_to lacks tensorboard, "
            "or nothing was logged yet)",
            code="tensorboard_not_found",
        )
    # Sizes are taken now: a live event file only grows, and the archive holds the records written so far.
    files = [{"name": n, "size": store.size(f"{key}/{n}")} for n in names]
    top = f"{job.id}-tensorboard"
    plan, total = tar_plan(top, files, int(time.time()))
    return StreamingResponse(
        tar_stream(store, key, plan, total),
        media_type="application/x-tar",
        headers={"Content-Length": str(total), "Content-Disposition": f'attachment; filename="{top}.tar"'},
    )
