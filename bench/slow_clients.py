"""Slow and hostile clients against the API as `peagle api` serves it: how many dribbled uploads, unread
event streams and idle sockets one caller can hold open, whether the server closes them, and another
project's `GET /v1/jobs` p50/p99 before and while they are held (its requests start before the slow clients
open, so they also see a burst's opening: 150 stream requests at once).

Serves the API in a subprocess on loopback with the production launch (`python -m cli api`: its uvicorn
settings), a scratch Postgres database (or `--sqlite`). The slow clients are plain asyncio sockets in one
process, all from one address with one API key; the other tenant is httpx, open loop, in another. Per kind
it reports how many were attempted, still held at the kind's deadline (the header deadline for idle sockets,
the body deadline for dribbled uploads) and at the end of the hold, closed by the server, and after how
long. Prints one JSON object per measurement on stdout.

    python bench/slow_clients.py [--dribblers 40] [--streams 150] [--idle 400] [--hold-s 75] [--sqlite]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import _api_harness as harness
from _common import emit

KINDS = ("dribbled_bodies", "unread_streams", "idle_sockets")
TENANT_ADDRESS = "127.0.0.2"
_BOUNDARY = "peagleslow"
# A valid start of an upload; at one byte a second no dribbler gets past it in a run.
_BODY = (
    f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="d.jsonl"\r\n'
    "Content-Type: application/octet-stream\r\n\r\n"
    + '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    * 100
).encode()


def _setup(args: argparse.Namespace, tmp: Path) -> tuple[str, str | None, str, str, str]:
    """The database URL (and the scratch Postgres database's name), the slow caller's key and its queued
    job (whose event stream never ends: no worker serves its queue), and the other tenant's key, whose
    project gets a page of jobs to list."""
    from service.crud.jobs import create_job_row
    from service.crud.projects import create_key
    from service.db.session import session_scope

    url, name = harness.scratch_database(args.postgres_url, sqlite_dir=tmp if args.sqlite else None)
    with session_scope(url) as s:
        key_slow, slow = create_key(s, "slow-caller")
        key_tenant, tenant = create_key(s, "other-tenant")
        job_id = create_job_row(s, slow.project_id, {"resources": {"queue": "default"}}, max_attempts=1).id
        for _ in range(50):
            create_job_row(s, tenant.project_id, {"resources": {"queue": "default"}}, max_attempts=1)
    return url, name, key_slow, job_id, key_tenant


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    status: int | None = None  # the status of an answer the server sent, if any
    closed: bool = False  # the server closed (or reset) the connection
    sent: int = 0
    tasks: list[asyncio.Task] = field(default_factory=list)
    opened_at: float = field(default_factory=time.monotonic)
    closed_after_s: float | None = None  # seconds from connecting to the server's close, when seen

    def close_seen(self) -> None:
        if not self.closed:
            self.closed, self.closed_after_s = True, time.monotonic() - self.opened_at


async def _connect(host: str, port: int) -> _Conn | None:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except (OSError, TimeoutError):
        return None
    return _Conn(reader, writer)


def _status_of(head: bytes) -> int | None:
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


async def _watch(conn: _Conn) -> None:
    """Read what the server sends (nothing, unless it answers or hangs up) until it closes."""
    try:
        first = True
        while data := await conn.reader.read(65536):
            if first and conn.status is None:  # a refused stream's head was read already
                conn.status = _status_of(data)
            first = False
    except OSError:
        pass
    conn.close_seen()


async def _still_open(conn: _Conn) -> bool:
    """For a stream left unread: read what queued up, and see whether the server hung up meanwhile."""
    conn.writer.transport.resume_reading()
    try:
        while True:
            if not await asyncio.wait_for(conn.reader.read(65536), 1.0):
                return False
    except TimeoutError:
        return True
    except OSError:
        return False


async def _dribble(conns: list[_Conn], stop: asyncio.Event) -> None:
    """One byte a second on every open upload."""
    while not stop.is_set():
        for conn in conns:
            if conn.closed or conn.sent >= len(_BODY):
                continue
            try:
                conn.writer.write(_BODY[conn.sent : conn.sent + 1])
                conn.sent += 1
            except OSError:
                conn.close_seen()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def _open(kind: str, host: str, key: str, job_id: str, conn: _Conn) -> None:
    """Send what a client of `kind` sends first; an unread stream also reads its answer's head."""
    auth = f"Authorization: Bearer {key}\r\nHost: {host}\r\n"
    if kind == "dribbled_bodies":
        conn.writer.write(
            f"POST /v1/datasets HTTP/1.1\r\n{auth}Content-Type: multipart/form-data; boundary={_BOUNDARY}"
            f"\r\nContent-Length: {len(_BODY)}\r\n\r\n".encode()
        )
        conn.tasks.append(asyncio.create_task(_watch(conn)))
    elif kind == "unread_streams":
        conn.writer.write(
            f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\n{auth}Accept: text/event-stream\r\n\r\n".encode()
        )
        try:
            conn.status = _status_of(await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 30))
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            conn.close_seen()
            return
        if conn.status != 200:  # refused: watch for the server's close
            conn.tasks.append(asyncio.create_task(_watch(conn)))
            return
        conn.writer.transport.pause_reading()  # never read the stream's body: the server's sends back up
    else:
        conn.tasks.append(asyncio.create_task(_watch(conn)))


