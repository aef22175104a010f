"""Multipart framing, checked before any parser is built (python-multipart's constructor raises on a
boundary it cannot use), and a parser's refusal worded as a 400 naming the problem: one rule for the
streamed dataset uploads and the dashboard's forms."""

from __future__ import annotations

import re

from python_multipart.multipart import parse_options_header

from service.api.errors import ApiError

MULTIPART = b"multipart/form-data"
MAX_BOUNDARY = 70  # RFC 2046, section 5.1.1
# bchars: digits, letters, '()+_,-./:=? and spaces, but not as the last character.
_BOUNDARY = re.compile(rb"[0-9A-Za-z'()+_,\-./:=? ]*[0-9A-Za-z'()+_,\-./:=?]")


def _refused(message: str, param: str = "Content-Type") -> ApiError:
    return ApiError(400, message, code="malformed_body", param=param)


def multipart_boundary(content_type: str) -> bytes | None:
    """The boundary of a `multipart/form-data` Content-Type (None for another media type); a 400 naming
    the problem when it is absent or not one RFC 2046 allows."""
    media, options = parse_options_header(content_type)
    if media != MULTIPART:
        return None
    boundary = options.get(b"boundary")
    if boundary is None:
        raise _refused("the multipart/form-data Content-Type has no boundary parameter")
    if not 1 <= len(boundary) <= MAX_BOUNDARY:
        raise _refused(
            f"the multipart boundary is {len(boundary)} characters long; RFC 2046 allows 1 to {MAX_BOUNDARY}"
        )
    if not _BOUNDARY.fullmatch(boundary):
        raise _refused(
            "the multipart boundary holds a character RFC 2046 does not allow (it takes letters, digits, "
            "'()+_,-./:=? and spaces, not last)"
        )
    return boundary


def malformed_body(exc: BaseException) -> ApiError:
    """A parser's error (python-multipart's, or Starlette's wrapping of one) as the 400 that names it."""
    # Starlette words python-multipart's error as "Invalid multipart data." (then as an HTTPException):
    # the first error of the chain says what was wrong.
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    detail = next((str(e) for e in reversed(chain) if str(e)), "unreadable")
    outer = getattr(exc, "detail", None) or str(exc)
    if outer and outer != detail and len(chain) > 1:
        detail = f"{outer.rstrip('.')}: {detail}"
    return _refused(f"malformed multipart body: {detail}", param="body")
