"""Liveness, readiness (database and Redis reachable) and Prometheus metrics; no API key (the cross-project
gauges of /metrics need `PEAGLE_METRICS_TOKEN` when it is set)."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Header
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from service.api import schemas
from service.api.body_route import BodyRoute
from service.api.deps import AppMetrics, AppSettings, RedisConn, Sessions
from service.api.errors import ApiError

router = APIRouter(tags=["health"], route_class=BodyRoute)


@router.get("/healthz", response_model=schemas.Health, summary="Liveness")
def healthz() -> schemas.Health:
    return schemas.Health()


def _check(sessions: Sessions, redis: RedisConn) -> tuple[str, str] | None:
    try:
        with sessions() as db:
            db.execute(text("SELECT 1"))
    except Exception as exc:
        return "database_unavailable", f"the database is unreachable ({exc.__class__.__name__})"
    try:
        redis.ping()
    except Exception as exc:
        return "queue_unavailable", f"redis is unreachable ({exc.__class__.__name__})"
    return None


@router.get(
    "/readyz",
    response_model=schemas.Readiness,
    responses=schemas.error_responses(503),
    summary="Readiness: the database and Redis answer",
)
async def readyz(sessions: Sessions, redis: RedisConn) -> schemas.Readiness | JSONResponse:
    problem = await run_in_threadpool(_check, sessions, redis)
    if problem is not None:
        return ApiError(503, problem[1], code=problem[0]).response()
    return schemas.Readiness()


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    summary="Prometheus metrics",
    description="HTTP traffic always; the jobs-by-status and queue-depth gauges (every project's) only "
    "with `Authorization: Bearer <PEAGLE_METRICS_TOKEN>` when that setting is set.",
)
async def metrics(
    app_metrics: AppMetrics,
    settings: AppSettings,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Response:
    body = await run_in_threadpool(generate_latest, app_metrics.registry)
    token = settings.metrics_token
    presented = (authorization or "").removeprefix("Bearer ").strip()
    if token is None or secrets.compare_digest(presented.encode(), token.get_secret_value().encode()):
        body += await run_in_threadpool(generate_latest, app_metrics.state)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