async def slow_clients(
    base: str, key: str, job_id: str, kind: str, n: int, hold_s: float, deadline_s: float | None
) -> dict:
    """Open `n` clients of `kind` from this one address with one key, hold them `hold_s`
    seconds, and count how many are still open (at `deadline_s` and at the end), when the server closed
    the others, and what it answered."""
    host, port = urlsplit(base).hostname, urlsplit(base).port
    opened = await asyncio.gather(*(_connect(host, port) for _ in range(n)))
    conns = [c for c in opened if c is not None]
    await asyncio.gather(*(_open(kind, host, key, job_id, c) for c in conns))
    stop = asyncio.Event()
    dribbler = asyncio.create_task(_dribble(conns, stop)) if kind == "dribbled_bodies" else None
    t0 = time.monotonic()
    await asyncio.sleep(hold_s)
    if kind == "unread_streams":
        for conn, open_ in zip(conns, await asyncio.gather(*(_still_open(c) for c in conns)), strict=True):
            if not open_:
                conn.close_seen()
    held_after_s = round(time.monotonic() - t0, 1)
    stop.set()
    if dribbler is not None:
        await dribbler
    held = [c for c in conns if not c.closed]
    times = sorted(c.closed_after_s for c in conns if c.closed_after_s is not None)
    result = {
        "attempted": n,
        "connected": len(conns),
        "deadline_s": deadline_s,
        # Still open 2 s past the kind's deadline (the server's timer plus a scheduling margin).
        "held_after_deadline": None
        if deadline_s is None
        else sum(1 for c in conns if c.closed_after_s is None or c.closed_after_s > deadline_s + 2),
        "held_after_s": held_after_s,
        "held": len(held),
        "closed_by_server": len(conns) - len(held),
        # Streams answered 200 are only looked at after the hold: their close time is not known sooner.
        "closed_after_s": {
            "p50": round(times[len(times) // 2], 2) if times else None,
            "max": round(times[-1], 2) if times else None,
        },
        "answers": dict(Counter(str(c.status) for c in conns if c.status is not None)),
    }
    if kind == "unread_streams":
        result["held_streaming"] = sum(1 for c in held if c.status == 200)
    for conn in conns:
        for task in conn.tasks:
            task.cancel()
        conn.writer.close()
    await asyncio.gather(*(t for c in conns for t in c.tasks), return_exceptions=True)
    return result


def _server_settings() -> dict[str, Any]:
    """The connection settings `peagle api` runs with (under the bench's environment: the defaults)."""
    try:
        from service.http_server import describe_server_options
    except ImportError:  # a checkout from before issue 32's connection bounds: uvicorn's defaults
        import uvicorn

        cfg = uvicorn.Config("service.app:create_app", factory=True, proxy_headers=True)
        return {
            "timeout_keep_alive_s": cfg.timeout_keep_alive,
            "limit_concurrency": cfg.limit_concurrency,
            "backlog": cfg.backlog,
            "h11_max_incomplete_event_size": cfg.h11_max_incomplete_event_size,
        }
    return describe_server_options()


async def other_tenant(base: str, key: str, rate: float, duration: float, started: Any) -> dict:
    """The other tenant's open-loop `GET /v1/jobs`, `started` set just before its first request."""
    started.set()
    # From another loopback address than the slow clients': a tenant elsewhere, not under their address's
    # connection cap.
    return await harness.drive(
        base, key, "GET", ["/v1/jobs"], None, rate, duration, local_address=TENANT_ADDRESS
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_service_args(ap, sqlite=True)
    ap.add_argument("--dribblers", type=int, default=40, help="uploads sending one body byte a second")
    ap.add_argument("--streams", type=int, default=150, help="event streams opened and never read")
    ap.add_argument("--idle", type=int, default=400, help="TCP connections that send nothing")
    ap.add_argument(
        "--hold-s",
        type=float,
        default=75.0,
        help="how long the slow clients are held (past the body deadline)",
    )
    ap.add_argument("--tenant-requests", type=int, default=200, help="the other tenant's GET /v1/jobs")
    ap.add_argument("--tenant-rate", type=float, default=20.0, help="... sent at this many per second")
    ap.add_argument("--kinds", default=",".join(KINDS), help="which slow clients (comma-separated)")
    args = ap.parse_args()
    sizes = {"dribbled_bodies": args.dribblers, "unread_streams": args.streams, "idle_sockets": args.idle}
    duration = args.tenant_requests / args.tenant_rate
    hold_s = max(args.hold_s, duration + 5)  # the tenant's run (and its process start) fits in the hold
    server = _server_settings()
    deadlines = {
        "dribbled_bodies": server.get("http_body_timeout_s"),
        "idle_sockets": server.get("http_header_timeout_s"),
        "unread_streams": None,
    }

    tmp = Path(tempfile.mkdtemp(prefix="peagle-slow-"))
    url, db_name, key_slow, job_id, key_tenant = _setup(args, tmp)
    backend = "sqlite" if args.sqlite else "postgres"
    try:
        with harness.served_api(harness.service_env(tmp, url, args.redis_url), production=True) as base:
            emit(bench="slow_clients", server="peagle api", backend=backend, **server)
            warm_up = (base, key_tenant, "GET", ["/v1/jobs"], None, args.tenant_rate, 2.0)
            asyncio.run(harness.drive(*warm_up, local_address=TENANT_ADDRESS))  # unrecorded
            for kind in ("baseline", *args.kinds.split(",")):
                # The tenant runs first and the slow clients open while it does: it sees their opening too.
                started = mp.get_context("spawn").Event()
                other = harness.InProcess(other_tenant, base, key_tenant, args.tenant_rate, duration, started)
                if not started.wait(120):
                    raise SystemExit("the other tenant did not start")
                slow = None
                if kind != "baseline":
                    slow = harness.InProcess(
                        slow_clients,
                        base,
                        key_slow,
                        job_id,
                        kind,
                        sizes[kind],
                        hold_s,
                        deadlines[kind],
                    )
                measured = other.result(timeout=duration + 120)
                if slow is not None:
                    emit(
                        bench="slow_clients", kind=kind, backend=backend, **slow.result(timeout=hold_s + 120)
                    )
                emit(
                    bench="slow_clients",
                    measure="other_tenant_get_jobs",
                    phase=kind,
                    backend=backend,
                    requests=measured["requests"],
                    p50_s=round(measured["p50_ms"] / 1000, 4),
                    p99_s=round(measured["p99_ms"] / 1000, 4),
                    max_s=None if measured["max_ms"] is None else round(measured["max_ms"] / 1000, 4),
                    errors=measured["errors"],
                )
    finally:
        if db_name is not None:
            harness.drop_db(args.postgres_url, db_name)


if __name__ == "__main__":
    main()
