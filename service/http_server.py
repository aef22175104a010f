"""Connection-level bounds of the server `peagle api` runs (issue 32): a slow or hostile client holds no
socket, buffer or task beyond a bound, and the bound is per peer address, so other callers keep answering.

What uvicorn and h11 already offer is used as it is: `timeout_keep_alive` (an idle connection after an
answer), `h11_max_incomplete_event_size` (the most a request head may buffer, 16 KiB), `backlog`. Left
unset on purpose: `limit_concurrency`, a server-wide cap that answers everyone 503 once any callers
together reach it, so one caller could trip it for all.

What they lack is `BoundedH11Protocol`, uvicorn's h11 protocol with four additions (settings in
`service.settings`, `PEAGLE_HTTP_*`):

- a header deadline: a connection that has not delivered a complete request head within
  `http_header_timeout_s` of opening, or of its previous answer, is closed (uvicorn times a connection
  out only after an answer, and only until its first byte: a socket that never sends, or dribbles a head,
  stays open forever);
- a body deadline: a body still incomplete `http_body_timeout_s` after its head goes on only while it
  averages `http_body_min_rate` bytes a second since the head (the largest upload then still fits at that
  rate); otherwise it is answered 408, if nothing was answered yet, and the connection closed;
- an answered request whose body was not read (a 429, 413 or 401 before the upload) closes the connection
  after a short linger, instead of draining a dribbled body for as long as the client likes;
- at most `http_max_connections_per_peer` open connections per peer address in this process; more are
  answered 429 and closed at once, so one address never holds all file descriptors.

The limits are read from the process's settings (`PEAGLE_*`) on first use, so that uvicorn's worker
processes, which import this class by name, apply the same ones.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.api.errors import envelope
from service.settings import Settings, get_settings

# How long a connection whose request body was left unread may still deliver it (discarded) after the
# answer: closing with unread data makes the kernel send a reset, which can destroy the answer in flight.
LINGER_S = 2.0


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    body_min_rate: int
    max_connections_per_peer: int

    @classmethod
    def of(cls, settings: Settings) -> ConnectionLimits:
        return cls(
            header_timeout_s=settings.http_header_timeout_s,
            body_timeout_s=settings.http_body_timeout_s,
            body_min_rate=settings.http_body_min_rate,
            max_connections_per_peer=settings.http_max_connections_per_peer,
        )


@cache
def _process_limits() -> ConnectionLimits:
    return ConnectionLimits.of(get_settings())


def server_options() -> dict[str, Any]:
    """The uvicorn.Config keyword arguments `peagle api` serves with, besides host, port and workers; the
    rest (keep-alive timeout, head size, backlog) are uvicorn's and h11's defaults."""
    return {"http": BoundedH11Protocol, "proxy_headers": True}


def describe_server_options() -> dict[str, Any]:
    """The connection settings `server_options()` amounts to, as JSON-able values (the bench prints them)."""
    import uvicorn

    config = uvicorn.Config("service.app:create_app", factory=True, **server_options())
    return {
        "http": f"{BoundedH11Protocol.__module__}.{BoundedH11Protocol.__qualname__}",
        "timeout_keep_alive_s": config.timeout_keep_alive,
        "limit_concurrency": config.limit_concurrency,
        "backlog": config.backlog,
        "h11_max_incomplete_event_size": config.h11_max_incomplete_event_size
        or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE,
        **{f"http_{k}": v for k, v in _process_limits().__dict__.items()},
    }


def _raw_answer(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete `Connection: close` answer in the API's error envelope, for a connection h11 has no
    request on (refused at accept) or that the app will not answer."""
    body = json.dumps(envelope(status, message, code=code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a body deadline, a close after an unread body and a
    per-peer connection cap (the module docstring says why each)."""

    _open_by_peer: ClassVar[Counter[str]] = Counter()  # this process's open connections per peer address

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = _process_limits()
        self._peer: str | None = None  # set once this connection is counted under its peer
        self._refused = False
        self._lingering = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_since = 0.0  # monotonic time the current request's head completed
        self._body_bytes = 0  # bytes received since then

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = self.client[0] if self.client else None
        if peer is not None:  # a Unix socket has no peer address: the file's permissions bound it
            if self._open_by_peer[peer] >= self.limits.max_connections_per_peer:
                self._refused = True
                self.transport.write(
                    _raw_answer(
                        429,
                        "Too Many Requests",
                        f"this address has {self._open_by_peer[peer]} open connections (limit "
                        f"PEAGLE_HTTP_MAX_CONNECTIONS_PER_PEER: {self.limits.max_connections_per_peer})",
                        "too_many_connections",
                    )
                )
                self.transport.close()
                return
            self._open_by_peer[peer] += 1
            self._peer = peer
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadlines()
        if self._peer is not None:
            self._open_by_peer[self._peer] -= 1
            if self._open_by_peer[self._peer] <= 0:
                del self._open_by_peer[self._peer]
            self._peer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused or self._lingering:
            return  # an unread body's remains, or a refused connection's request: discarded
        self._body_bytes += len(data)
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        # Read before uvicorn starts a pipelined request's cycle: whether the answered one's body is unread.
        unread = self.conn.their_state is h11.SEND_BODY
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if unread:
            self._linger()
        else:
            self._track()

    def _track(self) -> None:
        """Arm or disarm the deadlines for where the peer is: before a head, or in a body."""
        if self.transport.is_closing() or self._lingering:
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_overdue)
            return
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if state is h11.SEND_BODY:
            if self._body_timer is None:
                self._body_since, self._body_bytes = time.monotonic(), 0
                self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._check_body)
        elif self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_deadlines(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.close()

    def _check_body(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        elapsed = time.monotonic() - self._body_since
        # While reading is paused the app, not the client, is behind: that is no slow client.
        enough = self._body_bytes >= self.limits.body_min_rate * elapsed
        if enough or self.flow.read_paused:
            # The next look: when the average would fall below the minimum rate if nothing more came.
            wait = max(self._body_bytes / self.limits.body_min_rate - elapsed, 1.0)
            self._body_timer = self.loop.call_later(wait, self._check_body)
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            # The app still waits for the body; it reads a disconnect, and anything it sends is dropped.
            cycle.disconnected = True
            self.transport.write(
                _raw_answer(
                    408,
                    "Request Timeout",
                    f"the request body was not complete within {self.limits.body_timeout_s:g} s of its head "
                    f"at {self.limits.body_min_rate} bytes/s (PEAGLE_HTTP_BODY_TIMEOUT_S, "
                    "PEAGLE_HTTP_BODY_MIN_RATE)",
                    "request_timeout",
                )
            )
            cycle.message_event.set()
        self.transport.close()

    def _linger(self) -> None:
        """The app answered without reading the whole body: stop reading it into h11, say we are done
        writing, and close once the client had a moment to read the answer."""
        self._lingering = True
        self._cancel_deadlines()
        self._unset_keepalive_if_required()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()  # read, and drop, what the client still sends until the close
        self.loop.call_later(LINGER_S, self.transport.close)
