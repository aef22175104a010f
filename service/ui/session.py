"""Dashboard sign-in: a signed, HttpOnly, SameSite=Strict cookie naming the API key, and CSRF tokens.

The cookie holds the key's id (never the key), the key's session nonce and a CSRF token, signed with
itsdangerous; every request re-reads the key, so revoking it ends its sessions, and signing out replaces
the nonce, so a copied cookie ends too. The cookie is Secure per PEAGLE_UI_SECURE_COOKIE (auto: everywhere
but plain HTTP to a loopback host). A visitor who is not signed in still gets a cookie with a token, so
the sign-in form itself is CSRF-protected.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
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
    nonce: str | None = None  # the key's session nonce when the cookie was issued


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
                return UiSession(key_id=data.get("k"), csrf=data["c"], fresh=False, nonce=data.get("n"))
        except BadSignature:
            pass
    return UiSession(key_id=None, csrf=secrets.token_urlsafe(32), fresh=True)


Session = Annotated[UiSession, Depends(get_session)]


def _loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def secure_cookie(request: Request, setting: bool | str) -> bool:
    """Whether the session cookie is Secure: the operator's choice, or on `auto` everywhere but plain HTTP
    to a loopback host (a local `peagle up`); a TLS proxy forwarding plain HTTP under a public name gets
    Secure cookies too."""
    if isinstance(setting, bool):
        return setting
    return request.url.scheme == "https" or not _loopback(request.url.hostname)


def save_session(request: Request, response: Response, session: UiSession) -> None:
    """Set the cookie for `session` on `response` (HttpOnly, SameSite=Strict, Secure per `secure_cookie`)."""
    value = _serializer(request).dumps({"k": session.key_id, "c": session.csrf, "n": session.nonce})
    settings = request.app.state.settings
    response.set_cookie(
        COOKIE,
        value,
        max_age=settings.ui_session_max_age_s,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=secure_cookie(request, settings.ui_secure_cookie),
    )


def signed_in_project(request: Request, session: Session, db: DB) -> Project:
    """The signed-in key's project; NotSignedIn when there is no session or its key was revoked.

    Like the API's `bearer_key_project`, it leaves the key's hash on `request.state.key_hash`, so per-key
    accounting in the REST routes the dashboard calls sees the same key.
    """
    key = live_key_by_id(db, session.key_id) if session.key_id else None
    # A cookie from before the key's last sign-out (or without a nonce) is no session.
    signed_out = key is None or not session.nonce or key.session_nonce is None
    if not signed_out and not hmac.compare_digest(session.nonce or "", key.session_nonce or ""):
        signed_out = True
    project = get_project(db, key.project_id) if key is not None and not signed_out else None
    if key is None or project is None:
        raise NotSignedIn()
    request.state.key_hash = key.key_hash
    db.commit()  # as the API's bearer check: no pooled connection held while the route waits for a thread
    return project


UiProject = Annotated[Project, Depends(signed_in_project)]


def check_csrf(session: UiSession, token: str | None) -> None:
    """Raise CsrfError unless `token` is this session's token (constant-time comparison)."""
    if session.fresh or not token or not hmac.compare_digest(token, session.csrf):
        raise CsrfError()


def csrf_header(request: Request, session: Session) -> None:
    """Dependency for script requests (dataset upload): the token travels in `X-CSRF-Token`."""
    check_csrf(session, request.headers.get(CSRF_HEADER))


CsrfHeader = Depends(csrf_header)
