"""POST /v1/jobs/plan: what a job would cost, computed by a worker on its own device; nothing is queued."""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query
from redis.exceptions import RedisError
from rq.job import JobStatus

from peagle_core.spec import JobSpec
from service.api import schemas
from service.api.deps import DB, AppSettings, CurrentProject, RedisConn
from service.api.errors import ApiError
from service.crud import datasets as datasets_crud
from service.paths import check_spec_paths
from service.queue import enqueue_plan, withdraw_plan

log = logging.getLogger("peagle.api")
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
_POLL_S = 0.2


@router.post(
    "/plan",
    responses=schemas.error_responses(401, 422, 502, 503),
    summary="Plan a job without creating it",
    description='Body: the same `{"spec": JobSpec}` as `POST /v1/jobs`; no job is created or queued. A worker '
    "of the spec's queue prepares the data and returns counts after preparation, cache bytes per dtype "
    "against `max_cache_bytes` and free space, optimizer steps and a wall-time estimate per stage, from a "
    "short calibration on its device or from rates stored by an earlier one (`estimates_from`). Waits up "
    "to the service's `plan_timeout_s`; 503 `plan_timeout` when no worker of that queue was free.",
)
def plan_job(
    body: schemas.CreateJobRequest,
    db: DB,
    redis: RedisConn,
    settings: AppSettings,
    project: CurrentProject,
    recalibrate: Annotated[bool, Query(description="Calibrate again even if rates are stored.")] = False,
) -> dict[str, Any]:
    spec = check_spec_paths(body.spec, settings, project_id=project.id)
    if spec.dataset.id is not None:
        ds = datasets_crud.get_dataset(db, project.id, spec.dataset.id)
        if ds is None:
            raise ApiError(
                422,
                f"no dataset with id {spec.dataset.id!r}",
                code="dataset_not_found",
                param="spec.dataset.id",
            )
        data = {"uri": ds.uri, "sha256": ds.sha256}
    else:
        data = {"path": spec.dataset.path}
    queue = spec.resources.queue
    timeout = settings.plan_timeout_s
    try:
        rq_job = enqueue_plan(
            redis,
            queue,
            spec.model_dump(mode="json", exclude_unset=True),
            data,
            timeout,
            recalibrate=recalibrate,
        )
        deadline = time.monotonic() + timeout
        status = rq_job.get_status()
        while status not in (JobStatus.FINISHED, JobStatus.FAILED) and time.monotonic() < deadline:
            time.sleep(_POLL_S)  # a worker is computing: poll its status until it answers or time is up
            status = rq_job.get_status()
    except RedisError as exc:
        raise ApiError(
            503, f"the job queue is unavailable ({exc.__class__.__name__})", code="queue_unavailable"
        ) from None
    if status == JobStatus.FAILED:
        log.warning("plan %s failed on the worker", rq_job.id)
        raise ApiError(502, "the worker failed while planning; see its log", code="plan_failed")
    if status != JobStatus.FINISHED:
        withdraw_plan(redis, queue, rq_job)
        raise ApiError(
            503,
            f"no worker of queue {queue!r} finished the plan within {timeout:.0f} s (all busy or none running)",
            code="plan_timeout",
        )
    result = rq_job.return_value()
    if isinstance(result, dict) and "error" in result:
        err = result["error"]
        param = err.get("param")
        if param and param.split(".")[0] in JobSpec.model_fields:
            param = f"spec.{param}"  # a spec field; other params name a data line or file
        raise ApiError(422, err["message"], code=err.get("code"), param=param)
    return result
