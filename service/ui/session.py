"""Dashboard sign-in: a signed, HttpOnly, SameSite=Strict cookie naming the API key, and CSRF tokens.

The cookie holds the key's id (never the key) and a CSRF token, signed with itsdangerous; every request
re-reads the key, so revoking it ends its sessions. A visitor who is not signed in still gets a cookie
with a token, so the sign-in form itself is CSRF-protected.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request, Response
from itsdangerous import BadSignature, URLSafeTimedSerializer

from service.api.deps import DB, AppSettings
from service.crud.projects import get_project, live_key_by_id
from service.db.models import Project
from service.settings import Settings

COOKIE = "peagle_session"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"


class NotSignedIn(Exception):
    """No valid session: pages redirect to the sign-in form, data requests answer 401."""


class CsrfError(Exception):
    """A state-changing request without the session's CSRF token: 403."""


@dataclass
class UiSession:
    key_id: str | None
    csrf: str
    fresh: bool  # not read from a valid cookie: the response must set it


def _secret(settings: Settings) -> str:
    """The operator's `ui_secret_key`, else a random one kept in `<data_dir>/ui-secret` (created once, 0600,
    shared by every API process on this data dir)."""
    if settings.ui_secret_key:
        return settings.ui_secret_key
    path = Path(settings.data_dir) / "ui-secret"
    with contextlib.suppress(FileNotFoundError):
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".ui-secret.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(48))
    # link() fails if another process won the race; then its secret is the one.
    with contextlib.suppress(FileExistsError):
        os.link(tmp, path)
    tmp.unlink()
    return path.read_text().strip()


def _serializer(request: Request) -> URLSafeTimedSerializer:
    state = request.app.state
    if getattr(state, "ui_serializer", None) is None:
        state.ui_serializer = URLSafeTimedSerializer(_secret(state.settings), salt="peagle-ui-session")
    return state.ui_serializer


def get_session(request: Request, settings: AppSettings) -> UiSession:
    raw = request.cookies.get(COOKIE)
    if raw:
        try:
            data = _serializer(request).loads(raw, max_age=settings.ui_session_max_age_s)
            if isinstance(data, dict) and isinstance(data.get("c"), str):
                return UiSession(key_id=data.get("k"), csrf=data["c"], fresh=False)
        except BadSignature:
            pass
    return UiSession(key_id=None, csrf=secrets.token_urlsafe(32), fresh=True)


Session = Annotated[UiSession, Depends(get_session)]


def save_session(request: Request, response: Response, session: UiSession) -> None:
    """Set the cookie for `session` on `response` (HttpOnly, SameSite=Strict, Secure over https)."""
    value = _serializer(request).dumps({"k": session.key_id, "c": session.csrf})
    response.set_cookie(
        COOKIE,
        value,
        max_age=request.app.state.settings.ui_session_max_age_s,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def current_project(request: Request, session: Session, db: DB) -> Project:
    """The signed-in key's project; NotSignedIn when there is no session or its key was revoked.

    Like the API's bearer dependency, it leaves the key's hash on `request.state.key_hash`, so per-key
    accounting in the REST routes the dashboard calls sees the same key.
    """
    key = live_key_by_id(db, session.key_id) if session.key_id else None
    project = get_project(db, key.project_id) if key is not None else None
    if key is None or project is None:
        raise NotSignedIn()
    request.state.key_hash = key.key_hash
    return project


UiProject = Annotated[Project, Depends(current_project)]


def check_csrf(session: UiSession, token: str | None) -> None:
    """Raise CsrfError unless `token` is this session's token (constant-time comparison)."""
    if session.fresh or not token or not hmac.compare_digest(token, session.csrf):
        raise CsrfError()


def csrf_header(request: Request, session: Session) -> None:
    """Dependency for script requests (dataset upload): the token travels in `X-CSRF-Token`."""
    check_csrf(session, request.headers.get(CSRF_HEADER))


CsrfHeader = Depends(csrf_header)
