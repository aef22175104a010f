"""/v1/jobs: create (validated, idempotent, enqueued), list, inspect, cancel, events (SSE), metrics."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session

from service.api import actions, schemas
from service.api.body_route import BodyRoute
from service.api.deps import (
    DB,
    AppSettings,
    AppStore,
    CurrentProject,
    RedisConn,
    Sessions,
    presented_key_hash,
)
from service.api.errors import ApiError, not_found
from service.api.quotas import StreamSlots
from service.api.request_text import MAX_IDEMPOTENCY_KEY_CHARS
from service.crud import checkpoints as checkpoints_crud
from service.crud import events as events_crud
from service.crud import jobs as jobs_crud
from service.crud import jobstate
from service.crud import metrics as metrics_crud
from service.crud.projects import key_is_live
from service.db.models import Job, Project
from service.settings import Settings

log = logging.getLogger("peagle.api")
router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=BodyRoute)

_ERRORS = schemas.error_responses(401, 404, 422)
MAX_ROW_ID = (1 << 63) - 1  # event and metric ids are BIGINTs: a larger cursor is a 422, not an overflow


def _job_or_404(db: DB, project_id: str, job_id: str) -> Job:
    job = jobs_crud.get_job_row(db, project_id, job_id)
    if job is None:
        raise not_found("job", job_id)
    return job


@router.post(
    "",
    status_code=201,
    response_model=schemas.JobPublic,
    responses={
        **_ERRORS,
        201: schemas.id_links("job_id", *schemas.JOB_OPS),
        **schemas.error_responses(403, 409, 413, 415, 429),
    },
    summary="Create a training job",
    description='Body: `{"spec": JobSpec}` as `application/json` (another Content-Type: 415). The spec '
    "is capped by its size as stored, defaults filled in (`PEAGLE_MAX_SPEC_BYTES`: 413), and validated "
    "(errors name the field, e.g. `spec.training.lr`), server paths are checked against the allowed roots, and the job is stored as "
    "`queued` before it is enqueued. The response carries the resolved spec (defaults filled in) and the "
    "spec as sent (`spec_submitted`), which is what the worker runs. "
    "With `Idempotency-Key`, a repeat of the same body returns the original job "
    "(`Idempotent-Replayed: true`); the same key with another body is a 409.",
)
def create_job(
    body: schemas.JobCreate,
    response: Response,
    db: DB,
    redis: RedisConn,
    settings: AppSettings,
    project: CurrentProject,
    idempotency_key: Annotated[
        str | None,
        # Its length and characters are checked by the action (the dashboard's form field too).
        Header(description=f"A retry token of at most {MAX_IDEMPOTENCY_KEY_CHARS} characters."),
    ] = None,
) -> schemas.JobPublic:
    request = actions.CreateJob(project=project, spec=body.spec, idempotency_key=idempotency_key)
    created = actions.create_job_request(request, db=db, redis=redis, settings=settings)
    if created.replayed:
        response.headers["Idempotent-Replayed"] = "true"
        response.status_code = 200
    else:
        response.headers["Location"] = f"/v1/jobs/{created.job.id}"
    return schemas.JobPublic.model_validate(created.job)


# A page of jobs holds at most this many times PEAGLE_MAX_SPEC_BYTES of specs (each job stores up to two,
# resolved and as sent): a page of 100 jobs at the cap would otherwise be 200 times the cap to serialise.
PAGE_SPEC_CAPS = 8


def _within_spec_budget(rows: list[Job], has_more: bool, budget: int) -> tuple[list[Job], bool]:
    """The first rows whose stored specs fit in `budget` bytes (at least one), and whether more follow."""
    total = 0
    for i, job in enumerate(rows):
        total += len(json.dumps(job.spec)) + len(json.dumps(job.spec_submitted))
        if total > budget and i > 0:
            return rows[:i], True
    return rows, has_more


@router.get(
    "",
    response_model=schemas.JobsPublic,
    responses=_ERRORS,
    summary="List jobs, newest first",
    description=f"At most `limit` jobs; a page stops earlier (`has_more`) once its jobs' specs pass "
    f"{PAGE_SPEC_CAPS} times `PEAGLE_MAX_SPEC_BYTES`.",
)
def list_jobs(
    db: DB,
    settings: AppSettings,
    project: CurrentProject,
    status: Annotated[schemas.JobStatus | None, Query(description="Only jobs in this status.")] = None,
    after: Annotated[
        str | None, Query(max_length=64, description="Cursor: a job id from the previous page.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> schemas.JobsPublic:
    page = jobs_crud.list_job_rows(db, project.id, status=status, after=after, limit=limit)
    if page is None:
        raise ApiError(422, f"unknown cursor {after!r}", code="invalid_cursor", param="after")
    rows, has_more = _within_spec_budget(*page, PAGE_SPEC_CAPS * settings.max_spec_bytes)
    return schemas.JobsPublic.of(rows, has_more)


# Links from every answer carrying a job, not only the create's: a client (or a stateful test) goes
# create -> inspect -> cancel -> delete along them.
_JOB_LINKS = {200: schemas.id_links("job_id", *schemas.JOB_OPS)}


@router.get(
    "/{job_id}",
    response_model=schemas.JobPublic,
    responses={**_ERRORS, **_JOB_LINKS},
    summary="Inspect a job",
)
def get_job(job_id: str, db: DB, project: CurrentProject) -> schemas.JobPublic:
    return schemas.JobPublic.model_validate(_job_or_404(db, project.id, job_id))


@router.post(
    "/{job_id}/cancel",
    response_model=schemas.JobPublic,
    responses={**_ERRORS, **_JOB_LINKS, **schemas.error_responses(409)},
    summary="Cancel a job",
    description="A queued job is cancelled at once. A running job becomes `cancelling`: the worker saves "
    "a checkpoint and stops (hard stop after the grace period). A finished job answers 409.",
)
def cancel_job(job_id: str, db: DB, redis: RedisConn, project: CurrentProject) -> schemas.JobPublic:
    job = actions.cancel_job_request(actions.JobAction(project=project, job_id=job_id), db=db, redis=redis)
    return schemas.JobPublic.model_validate(job)


@router.delete(
    "/{job_id}",
    response_model=schemas.Deleted,
    responses={**_ERRORS, **schemas.error_responses(409)},
    summary="Delete a finished job, its checkpoints and its files",
    description="Only a succeeded, failed or cancelled job can be deleted (409 otherwise). Its published "
    "checkpoints and work files are removed from the artifact store first, then its rows.",
)
def delete_job(job_id: str, db: DB, store: AppStore, project: CurrentProject) -> schemas.Deleted:
    actions.delete_job_request(actions.JobAction(project=project, job_id=job_id), db=db, store=store)
    return schemas.Deleted(id=job_id, object="job")


async def _stream_slot_left(
    request: Request, key_hash: Annotated[str | None, Depends(presented_key_hash)]
) -> None:
    """Refuse a stream request over the key's cap on the event loop, before the key lookup and the job
    read take a thread and a pooled connection: a burst of them then costs the shared pools nothing."""
    if key_hash is not None and "text/event-stream" in request.headers.get("accept", ""):
        slots: StreamSlots = request.app.state.streams
        slots.check(key_hash)


@router.get(
    "/{job_id}/events",
    dependencies=[Depends(_stream_slot_left)],
    response_model=schemas.JobEventsPublic,
    responses={
        **_ERRORS,
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
            "description": "JSON page, or with `Accept: text/event-stream` a live stream until the job ends.",
        },
    },
    summary="Job events (paginated, or followed live over SSE)",
)
def job_events(
    job_id: str,
    request: Request,
    db: DB,
    sessions: Sessions,
    settings: AppSettings,
    project: CurrentProject,
    after: Annotated[
        int | None, Query(ge=0, le=MAX_ROW_ID, description="Only events with a larger id.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    last_event_id: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> schemas.JobEventsPublic | StreamingResponse:
    query = EventsQuery(project=project, job_id=job_id, after=after, limit=limit, last_event_id=last_event_id)
    return events_answer(query, request=request, db=db, sessions=sessions, settings=settings)


@dataclass(frozen=True)
class EventsQuery:
    """What a client asks of a job's events, at either door (the API, the dashboard's live page)."""

    project: Project
    job_id: str
    after: int | None = None
    limit: int = 100
    last_event_id: str | None = None  # the raw header: a reconnecting EventSource's resume point


def events_answer(
    query: EventsQuery, *, request: Request, db: Session, sessions: Sessions, settings: Settings
) -> schemas.JobEventsPublic | StreamingResponse:
    """A JSON page of events, or with `Accept: text/event-stream` the live stream until the job ends (one
    of the key's capped stream slots held while it is open)."""
    job_id = query.job_id
    _job_or_404(db, query.project.id, job_id)
    if "text/event-stream" in request.headers.get("accept", ""):
        resume = last_event_id_of(query.last_event_id)
        start = query.after if resume is None else resume
        key_hash: str = request.state.key_hash
        slots: StreamSlots = request.app.state.streams
        slots.acquire(key_hash)
        # The stream polls with sessions of its own. Left open, the request's session would keep its
        # pooled connection checked out (idle in transaction) for as long as the stream lasts: a few
        # keys' streams would then hold the whole pool and every other request wait for it, then 503.
        db.close()
        return _SlotStream(
            _follow(request, sessions, job_id, start, settings.events_poll_s, key_hash),
            release=lambda: slots.release(key_hash),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    rows, has_more = events_crud.events_after(db, job_id, query.after, query.limit)
    return schemas.JobEventsPublic.of(rows, has_more)


def last_event_id_of(value: str | None) -> int | None:
    """The event id a reconnecting EventSource resumes after (the `id:` we sent it), or None when the header
    is absent or blank; anything but a row id is a 422 naming the header."""
    text = (value or "").strip()
    if not text:
        return None
    # ASCII digits only: str.isdigit() also accepts "²", which int() refuses.
    if not (text.isascii() and text.isdigit() and len(text) <= 19 and int(text) <= MAX_ROW_ID):
        raise ApiError(
            422,
            "Last-Event-ID must be the id of an event (a non-negative integer) or empty",
            code="invalid_request",
            param="Last-Event-ID",
        )
    return int(text)


class _SlotStream(StreamingResponse):
    """A streaming response that gives its stream slot back however it ends (drained, disconnected,
    cancelled, or never started)."""

    def __init__(self, *args: Any, release: Callable[[], None], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


async def _follow(
    request: Request, sessions: Sessions, job_id: str, after: int | None, poll_s: float, key_hash: str
) -> AsyncIterator[bytes]:
    """Poll the DB for new events and emit them as SSE until the job is terminal and drained, or the
    API key that opened the stream is revoked."""

    def poll(cursor: int | None) -> tuple[list[schemas.JobEventPublic], str | None, bool]:
        # Status first, events second: the two reads need not share a snapshot (SQLite autocommits
        # each SELECT), and a terminal status read first guarantees the events read after include the
        # terminal transition's event.
        with sessions() as db:
            if not key_is_live(db, key_hash):
                return [], None, False
            job = jobs_crud.find_job(db, job_id)
            status = job.status if job else None
            rows, _ = events_crud.events_after(db, job_id, cursor, 500)
            return [schemas.JobEventPublic.model_validate(e) for e in rows], status, True

    cursor = after
    idle = 0.0
    while True:
        events, status, live = await anyio.to_thread.run_sync(poll, cursor)
        if not live:
            yield f"event: end\ndata: {json.dumps({'reason': 'api key revoked'})}\n\n".encode()
            return
        for ev in events:
            cursor = ev.id
            yield f"id: {ev.id}\nevent: {ev.type}\ndata: {ev.model_dump_json()}\n\n".encode()
        # A terminal status with nothing new after it: the stream is drained.
        if (status is None or jobstate.is_terminal(status)) and not events:
            yield f"event: end\ndata: {json.dumps({'status': status})}\n\n".encode()
            return
        if events:
            idle = 0.0
            continue
        if await request.is_disconnected():
            return
        await anyio.sleep(poll_s)
        idle += poll_s
        if idle >= 15:
            idle = 0.0
            yield b": keep-alive\n\n"


@router.get(
    "/{job_id}/metrics", response_model=schemas.MetricsPublic, responses=_ERRORS, summary="Metric series"
)
def job_metrics(
    job_id: str,
    db: DB,
    project: CurrentProject,
    after: Annotated[
        int | None, Query(ge=0, le=MAX_ROW_ID, description="Cursor: `next_cursor` of the previous page.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
) -> schemas.MetricsPublic:
    _job_or_404(db, project.id, job_id)
    rows, has_more = metrics_crud.metrics_after(db, job_id, after, limit)
    return schemas.MetricsPublic.of(rows, has_more)


@router.get(
    "/{job_id}/checkpoints",
    response_model=schemas.CheckpointsPublic,
    responses={
        **_ERRORS,
        200: schemas.id_links("checkpoint_id", *schemas.CHECKPOINT_OPS, source="$response.body#/data/0/id"),
    },
    summary="Published checkpoints",
)
def job_checkpoints(job_id: str, db: DB, project: CurrentProject) -> schemas.CheckpointsPublic:
    _job_or_404(db, project.id, job_id)
    rows = checkpoints_crud.list_for_job(db, job_id)
    return schemas.CheckpointsPublic(data=[schemas.CheckpointPublic.model_validate(c) for c in rows])
