"""Request dependencies, the routes' only way to the app's resources: settings, DB sessions, Redis, the
artifact store, metrics, and bearer-key auth."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis import Redis
from sqlalchemy.orm import Session, sessionmaker

from service.api.auth_limit import AuthLimiter, client_address
from service.api.errors import ApiError
from service.artifacts import ArtifactStore
from service.crud.projects import hash_key, project_for_key
from service.db.models import Project
from service.metrics import Metrics
from service.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer peagle_sk_...`")


def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_sessions(request: Request) -> sessionmaker[Session]:
    """The session factory, for work that outlives the request (an SSE stream opens its own sessions)."""
    return request.app.state.sessions


def get_db(sessions: Annotated[sessionmaker[Session], Depends(get_sessions)]) -> Iterator[Session]:
    session = sessions()
    try:
        yield session
    finally:
        session.close()


def get_redis(request: Request) -> Redis:
    return request.app.state.redis


def get_store(request: Request) -> ArtifactStore:
    return request.app.state.store()


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


AppSettings = Annotated[Settings, Depends(get_app_settings)]
Sessions = Annotated[sessionmaker[Session], Depends(get_sessions)]
DB = Annotated[Session, Depends(get_db)]
RedisConn = Annotated[Redis, Depends(get_redis)]
AppStore = Annotated[ArtifactStore, Depends(get_store)]
AppMetrics = Annotated[Metrics, Depends(get_metrics)]


def bearer_key_project(
    request: Request, db: DB, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Project:
    """The project of the presented API key; 401 (with the envelope) when missing or unknown, 429 when the
    client's address has failed too often (`auth_limit`). The key's
    hash is left on `request.state.key_hash` (event streams are counted, and ended, per key)."""
    challenge = {"WWW-Authenticate": "Bearer"}
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise ApiError(401, "missing API key: send `Authorization: Bearer <key>`", headers=challenge)
    limiter: AuthLimiter = request.app.state.auth_limiter
    source = client_address(request.client)
    limiter.check(source)  # before the lookup: a refused address learns nothing about its guess
    project = project_for_key(db, creds.credentials)
    if project is None:
        limiter.failed(source)
        raise ApiError(401, "invalid or revoked API key", code="invalid_api_key", headers=challenge)
    request.state.key_hash = hash_key(creds.credentials)
    # End the lookup's transaction (the project stays loaded): between this dependency's thread and the
    # route's the request waits for a thread again, and a connection held across that wait is how a burst
    # of requests checked out the whole pool while the threads that had to serve them waited for one.
    db.commit()
    return project


async def presented_key_hash(
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str | None:
    """The hash of the bearer key presented, not looked up (None without one), for limits that refuse a
    request on the event loop before the lookup takes a thread and a pooled connection. An unknown key
    has nothing counted against it, so such a refusal tells nothing about a guess."""
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        return None
    return hash_key(creds.credentials)


CurrentProject = Annotated[Project, Depends(bearer_key_project)]
