"""The web dashboard under /ui: server-rendered pages (Jinja2), plotly.js from the plotly wheel, a little
script for live updates. `dashboard_router()` holds its routes, `install_dashboard(app)` the rest;
`GET /` redirects to it."""

from __future__ import annotations

import os
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import Headers
from starlette.staticfiles import NotModifiedResponse
from starlette.types import Scope

from service.api.body_route import BodyRoute
from service.api.byte_ranges import RangedFileResponse
from service.api.errors import envelope
from service.ui import data, pages
from service.ui.session import CsrfError, NotSignedIn
from service.ui.views import HERE


async def _not_signed_in(request: Request, _: Exception) -> Response:
    if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/ui/login?next={quote(target, safe='/')}", status_code=303)
    return JSONResponse(envelope(401, "sign in to the dashboard first"), status_code=401)


async def _csrf_failed(_: Request, __: Exception) -> Response:
    message = "the form is out of date or came from another site: reload the page and try again"
    return JSONResponse(envelope(403, message, code="csrf_failed"), status_code=403)


class _StaticFiles(StaticFiles):
    """StaticFiles whose Range answers are the checkpoint downloads' (`parse_range`): a malformed Range
    gets the whole file, not Starlette's 400, and a list of ranges is not served as multipart."""

    def file_response(
        self,
        full_path: str | os.PathLike[str],
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = RangedFileResponse(full_path, status_code=status_code, stat_result=stat_result)
        if self.is_not_modified(response.headers, Headers(scope=scope)):
            return NotModifiedResponse(response.headers)
        return response


def _root() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


def dashboard_router() -> APIRouter:
    """The dashboard's routes: `/` and `/ui` redirect to its jobs list; then its pages and their data."""
    router = APIRouter(include_in_schema=False, route_class=BodyRoute)
    router.add_api_route("/", _root, methods=["GET"])
    router.add_api_route("/ui", _root, methods=["GET"])
    router.include_router(data.router)
    router.include_router(pages.router)
    return router


def install_dashboard(app: FastAPI) -> None:
    """What each app holds of the dashboard beside its routes (`dashboard_router`): the static files, and
    the answers to a request that is not signed in or fails its CSRF check."""
    app.mount("/ui/static", _StaticFiles(directory=HERE / "static"), name="ui-static")
    app.add_exception_handler(NotSignedIn, _not_signed_in)
    app.add_exception_handler(CsrfError, _csrf_failed)
