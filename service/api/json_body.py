"""JSON request bodies parsed with `peagle_core.documents`: a number no parser holds is a 422 naming its
field, never FastAPI's 400 "error parsing the body" (or a 500).

FastAPI turns any exception of `Request.json()` but a JSONDecodeError into a 400 without a field. Routes of
this class parse the body first, with a loader that keeps an over-long integer as a `HugeNumber` marker
(pydantic then refuses the field it sits in, and the error handler words it) and that answers nesting past
the parser's limit with a 422 naming the body. Malformed JSON is left to FastAPI's own 422.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from peagle_core.documents import DocumentError, load_json_document
from service.api.errors import ApiError


class JsonBodyRequest(Request):
    """A request whose `json()` is `load_json_document` (cached like Starlette's)."""

    _parsed: Any

    async def json(self) -> Any:
        if not hasattr(self, "_parsed"):
            self._parsed = load_json_document(await self.body())
        return self._parsed


def _json_content(request: Request) -> bool:
    ctype = request.headers.get("content-type", "")
    media = ctype.split(";", 1)[0].strip().lower()
    return not media or media == "application/json" or media.endswith("+json")


class JsonBodyRoute(APIRoute):
    """The route class of routers that take JSON bodies (jobs, plans)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handle = super().get_route_handler()
        takes_body = self.body_field is not None

        async def parse_then_handle(request: Request) -> Response:
            request = JsonBodyRequest(request.scope, request.receive)
            if takes_body and _json_content(request):
                try:
                    await request.json()
                except DocumentError as exc:
                    raise ApiError(422, str(exc), code="invalid_request", param="body") from None
                except (json.JSONDecodeError, UnicodeDecodeError):
                    pass  # FastAPI answers these itself when the handler reads the body again
            return await handle(request)

        return parse_then_handle
