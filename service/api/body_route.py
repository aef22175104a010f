"""The route class of every router: a request body is checked against what its route reads, once, before
FastAPI parses it, so a body sent wrong is told what to fix instead of getting a 422 about a field.

- A JSON route takes `application/json` (or `+json`); anything else, or a body with no Content-Type, is a
  415 naming the header. The body is decoded once, by `peagle_core.documents` (a number no parser holds is
  a 422 naming its field; nesting past the parser's limit a 422 naming the body), and what it decoded is
  capped by `PEAGLE_MAX_SPEC_BYTES` (413). Malformed JSON is left to FastAPI's own 422.
- A form route takes `application/x-www-form-urlencoded` or `multipart/form-data` (else 415); a multipart
  body's framing (boundary, part headers) is checked as the uploads' is, a 400 naming the problem.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import Request, Response, params
from fastapi.routing import APIRoute
from python_multipart.exceptions import FormParserError
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from peagle_core.documents import DocumentError, load_json_document
from service.api.doc_size import check_spec_size
from service.api.errors import ApiError
from service.api.framing import malformed_body, multipart_boundary

BodyKind = Literal["json", "form"]
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


class JsonBodyRequest(Request):
    """A request whose `json()` is `load_json_document` (cached like Starlette's)."""

    _parsed: Any

    async def json(self) -> Any:
        if not hasattr(self, "_parsed"):
            self._parsed = load_json_document(await self.body())
        return self._parsed


def body_kind(route: APIRoute) -> BodyKind | None:
    """What the route's body is read as: JSON, a form, or nothing (a streamed upload reads its own)."""
    if route.body_field is None:
        return None
    return "form" if isinstance(route.body_field.field_info, params.Form) else "json"


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _unsupported(expected: str, got: str) -> ApiError:
    sent = f"`{got}`" if got else "no Content-Type"
    return ApiError(
        415,
        f"this route takes {expected}: send the body with that Content-Type (it came with {sent})",
        code="unsupported_media_type",
        param="Content-Type",
    )


async def _check_json(request: JsonBodyRequest) -> None:
    media = _media_type(request)
    is_json = media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
    if not is_json and (media or await request.body()):
        raise _unsupported("JSON (`Content-Type: application/json`)", media)
    if not is_json:
        return  # no body at all: FastAPI names the missing field
    try:
        document = await request.json()
    except DocumentError as exc:
        raise ApiError(422, str(exc), code="invalid_request", param="body") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return  # FastAPI answers these itself when the handler reads the body again
    check_spec_size(
        document, request.app.state.settings.max_spec_bytes, what="the request body", param="body"
    )


async def _check_form(request: Request) -> None:
    media = _media_type(request)
    if media not in FORM_TYPES:
        if not media and not await request.body():
            return  # no body at all: FastAPI names the missing fields
        raise _unsupported(" or ".join(f"`{t}`" for t in FORM_TYPES), media)
    multipart_boundary(request.headers.get("content-type", ""))  # 400 naming what is wrong with it
    try:
        await request.form()  # cached: the handler reads these fields, not the body again
    except (MultiPartException, FormParserError) as exc:
        raise malformed_body(exc) from None
    except HTTPException as exc:  # Starlette's own wording of a parser error (always a 400)
        raise malformed_body(exc) from None


class BodyRoute(APIRoute):
    """Checks the body as its route reads it (`body_kind`) before the handler; routes without a body
    are passed through."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handle = super().get_route_handler()
        kind = body_kind(self)

        async def check_then_handle(request: Request) -> Response:
            request = JsonBodyRequest(request.scope, request.receive)
            if kind == "json":
                await _check_json(request)
            elif kind == "form":
                await _check_form(request)
            return await handle(request)

        return check_then_handle
