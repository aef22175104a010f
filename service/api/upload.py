"""Stream one file out of a multipart request body to a local spool file: chunked, hashed, size-capped.

The body is parsed as it arrives (python-multipart's streaming parser), so an upload is never held in
memory and an oversized one is refused as soon as it crosses the cap, without writing the rest. Parsing,
hashing and writing run on a worker thread, a batch of chunks at a time, so the event loop keeps serving.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
from fastapi import Request
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from service.api.errors import ApiError
from service.api.framing import malformed_body, multipart_boundary
from service.api.request_text import check_name

# Chunks handed to the parsing thread at once: one thread hop per MiB instead of per 64 KiB chunk.
_BATCH_BYTES = 1 << 20


@dataclass
class SpooledFile:
    path: Path
    filename: str
    size: int
    sha256: str


class _FilePart:
    """Collects the headers of each part and writes the data of the wanted field to `out`."""

    def __init__(self, field: str, out: Path, max_bytes: int, over_limit: Callable[[int], ApiError] | None):
        self.field, self.out, self.max_bytes, self.over_limit = field, out, max_bytes, over_limit
        self.header_name = b""
        self.header_value = b""
        self.headers: dict[bytes, bytes] = {}
        self.active = False
        self.found = False
        self.filename = ""
        self.size = 0
        self.hash = hashlib.sha256()
        self.fh = None

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda d, s, e: setattr(self, "header_name", self.header_name + d[s:e]),
            "on_header_value": lambda d, s, e: setattr(self, "header_value", self.header_value + d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._data,
            "on_part_end": self._part_end,
        }

    def _part_begin(self) -> None:
        self.headers = {}

    def _header_end(self) -> None:
        self.headers[self.header_name.strip().lower()] = self.header_value.strip()
        self.header_name, self.header_value = b"", b""

    def _headers_finished(self) -> None:
        _, opts = parse_options_header(self.headers.get(b"content-disposition", b""))
        name = opts.get(b"name", b"").decode(errors="replace")
        if name == self.field and not self.found:
            filename = os.path.basename(opts.get(b"filename", b"data.jsonl").decode(errors="replace"))[:255]
            # The name is stored and shown: refused before a byte of the data is written.
            check_name(filename, self.field)
            self.active = self.found = True
            self.filename = filename
            self.fh = open(self.out, "wb")  # noqa: SIM115 - closed in _part_end / close()

    def _data(self, data: bytes, start: int, end: int) -> None:
        if not self.active:
            return
        chunk = data[start:end]
        self.size += len(chunk)
        if self.size > self.max_bytes:
            if self.over_limit is not None:
                raise self.over_limit(self.max_bytes)
            raise ApiError(413, f"the upload exceeds the limit of {self.max_bytes} bytes", param=self.field)
        self.hash.update(chunk)
        self.fh.write(chunk)

    def _part_end(self) -> None:
        if self.active:
            self.active = False
            self.close()

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


async def spool_multipart_file(
    request: Request,
    field: str,
    dest: Path,
    max_bytes: int,
    *,
    over_limit: Callable[[int], ApiError] | None = None,
) -> SpooledFile:
    """Write the multipart field `field` of `request` to `dest`; 413 over `max_bytes` (or the error
    `over_limit(max_bytes)` makes, when the limit is a quota rather than the upload cap), 422 if absent.

    On any error `dest` is removed.
    """
    boundary = multipart_boundary(request.headers.get("content-type", ""))  # 400 when malformed
    if boundary is None:
        raise ApiError(
            415,
            "send the dataset as multipart/form-data with a `file` field",
            code="unsupported_media_type",
            param="Content-Type",
        )
    declared = request.headers.get("content-length")
    # Multipart framing adds well under 64 KiB; a larger declared body can be refused unread.
    if declared and declared.isdigit() and int(declared) > max_bytes + (64 << 10):
        if over_limit is not None:
            raise over_limit(max_bytes)
        raise ApiError(413, f"the upload exceeds the limit of {max_bytes} bytes", param=field)
    part = _FilePart(field, dest, max_bytes, over_limit)

    def feed(chunks: list[bytes]) -> None:
        for chunk in chunks:
            parser.write(chunk)

    try:
        parser = MultipartParser(boundary, part.callbacks())
        batch: list[bytes] = []
        pending = 0
        async for chunk in request.stream():
            batch.append(chunk)
            pending += len(chunk)
            if pending >= _BATCH_BYTES:
                await anyio.to_thread.run_sync(feed, batch)
                batch, pending = [], 0
        await anyio.to_thread.run_sync(feed, batch)
        parser.finalize()
    except FormParserError as exc:
        part.close()
        with contextlib.suppress(OSError):
            dest.unlink()
        raise malformed_body(exc) from None
    except BaseException:
        part.close()
        with contextlib.suppress(OSError):
            dest.unlink()
        raise
    part.close()
    if not part.found:
        raise ApiError(422, f"the multipart body has no `{field}` field", param=field)
    return SpooledFile(path=dest, filename=part.filename, size=part.size, sha256=part.hash.hexdigest())
