"""Caps on what one caller has in flight, answered 429 at once: writes (`PEAGLE_MAX_WRITES_IN_FLIGHT_PER_CALLER`)
and requests of any kind still waiting for their answer (`PEAGLE_MAX_REQUESTS_IN_FLIGHT_PER_CALLER`).

Sync routes run on one shared thread pool, and a write may wait on the project lock (SQLite's write lock
under contention, a Postgres row lock). Without a cap, one API key firing hundreds of plans, uploads or
dashboard Validates parks every thread of the pool on that wait, and every other project's reads queue
behind it. Reads hold no lock, but a burst of them (150 event-stream requests at once, say) queues just as
much work on the threads and the database pool, which every tenant shares: so every request counts
against the caller's request cap until its answer's head is sent. A long poll (`GET /v1/plans/{id}?wait=`)
counts while it waits; an event stream or a download stops counting once its head is out, since it then
holds no thread. The caller is the bearer key, else the dashboard session cookie, else the client address;
the counts are kept in the event loop, before any thread is taken or the key is looked up.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

from starlette.types import Receive, Scope, Send

from service.api.errors import ApiError

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


def _too_many(what: str, n: int, setting: str, limit: int) -> ApiError:
    return ApiError(
        429,
        f"this caller has {n} {what} in flight (limit {setting}: {limit}); retry when one answers",
        code="too_many_in_flight",
        headers={"Retry-After": "1"},
    )


class FairShareMiddleware:
    """At most `limit` writes in flight per caller in this process, and (with `request_limit`) at most that
    many requests not yet answered; more answer 429 without running."""

    def __init__(self, app: Any, limit: int, cookie_name: str, request_limit: int | None = None):
        self.app, self.limit, self.cookie_name, self.request_limit = app, limit, cookie_name, request_limit
        # Touched only on the event loop: no lock needed.
        self._inflight: Counter[str] = Counter()  # writes, until they end
        self._unanswered: Counter[str] = Counter()  # any request, until its answer's head is sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        caller = _caller(scope, self.cookie_name)
        write = scope["method"].encode() in _WRITES
        refusal = None
        if self.request_limit is not None and self._unanswered[caller] >= self.request_limit:
            refusal = _too_many(
                "requests",
                self._unanswered[caller],
                "PEAGLE_MAX_REQUESTS_IN_FLIGHT_PER_CALLER",
                self.request_limit,
            )
        elif write and self._inflight[caller] >= self.limit:
            refusal = _too_many(
                "write requests", self._inflight[caller], "PEAGLE_MAX_WRITES_IN_FLIGHT_PER_CALLER", self.limit
            )
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        answered = False

        def answer() -> None:
            nonlocal answered
            if not answered:
                answered = True
                _release(self._unanswered, caller)

        async def send_counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answer()
            await send(message)

        self._unanswered[caller] += 1
        if write:
            self._inflight[caller] += 1
        try:
            await self.app(scope, receive, send_counted)
        finally:
            answer()
            if write:
                _release(self._inflight, caller)


def _release(counts: Counter[str], caller: str) -> None:
    counts[caller] -= 1
    if counts[caller] <= 0:
        del counts[caller]
