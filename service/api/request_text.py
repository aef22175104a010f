"""The strings of a request outside its JSON body, checked at the edge: path and query parameters of every
route, and the headers that are stored or echoed (Idempotency-Key). The rule is `peagle_core.text`'s, the
spec's own; a refusal is a 422 naming the parameter, before any of it reaches a query or a row.
"""

from __future__ import annotations

from fastapi import Request

from peagle_core.text import text_problem
from service.api.errors import ApiError

# An Idempotency-Key is a client's retry token (a UUID, a hash): 255 characters hold any of them.
MAX_IDEMPOTENCY_KEY_CHARS = 255
# Path and query values are ids, cursors, filters and dashboard paths: none is longer.
MAX_PARAM_CHARS = 4096


def check_name(value: str, param: str, *, max_chars: int = MAX_PARAM_CHARS) -> str:
    """`value` if it is a storable name (no NUL, lone surrogate or control character, at most `max_chars`),
    else a 422 naming `param`."""
    if (problem := text_problem(value, max_chars=max_chars)) is not None:
        raise ApiError(422, f"{param}: {problem}", code="invalid_text", param=param)
    return value


def idempotency_key(value: str | None, param: str = "Idempotency-Key") -> str | None:
    """The client's idempotency key (None when absent or blank), checked as a stored name: the API's
    header and the dashboard's form field go through here."""
    if value is None or not value.strip():
        return None
    return check_name(value, param, max_chars=MAX_IDEMPOTENCY_KEY_CHARS)


def check_request_text(request: Request) -> None:
    """App-wide dependency: every path and query parameter is a storable name. It runs before the route's
    own parameters, authentication and any database read."""
    for name, value in request.path_params.items():
        if isinstance(value, str):
            check_name(value, name)
    for name, value in request.query_params.multi_items():
        check_name(name, "query", max_chars=MAX_PARAM_CHARS)
        check_name(value, name)
