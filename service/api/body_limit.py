"""A cap on request bodies (`PEAGLE_MAX_SPEC_BYTES`): anything but a dataset upload over it answers 413.

A pure ASGI middleware: the body is counted as it arrives and never buffered past the cap, so a huge or
endless JSON body costs at most the cap in memory, whatever its Content-Length claims.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from service.api.errors import ApiError


class BodyLimitMiddleware:
    """Refuse bodies larger than `max_bytes` with 413, except on the (separately capped) upload routes."""

    def __init__(self, app: Any, max_bytes: int, exempt: Callable[[str, str], bool]):
        self.app, self.max_bytes, self.exempt = app, max_bytes, exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.exempt(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = ApiError(
            413,
            f"the request body exceeds the limit of {self.max_bytes} bytes (PEAGLE_MAX_SPEC_BYTES)",
            code="payload_too_large",
            param="body",
            headers={"Connection": "close"},
        ).response()
        await response(scope, receive, send)


def _replay(messages: list[dict[str, Any]], receive: Receive) -> Receive:
    async def replay() -> dict[str, Any]:
        return messages.pop(0) if messages else await receive()

    return replay
