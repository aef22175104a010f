"""Plans: `POST /v1/jobs/plan` queues what a job would cost for a worker and answers 202 at once;
`GET /v1/plans/{id}` reads the answer (optionally long-polling without holding a thread).

No request waits on a thread of the shared pool: the POST only checks, records and enqueues, and the
long poll sleeps on the event loop between short status reads.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query, Request, Response
from redis.exceptions import RedisError
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import StaleDataError

from peagle_core.spec import JobSpec
from service.api import schemas
from service.api.admission import admit_with_dataset
from service.api.body_route import BodyRoute
from service.api.deps import DB, AppSettings, CurrentProject, RedisConn
from service.api.errors import ApiError, envelope, not_found
from service.api.quotas import check_new_plan
from service.crud import plans as plans_crud
from service.db.models import Plan, utcnow
from service.db.vanished import RowVanished
from service.queue import enqueue_plan, plan_outcome, withdraw_plan
from service.redact import redact_paths

log = logging.getLogger("peagle.api")
router = APIRouter(tags=["plans"], route_class=BodyRoute)
_POLL_S = 0.25
# A plan RQ does not know yet may still be on its way there (the row is committed before the enqueue).
_ENQUEUE_GRACE = timedelta(seconds=30)


@router.post(
    "/v1/jobs/plan",
    status_code=202,
    response_model=schemas.PlanPublic,
    responses={
        202: schemas.id_links("plan_id", *schemas.PLAN_OPS),
        **schemas.error_responses(401, 403, 413, 415, 422, 429, 503),
    },
    summary="Plan a job without creating it",
    description='Body: the same `{"spec": JobSpec}` as `POST /v1/jobs`; no job is created or queued. The '
    "answer is 202 with a plan to poll (`Location: /v1/plans/{id}`, or `GET /v1/plans/{id}?wait=20`): a "
    "worker of the spec's queue prepares the data and returns counts after preparation, cache bytes per "
    "dtype against `max_cache_bytes` and free space, optimizer steps and a wall-time estimate per stage, "
    "from a short calibration on its device or from rates stored by an earlier one (`estimates_from`). "
    "The project's allowed queues apply, and plans in flight are capped per API key and per project "
    "(429 `plans_limit`). A plan no worker answers within the service's `plan_timeout_s` fails with "
    "`plan_timeout`.",
)
def create_plan(
    body: schemas.JobCreate,
    request: Request,
    response: Response,
    db: DB,
    redis: RedisConn,
    settings: AppSettings,
    project: CurrentProject,
    recalibrate: Annotated[bool, Query(description="Calibrate again even if rates are stored.")] = False,
) -> schemas.PlanPublic:
    spec, ds = admit_with_dataset(db, body.spec, settings, project.id)
    queue = spec.resources.queue
    data = {"uri": ds.uri, "sha256": ds.sha256} if ds is not None else {"path": spec.dataset.path}
    key_hash: str = request.state.key_hash
    # Answered plans nobody read yet must not count against the limits.
    for old in plans_crud.in_flight(db, project.id):
        with contextlib.suppress(RowVanished):  # purged meanwhile: it counts against nothing either
            _refresh(db, redis, old)
    check_new_plan(db, project.id, key_hash, queue, settings)
    plan = plans_crud.create_plan_row(db, project.id, key_hash, queue, settings.plan_timeout_s)
    db.commit()
    try:
        enqueue_plan(
            redis,
            queue,
            plan.id,
            spec.model_dump(mode="json", exclude_unset=True),
            data,
            settings.plan_timeout_s,
            recalibrate=recalibrate,
        )
    except RedisError as exc:
        plans_crud.finish_plan(plan, error=_error(503, "queue_unavailable", "the job queue is unavailable"))
        db.commit()
        raise ApiError(
            503, f"the job queue is unavailable ({exc.__class__.__name__})", code="queue_unavailable"
        ) from None
    response.headers["Location"] = f"/v1/plans/{plan.id}"
    return schemas.PlanPublic.model_validate(plan)


@router.get(
    "/v1/plans/{plan_id}",
    response_model=schemas.PlanPublic,
    responses=schemas.error_responses(401, 404, 503),
    summary="A plan: its status, and its result or error once answered",
    description="With `wait=N`, answers as soon as the plan is answered or after N seconds, whichever "
    "comes first (a long poll; it holds no server thread while it waits).",
)
async def get_plan(
    plan_id: str,
    db: DB,
    redis: RedisConn,
    project: CurrentProject,
    wait: Annotated[
        float, Query(ge=0, le=60, description="Seconds to wait for the answer (long poll).")
    ] = 0.0,
) -> schemas.PlanPublic:
    project_id = project.id

    def read() -> Plan | None:
        plan = plans_crud.get_plan_row(db, project_id, plan_id)
        if plan is not None:
            plan = _refresh(db, redis, plan)
        db.commit()  # end the read (objects stay loaded): a long poll holds no pooled connection
        return plan

    plan = await anyio.to_thread.run_sync(read)
    if plan is None:
        raise not_found("plan", plan_id)
    with anyio.move_on_after(wait):
        while plan.status in plans_crud.IN_FLIGHT:
            await anyio.sleep(_POLL_S)
            plan = await anyio.to_thread.run_sync(_refresh, db, redis, plan)
    return schemas.PlanPublic.model_validate(plan)


def _refresh(db: Session, redis: RedisConn, plan: Plan) -> Plan:
    """Bring an unanswered plan's row up to date with RQ (its answer, a worker taking it, or its deadline
    passing: then it is withdrawn from the queue) and commit; RowVanished when housekeeping purged the
    row meanwhile."""
    if plan.status not in plans_crud.IN_FLIGHT:
        return plan
    plan_id = plan.id
    try:
        state, value = plan_outcome(redis, plan.id)
        now = utcnow()
        if state == "succeeded":
            if isinstance(value, dict) and isinstance(value.get("error"), dict):
                plans_crud.finish_plan(plan, error=_worker_error(value["error"]))
            else:
                plans_crud.finish_plan(plan, result=value if isinstance(value, dict) else {"value": value})
        elif state == "failed":
            log.warning("plan %s failed on the worker", plan.id)
            plans_crud.finish_plan(plan, error=_error(502, "plan_failed", "the worker failed while planning"))
        elif now >= plan.deadline_at or (state == "missing" and now >= plan.created_at + _ENQUEUE_GRACE):
            withdraw_plan(redis, plan.queue, plan.id)
            timeout = (plan.deadline_at - plan.created_at).total_seconds()
            plans_crud.finish_plan(
                plan,
                error=_error(
                    503,
                    "plan_timeout",
                    f"no worker of queue {plan.queue!r} finished the plan within {timeout:.0f} s "
                    "(all busy or none running)",
                ),
            )
        elif state == "running":
            plans_crud.set_running(plan)
        else:
            return plan
    except RedisError as exc:
        db.rollback()
        raise ApiError(
            503, f"the job queue is unavailable ({exc.__class__.__name__})", code="queue_unavailable"
        ) from None
    try:
        db.commit()
    except StaleDataError:  # the UPDATE found no row
        db.rollback()
        raise RowVanished("plan", plan_id) from None
    return plan


def _error(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return envelope(status, message, code=code, param=param)["error"]


def _worker_error(err: dict[str, Any]) -> dict[str, Any]:
    """The worker's `{code, message, param}` for a spec or data the plan refused, as the API names it."""
    param = err.get("param")
    if isinstance(param, str) and param.split(".")[0] in JobSpec.model_fields:
        param = f"spec.{param}"  # a spec field; other params name a data line or file
    return _error(
        422,
        str(err.get("code") or "invalid_request"),
        redact_paths(str(err.get("message") or "")),
        redact_paths(param) if isinstance(param, str) else None,
    )
