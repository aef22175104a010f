"""The one error envelope `{"error": {type, code, message, param}}` and the handlers that produce it.

Every 4xx/5xx leaves the API in this shape: our own ApiError, FastAPI/Starlette HTTP errors (404 unknown
route, 405), request validation (422 naming the field), PeagleError (422), a row a concurrent request
deleted or changed under this one (404 or 409), a database or Redis outage (503) and anything unexpected
(500, logged, no traceback in the response).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm.exc import ObjectDeletedError, StaleDataError
from starlette.exceptions import HTTPException as StarletteHTTPException

from peagle_core.documents import number_problem
from peagle_core.errors import PeagleError
from peagle_core.text import printable
from service.db.vanished import RowVanished
from service.redact import redact_paths

log = logging.getLogger("peagle.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    416: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    416: "range_not_satisfiable",
    422: "invalid_request",
    429: "too_many_requests",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error answered with the envelope; raise it from routes and dependencies."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        type_: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or _CODES.get(status, "error")
        self.param = param
        self.headers = headers
        self.type_ = type_

    def response(self) -> JSONResponse:
        """The error as the API answers it (middleware that runs outside the handlers sends it itself)."""
        body = envelope(self.status, self.message, code=self.code, param=self.param, type_=self.type_)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def not_found(kind: str, ident: str) -> ApiError:
    return ApiError(404, f"no {kind} with id {ident!r}", code=f"{kind}_not_found")


def envelope(
    status: int, message: str, *, code: str | None = None, param: str | None = None, type_: str | None = None
) -> dict[str, Any]:
    # Every field a client reads is redacted here, once for all errors: a message or a param may echo a
    # resolved server path (a symlink's target, a worker's directory), and a param may be a client's key.
    # A client's key (or value) may also hold a lone surrogate, which no JSON answer can encode, or control
    # characters: escaped, so that the refusal itself never fails.
    return {
        "error": {
            "type": type_ or _TYPES.get(status, "api_error"),
            "code": code or _CODES.get(status, "error"),
            "message": redact_paths(printable(message, controls=False)),
            "param": redact_paths(printable(param) if param is not None else None),
        }
    }


def _loc_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    # ("body", "spec", "training", "lr") -> "spec.training.lr"; ("query", "limit") -> "limit".
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    parts = [p for p in parts if not p.startswith("function-")]
    return ".".join(parts) or None


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else "request failed"
    if exc.status_code == 404 and message == "Not Found":
        message = "no such route"
    return ApiError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    details = []
    for err in errors:
        param = _loc_param(err.get("loc", ()))
        msg = number_problem(err.get("input")) or str(err.get("msg", "invalid value")).removeprefix(
            "Value error, "
        )
        details.append(f"{param}: {msg}" if param else msg)
    first = _loc_param(errors[0].get("loc", ())) if errors else None
    return ApiError(
        422, "; ".join(details) or "invalid request", code="invalid_request", param=first
    ).response()


async def _peagle_error(_: Request, exc: PeagleError) -> JSONResponse:
    return ApiError(422, exc.message, code=exc.code, param=exc.param).response()


DB_RETRY_AFTER_S = 5


# Postgres's answers to two transactions that raced: serialization failure, deadlock detected.
_RACE_SQLSTATES = frozenset({"40001", "40P01"})


async def _db_error(request: Request, exc: Exception) -> JSONResponse:
    if getattr(getattr(exc, "orig", None), "sqlstate", None) in _RACE_SQLSTATES:
        return await _concurrent_change(request, exc)
    # Connection-level failures (server down, pool exhausted) are an outage; anything else is our bug.
    outage = isinstance(exc, OperationalError | InterfaceError | PoolTimeoutError) or getattr(
        exc, "connection_invalidated", False
    )
    if not outage:
        return await _unhandled(request, exc)
    log.warning("database unavailable: %s", exc.__class__.__name__)
    # Retry-After: clients (the SDK, load balancers) back off instead of hammering a recovering database.
    return ApiError(
        503,
        "the database is unavailable; retry later",
        code="database_unavailable",
        headers={"Retry-After": str(DB_RETRY_AFTER_S)},
    ).response()


async def _row_vanished(_: Request, exc: RowVanished) -> JSONResponse:
    return not_found(exc.kind, exc.ident).response()


async def _concurrent_change(_: Request, exc: Exception) -> JSONResponse:
    # The ORM found a row it had loaded gone (or changed) when it read or wrote it again: a request
    # that raced this one won. What a retry sees is consistent, so this is the client's 409, not a 500.
    log.info("concurrent change: %s", exc.__class__.__name__)
    return ApiError(
        409,
        "the resource was changed or deleted by a concurrent request while this one ran; read it again",
        code="concurrent_change",
    ).response()


async def _redis_down(_: Request, exc: Exception) -> JSONResponse:
    log.warning("redis unavailable: %s", exc.__class__.__name__)
    return ApiError(503, "the job queue is unavailable; retry later", code="queue_unavailable").response()


async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return ApiError(500, "internal server error", code="internal_error", type_="api_error").response()


def install_error_handlers(app: FastAPI) -> None:
    """Register every handler on `app`."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(PeagleError, _peagle_error)
    app.add_exception_handler(RowVanished, _row_vanished)
    for exc_type in (ObjectDeletedError, StaleDataError):
        app.add_exception_handler(exc_type, _concurrent_change)
    for exc_type in (DBAPIError, PoolTimeoutError):
        app.add_exception_handler(exc_type, _db_error)
    for exc_type in (RedisConnectionError, RedisTimeoutError):
        app.add_exception_handler(exc_type, _redis_down)
    app.add_exception_handler(Exception, _unhandled)
