"""HTTP Range (RFC 9110 §14) for every route that serves a file's bytes: one parser, used by the
checkpoint file downloads and, through `RangedFileResponse`, by the dashboard's static files."""

from __future__ import annotations

import re

from starlette.responses import FileResponse, RangeNotSatisfiable

from service.api.errors import ApiError

# Range units compare case-insensitively (RFC 9110 §14.1); a list of ranges does not match, on purpose.
_RANGE = re.compile(r"^bytes=([0-9]*)-([0-9]*)$", re.IGNORECASE)
# Offsets past any file: a longer digit string reads as this (int() of over 4300 digits raises; shorter
# ones still cost quadratic time), so `bytes=<5000 digits>-` is a 416, not a 500.
_BEYOND_ANY_FILE = 1 << 63


def _offset(digits: str) -> int:
    return int(digits) if len(digits) <= 19 else _BEYOND_ANY_FILE


def unsatisfiable(size: int) -> ApiError:
    """The 416 answer for a file of `size` bytes, with the `Content-Range: bytes */size` RFC 9110 asks for."""
    return ApiError(
        416, f"range not satisfiable: the file has {size} bytes", headers={"Content-Range": f"bytes */{size}"}
    )


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) of a single `bytes=` range; None means serve the whole file.

    Malformed values, other units and lists of ranges give None: a server may ignore Range (RFC 9110
    §14.2), and answering many or overlapping ranges with the whole file once bounds the work. Raises
    ApiError 416 for a well-formed range that lies outside the file.
    """
    m = _RANGE.match(header.strip())
    if m is None:
        return None
    first, last = m.groups()
    if not first and not last:
        return None
    if not first:  # suffix: the last N bytes
        n = _offset(last)
        if n == 0 or size == 0:
            raise unsatisfiable(size)
        return max(0, size - n), size
    start = _offset(first)
    end = min(_offset(last), size - 1) if last else size - 1
    if start >= size or (last and _offset(last) < start):
        raise unsatisfiable(size)
    return start, end + 1


class RangedFileResponse(FileResponse):
    """Starlette's FileResponse with Range read by `parse_range`: Starlette's own parser answers 400 to a
    malformed value and serves up to 100 ranges as multipart; here both get the whole file once."""

    @classmethod
    def _parse_range_header(cls, http_range: str, file_size: int) -> list[tuple[int, int]]:
        try:
            span = parse_range(http_range, file_size)
        except ApiError:
            raise RangeNotSatisfiable(file_size) from None
        return [] if span is None else [span]  # [] is Starlette's "send the whole file"
