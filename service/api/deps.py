"""Request dependencies: settings, a DB session, Redis, the artifact store, and bearer-key auth."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service.api.errors import ApiError
from service.crud.projects import project_for_key
from service.db.models import Project
from service.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer peagle_sk_...`")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_db(request: Request) -> Iterator[Session]:
    session: Session = request.app.state.sessions()
    try:
        yield session
    finally:
        session.close()


def get_redis(request: Request) -> Any:
    return request.app.state.redis


def get_store(request: Request) -> Any:
    return request.app.state.store()


DB = Annotated[Session, Depends(get_db)]
AppSettings = Annotated[Settings, Depends(get_settings)]


def current_project(
    db: DB, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Project:
    """The project of the presented API key; 401 (with the envelope) when missing or unknown."""
    challenge = {"WWW-Authenticate": "Bearer"}
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise ApiError(401, "missing API key: send `Authorization: Bearer <key>`", headers=challenge)
    project = project_for_key(db, creds.credentials)
    if project is None:
        raise ApiError(401, "invalid or revoked API key", code="invalid_api_key", headers=challenge)
    return project


CurrentProject = Annotated[Project, Depends(current_project)]
