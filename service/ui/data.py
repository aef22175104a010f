"""What the dashboard's scripts and links fetch with the session cookie: metric series, the live event
stream, dataset upload, and downloads. Each is the REST route's own function, or the action it calls
(`service.api.actions`), with the signed-in project, so scoping, limits and answers are the API's."""

from __future__ import annotations

import functools
import hashlib
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import Response
from pydantic import Field

from service.api import actions, schemas
from service.api.body_route import BodyRoute
from service.api.deps import DB, AppSettings, AppStore, Sessions
from service.api.errors import not_found
from service.api.routes import checkpoints as checkpoints_api
from service.api.routes import jobs as jobs_api
from service.api.routes import tracking as tracking_api
from service.crud import jobs as jobs_crud
from service.crud import metrics as metrics_crud
from service.ui.session import CsrfHeader, UiProject

router = APIRouter(prefix="/ui", include_in_schema=False, route_class=BodyRoute)


@functools.cache
def _plotly() -> tuple[bytes, str]:
    from plotly.offline import get_plotlyjs

    body = get_plotlyjs().encode()
    return body, hashlib.sha256(body).hexdigest()[:16]


@router.get("/assets/plotly.min.js")
def plotly_js(if_none_match: Annotated[str | None, Header()] = None) -> Response:
    """plotly.js from the installed plotly wheel: the charts need nothing from the internet."""
    body, etag = _plotly()
    headers = {"ETag": f'"{etag}"', "Cache-Control": "public, max-age=86400"}
    if if_none_match == f'"{etag}"':
        return Response(status_code=304, headers=headers)
    return Response(body, media_type="text/javascript", headers=headers)


class MetricPage(schemas.MetricsPublic):
    cursor: int | None = Field(description="The last row's id: pass it as `after` to get only newer rows.")


@router.get("/data/jobs/{job_id}/metrics", response_model=MetricPage)
def job_metric_series(
    job_id: str,
    db: DB,
    project: UiProject,
    after: Annotated[int | None, Query(ge=0, le=jobs_api.MAX_ROW_ID)] = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
) -> MetricPage:
    """The API's metric series plus the last row id even on the last page, so a live chart asks only
    for rows it has not drawn."""
    if jobs_crud.get_job_row(db, project.id, job_id) is None:
        raise not_found("job", job_id)
    rows, has_more = metrics_crud.metrics_after(db, job_id, after, limit)
    return MetricPage.of(rows, has_more, cursor=rows[-1].id if rows else after)


@router.get("/data/jobs/{job_id}/events")
def events(
    job_id: str,
    request: Request,
    db: DB,
    sessions: Sessions,
    settings: AppSettings,
    project: UiProject,
    after: Annotated[int | None, Query(ge=0, le=jobs_api.MAX_ROW_ID)] = None,
    last_event_id: Annotated[str | None, Header()] = None,  # checked as the API's: `last_event_id_of`
):
    """JSON page, or with `Accept: text/event-stream` (an EventSource) the live stream until the job ends."""
    query = jobs_api.EventsQuery(
        project=project, job_id=job_id, after=after, limit=1000, last_event_id=last_event_id
    )
    return jobs_api.events_answer(query, request=request, db=db, sessions=sessions, settings=settings)


@router.post(
    "/data/datasets", response_model=schemas.DatasetPublic, status_code=201, dependencies=[CsrfHeader]
)
async def upload_dataset_from_page(
    request: Request,
    db: DB,
    store: AppStore,
    settings: AppSettings,
    project: UiProject,
    format: Annotated[actions.DataFormat, Query()] = "auto",
) -> schemas.DatasetPublic:
    upload = actions.UploadDataset(project=project, request=request, format=format)
    row = await actions.upload_dataset_request(upload, db=db, store=store, settings=settings)
    return schemas.DatasetPublic.model_validate(row)


@router.get("/checkpoints/{checkpoint_id}/archive")
def checkpoint_archive(checkpoint_id: str, db: DB, store: AppStore, project: UiProject):
    return checkpoints_api.archive(checkpoint_id=checkpoint_id, db=db, store=store, project=project)


@router.get("/checkpoints/{checkpoint_id}/files/{name}")
def checkpoint_file(
    checkpoint_id: str,
    name: str,
    request: Request,
    db: DB,
    store: AppStore,
    project: UiProject,
    range: Annotated[str | None, Header()] = None,  # parsed as the API's: `byte_ranges.parse_range`
):
    return checkpoints_api.file(
        checkpoint_id=checkpoint_id,
        name=name,
        request=request,
        db=db,
        store=store,
        project=project,
        range=range,
    )


@router.get("/jobs/{job_id}/tensorboard")
def tensorboard(job_id: str, db: DB, store: AppStore, project: UiProject):
    return tracking_api.tensorboard_archive(job_id=job_id, db=db, store=store, project=project)
