"""The dashboard's HTML pages and forms: sign-in, jobs, a job, compare, the job editor, datasets.

Pages read through crud and act through the REST routes' own functions (create, cancel), so the
dashboard and `/v1` cannot disagree; another project's ids answer 404 exactly as in the API.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, Form, Query, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from service.api import actions
from service.api.auth_limit import AuthLimiter, client_address
from service.api.body_route import BodyRoute
from service.api.deps import DB, AppSettings, AppStore, RedisConn
from service.api.errors import ApiError
from service.crud import checkpoints as checkpoints_crud
from service.crud import datasets as datasets_crud
from service.crud import events as events_crud
from service.crud import jobs as jobs_crud
from service.crud.projects import end_sessions, live_key, session_nonce
from service.db.models import TERMINAL_STATUSES
from service.ui import editor, views
from service.ui.session import Session, UiProject, UiSession, check_csrf, save_session, secure_cookie

router = APIRouter(prefix="/ui", include_in_schema=False, route_class=BodyRoute)

PAGE_SIZE = 50
MAX_COMPARE = 8
CsrfField = Annotated[str, Form(max_length=100)]


def _safe_next(target: str | None) -> str:
    # Only paths inside the dashboard: never an open redirect.
    if target and target.startswith("/ui") and not target.startswith("//") and "\\" not in target:
        return target
    return "/ui/"


def not_found_page(request: Request, session: UiSession, project: UiProject, what: str) -> HTMLResponse:
    return views.render_page(request, "not_found.html", session, project, status_code=404, what=what)


# -- sign-in ---------------------------------------------------------------------------------------


@router.get("/login")
def login_form(
    request: Request, session: Session, next: Annotated[str | None, Query(max_length=2000)] = None
):
    return views.render_page(request, "login.html", session, next=_safe_next(next), error=None)


@router.post("/login")
def login(
    request: Request,
    session: Session,
    db: DB,
    api_key: Annotated[str, Form(max_length=200)],
    csrf_token: CsrfField,
    next: Annotated[str, Form(max_length=2000)] = "/ui/",
) -> Response:
    check_csrf(session, csrf_token)
    # The API's limiter: failed sign-ins and failed bearer keys from one address count together.
    limiter: AuthLimiter = request.app.state.auth_limiter
    source = client_address(request.client)
    try:
        limiter.check(source)
    except ApiError as exc:
        page = views.render_page(
            request, "login.html", session, status_code=429, next=_safe_next(next), error=exc.message
        )
        page.headers.update(exc.headers or {})
        return page
    key = live_key(db, api_key.strip())
    if key is None:
        limiter.failed(source)
        return views.render_page(
            request,
            "login.html",
            session,
            next=_safe_next(next),
            error="That API key is unknown or revoked.",
        )
    nonce = session_nonce(db, key)
    db.commit()
    response = RedirectResponse(_safe_next(next), status_code=303)
    # A new token at sign-in: a token seen before it is worth nothing afterwards.
    save_session(
        request,
        response,
        UiSession(key_id=key.id, csrf=secrets.token_urlsafe(32), fresh=False, nonce=nonce),
    )
    return response


@router.post("/logout")
def logout(request: Request, session: Session, db: DB, csrf_token: CsrfField) -> Response:
    check_csrf(session, csrf_token)
    if session.key_id:
        # Server side: every cookie of this key, a copied one included, stops being a session.
        end_sessions(db, session.key_id)
        db.commit()
    response = RedirectResponse("/ui/login", status_code=303)
    settings = request.app.state.settings
    response.delete_cookie(
        "peagle_session",
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=secure_cookie(request, settings.ui_secure_cookie),
    )
    return response


# -- jobs ------------------------------------------------------------------------------------------


# The filter form sends `status=` for "all": anything but a known status means no filter.
StatusFilter = Annotated[str | None, Query(max_length=16)]
Cursor = Annotated[str | None, Query(max_length=64)]


@dataclass(frozen=True)
class JobListing:
    """One page of the project's jobs under the filter form's query (`status`, `after`)."""

    rows: list[views.JobRow]
    status: str | None  # the filter applied: None for "all" or an unknown status
    after: str | None
    next_cursor: str | None


def job_listing(project: UiProject, db: DB, status: StatusFilter = None, after: Cursor = None) -> JobListing:
    """The page of jobs the jobs page and its refreshed fragment show (a dependency of both)."""
    status = status if status in views.STATUS_SYMBOLS else None
    page = jobs_crud.list_job_rows(db, project.id, status=status, after=after, limit=PAGE_SIZE)
    rows, has_more = page if page is not None else ([], False)
    ckpts = checkpoints_crud.list_for_jobs(db, [j.id for j in rows])
    next_cursor = rows[-1].id if has_more and rows else None
    return JobListing(views.job_rows(rows, ckpts), status, after, next_cursor)


Listing = Annotated[JobListing, Depends(job_listing)]


@router.get("/")
def jobs_page(request: Request, session: Session, project: UiProject, listing: Listing):
    return views.render_page(
        request,
        "jobs.html",
        session,
        project,
        nav="jobs",
        rows=listing.rows,
        status=listing.status,
        after=listing.after,
        next_cursor=listing.next_cursor,
        statuses=list(views.STATUS_SYMBOLS),
    )


@router.get("/fragments/jobs")
def jobs_fragment(request: Request, session: Session, project: UiProject, listing: Listing):
    return views.render_page(request, "_job_rows.html", session, project, rows=listing.rows)


def _panel_context(db: DB, job_id: str, project_id: str) -> dict | None:
    job = jobs_crud.get_job_row(db, project_id, job_id)
    if job is None:
        return None
    events, _ = events_crud.events_after(db, job.id, None, 1000)
    ckpts = checkpoints_crud.list_for_job(db, job.id)
    return {
        "job": job,
        "stages": views.timeline(job, events),
        "cards": views.checkpoint_cards(job, ckpts),
        "tensorboard": "tensorboard" in ((job.spec.get("tracking") or {}).get("report_to") or []),
    }


@router.get("/jobs/new")
def new_job_form(
    request: Request,
    session: Session,
    project: UiProject,
    db: DB,
    dataset: Annotated[str | None, Query(max_length=64)] = None,
):
    """The editor, starting from a template on `?dataset=` (one of the project's), else the newest."""
    chosen = datasets_crud.get_dataset_row(db, project.id, dataset) if dataset else None
    page = datasets_crud.list_dataset_rows(db, project.id, after=None, limit=1)
    newest = chosen.id if chosen else (page[0][0].id if page and page[0] else None)
    return _editor_page(request, session, project, editor.template(newest), [], None, "")


@router.post("/jobs/new")
def new_job(
    request: Request,
    session: Session,
    project: UiProject,
    db: DB,
    redis: RedisConn,
    settings: AppSettings,
    spec_yaml: Annotated[str, Form(max_length=editor.MAX_SPEC_CHARS)],
    csrf_token: CsrfField,
    action: Annotated[str, Form(pattern="^(validate|submit)$")] = "submit",
    idempotency_key: Annotated[str, Form()] = "",  # checked by the action, as the API's header
) -> Response:
    check_csrf(session, csrf_token)
    spec, errors = editor.check(spec_yaml, settings, project.id)
    if spec is not None and action == "submit":
        try:
            # The API's own create: dataset ownership, tracker checks, limits, idempotency (a
            # double-clicked submit creates one job), enqueue.
            create = actions.CreateJob(project=project, spec=spec, idempotency_key=idempotency_key)
            created = actions.create_job_request(create, db=db, redis=redis, settings=settings)
        except ApiError as exc:
            db.rollback()  # the create's locks (its dataset row) end here, not after the page renders
            errors = editor.errors_at_lines(spec_yaml, [(exc.param or "", exc.message)])
        else:
            return RedirectResponse(f"/ui/jobs/{created.job.id}", status_code=303)
    missing = spec is not None and spec.dataset.id is not None and not errors
    if missing and datasets_crud.get_dataset_row(db, project.id, spec.dataset.id) is None:
        errors = editor.errors_at_lines(
            spec_yaml, [("dataset.id", f"no dataset with id {spec.dataset.id!r}")]
        )
    resolved = spec.model_dump(mode="json") if spec is not None and not errors else None
    return _editor_page(request, session, project, spec_yaml, errors, resolved, idempotency_key)


def _editor_page(
    request: Request,
    session: UiSession,
    project: UiProject,
    text: str,
    errors: list,
    resolved: dict | None,
    idempotency_key: str,
) -> Response:
    """The spec editor showing `text`, its errors and resolved spec; a resubmitted form keeps its
    idempotency key (a double submit creates one job), a fresh form gets a new one."""
    return views.render_page(
        request,
        "new_job.html",
        session,
        project,
        nav="new",
        text=text,
        errors=errors,
        resolved=resolved,
        idem=idempotency_key or secrets.token_urlsafe(16),
    )


@router.get("/jobs/{job_id}")
def job_page(request: Request, session: Session, project: UiProject, db: DB, job_id: str):
    context = _panel_context(db, job_id, project.id)
    if context is None:
        return not_found_page(request, session, project, f"job {job_id}")
    job = context["job"]
    depths = int((job.spec.get("model") or {}).get("num_depths", 4))
    page_data = {
        "job_id": job.id,
        "depths": depths,
        "terminal": job.status in TERMINAL_STATUSES,
    }
    return views.render_page(
        request, "job.html", session, project, nav="jobs", page_data=page_data, **context
    )


@router.get("/jobs/{job_id}/panel")
def job_panel(
    request: Request,
    session: Session,
    project: UiProject,
    db: DB,
    job_id: str,
    part: Annotated[Literal["summary", "details"], Query()] = "summary",
):
    """A part of the job page, re-read by its script while the job runs."""
    context = _panel_context(db, job_id, project.id)
    if context is None:
        return not_found_page(request, session, project, f"job {job_id}")
    return views.render_page(request, f"_job_{part}.html", session, project, **context)


@router.post("/jobs/{job_id}/cancel")
def cancel(
    session: Session, project: UiProject, db: DB, redis: RedisConn, job_id: str, csrf_token: CsrfField
) -> Response:
    check_csrf(session, csrf_token)
    try:
        actions.cancel_job_request(actions.JobAction(project=project, job_id=job_id), db=db, redis=redis)
    except ApiError as exc:
        if exc.status == 404:
            raise
        # Already finished: the page shows its final status.
    return RedirectResponse(f"/ui/jobs/{quote(job_id)}", status_code=303)


@router.post("/jobs/{job_id}/delete")
def delete_job_from_page(
    session: Session, project: UiProject, db: DB, store: AppStore, job_id: str, csrf_token: CsrfField
) -> Response:
    """The API's delete: a finished job's files, then its rows; an unfinished one answers the API's 409."""
    check_csrf(session, csrf_token)
    actions.delete_job_request(actions.JobAction(project=project, job_id=job_id), db=db, store=store)
    return RedirectResponse("/ui/", status_code=303)


# -- compare ---------------------------------------------------------------------------------------


@router.get("/compare")
def compare_page(
    request: Request,
    session: Session,
    project: UiProject,
    db: DB,
    job: Annotated[list[str], Query(max_length=MAX_COMPARE)] = [],  # noqa: B006 - FastAPI copies defaults
):
    chosen = []
    for job_id in dict.fromkeys(j for j in job if len(j) <= 64):
        row = jobs_crud.get_job_row(db, project.id, job_id)
        if row is None:
            return not_found_page(request, session, project, f"job {job_id}")
        chosen.append(row)
    page = jobs_crud.list_job_rows(db, project.id, status=None, after=None, limit=PAGE_SIZE)
    recent = page[0] if page else []
    page_data = {"jobs": [{"id": j.id, "name": j.name or j.id} for j in chosen]}
    return views.render_page(
        request,
        "compare.html",
        session,
        project,
        nav="compare",
        chosen=chosen,
        chosen_ids={j.id for j in chosen},
        recent=recent,
        page_data=page_data,
        max_compare=MAX_COMPARE,
    )


# -- datasets --------------------------------------------------------------------------------------


@router.get("/datasets")
def datasets_page(request: Request, session: Session, project: UiProject, db: DB, after: Cursor = None):
    page = datasets_crud.list_dataset_rows(db, project.id, after=after, limit=PAGE_SIZE)
    rows, has_more = page if page is not None else ([], False)
    return views.render_page(
        request,
        "datasets.html",
        session,
        project,
        nav="datasets",
        datasets=rows,
        next_cursor=rows[-1].id if has_more and rows else None,
    )


@router.post("/datasets/{dataset_id}/delete")
def delete_dataset_from_page(
    session: Session, project: UiProject, db: DB, store: AppStore, dataset_id: str, csrf_token: CsrfField
) -> Response:
    """The API's delete: a dataset an unfinished job will read answers the API's 409."""
    check_csrf(session, csrf_token)
    actions.delete_dataset_request(
        actions.DeleteDataset(project=project, dataset_id=dataset_id), db=db, store=store
    )
    return RedirectResponse("/ui/datasets", status_code=303)
