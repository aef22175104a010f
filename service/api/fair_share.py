"""A cap on the writes one caller has in flight (`PEAGLE_MAX_WRITES_IN_FLIGHT_PER_CALLER`), answered 429 at once.

Sync routes run on one shared thread pool, and a write may wait on the project lock (SQLite's write lock
under contention, a Postgres row lock). Without a cap, one API key firing hundreds of plans, uploads or
dashboard Validates parks every thread of the pool on that wait, and every other project's reads queue
behind it. The caller is the bearer key, else the dashboard session cookie, else the client address; the
count is kept in the event loop, before any thread is taken. Reads are not capped: they hold no lock, and
the long polls (`GET /v1/plans/{id}?wait=`) and event streams hold no thread.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from service.api.errors import ApiError

Scope = dict[str, Any]
_WRITES = frozenset({b"POST", b"PUT", b"PATCH", b"DELETE"})


def _caller(scope: Scope, cookie_name: str) -> str:
    headers = dict(scope.get("headers") or [])
    auth = headers.get(b"authorization", b"")
    if auth:
        return "key:" + hashlib.sha256(auth).hexdigest()
    for part in headers.get(b"cookie", b"").split(b";"):
        name, _, value = part.strip().partition(b"=")
        if name == cookie_name.encode() and value:
            return "ui:" + hashlib.sha256(value).hexdigest()
    client = scope.get("client") or ("", 0)
    return f"addr:{client[0]}"


class FairShareMiddleware:
    """At most `limit` writes in flight per caller in this process; more answer 429 without running."""

    def __init__(self, app: Any, limit: int, cookie_name: str):
        self.app, self.limit, self.cookie_name = app, limit, cookie_name
        self._inflight: Counter[str] = Counter()  # touched only on the event loop: no lock needed

    async def __call__(self, scope: Scope, receive: Callable[[], Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope["method"].encode() not in _WRITES:
            await self.app(scope, receive, send)
            return
        caller = _caller(scope, self.cookie_name)
        if self._inflight[caller] >= self.limit:
            response = ApiError(
                429,
                f"this caller has {self._inflight[caller]} write requests in flight "
                f"(limit PEAGLE_MAX_WRITES_IN_FLIGHT_PER_CALLER: {self.limit}); retry when one answers",
                code="too_many_in_flight",
                headers={"Retry-After": "1"},
            ).response()
            await response(scope, receive, send)
            return
        self._inflight[caller] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._inflight[caller] -= 1
            if self._inflight[caller] <= 0:
                del self._inflight[caller]
