"""Slow and hostile clients against the server `peagle api` runs (issue 32), started for real on a free port:
the header and body deadlines, the close after an unread body, the per-address connection cap, and a burst
from one key that leaves another key's requests answered. Deadlines are configured short (1 s) and each
close is awaited with a generous upper bound, so a slow machine only makes the tests slower."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from peagle_core.processes import stop_process
from tests.fixtures.servers import free_port, wait_until_healthy
from tests.fixtures.stack import TEST_QUEUES
from tests.fixtures.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60.0  # upper bound on any close or answer awaited here; a healthy run takes about a second


def _serve(tmp: Path, db_url: str, redis_url: str, **env: str) -> Iterator[str]:
    port = free_port()
    log = tmp / f"api-{port}.log"
    environ = {
        **os.environ,
        "PEAGLE_DATA_DIR": str(tmp / f"data-{uuid.uuid4().hex[:6]}"),
        "PEAGLE_DATABASE_URL": db_url,
        "PEAGLE_REDIS_URL": redis_url,
        "PEAGLE_QUEUES": ",".join(TEST_QUEUES),
        **env,
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli",
                "api",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            cwd=REPO,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(f"{base}/healthz", proc, log, timeout_s=WAIT_S)
        yield base
    finally:
        stop_process(proc, grace_s=10)


@pytest.fixture(scope="module")
def tight_api(tmp_path_factory: pytest.TempPathFactory, db_url: str, redis_url: str) -> Iterator[str]:
    """The API with 1 s header and body deadlines and 4 connections per address."""
    yield from _serve(
        tmp_path_factory.mktemp("tight"),
        db_url,
        redis_url,
        PEAGLE_HTTP_HEADER_TIMEOUT_S="1",
        PEAGLE_HTTP_BODY_TIMEOUT_S="1",
        PEAGLE_HTTP_MAX_CONNECTIONS_PER_PEER="4",
    )


@pytest.fixture(scope="module")
def roomy_api(tmp_path_factory: pytest.TempPathFactory, db_url: str, redis_url: str) -> Iterator[str]:
    """The API as shipped but for a connection cap above the burst below (all from one loopback address)."""
    yield from _serve(
        tmp_path_factory.mktemp("roomy"), db_url, redis_url, PEAGLE_HTTP_MAX_CONNECTIONS_PER_PEER="1000"
    )


def _connect(base: str, source: str = "127.0.0.1") -> socket.socket:
    url = httpx.URL(base)
    sock = socket.create_connection((url.host, url.port), timeout=WAIT_S, source_address=(source, 0))
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as a close)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _read_answer(sock: socket.socket) -> bytes:
    """One whole answer with a Content-Length body (what a keep-alive client reads before its next ask)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(v)
        for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
        if k.lower() == b"content-length"
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-answer: {data!r}"
        body += chunk
    return head + b"\r\n\r\n" + body


def _status(data: bytes) -> int | None:
    parts = data.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def _queued_job(db_url: str, api_key: str) -> str:
    """A job of `api_key`'s project that stays queued (no worker serves this test): its stream never ends."""
    from service.crud.jobs import create_job_row
    from service.crud.projects import project_for_key
    from service.db.session import session_scope

    with session_scope(db_url) as s:
        project = project_for_key(s, api_key)
        assert project is not None
        return create_job_row(s, project.id, {"resources": {"queue": "default"}}, max_attempts=1).id


def _stream_request(job_id: str, key: str) -> bytes:
    return (
        f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\n"
        "Accept: text/event-stream\r\n\r\n"
    ).encode()


def test_a_connection_without_a_complete_head_is_closed_after_the_header_deadline(tight_api: str) -> None:
    silent, partial = _connect(tight_api), _connect(tight_api)
    with silent, partial:
        partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")  # a head that never ends
        started = time.monotonic()
        assert _read_until_closed(silent) == b""
        assert _read_until_closed(partial) == b""
        assert time.monotonic() - started >= 0.5  # closed by the deadline, not refused at once


def test_a_keep_alive_connection_gets_a_fresh_header_deadline_after_each_answer(tight_api: str) -> None:
    with _connect(tight_api) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _status(_read_answer(sock)) == 200
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # the next head starts, and stalls
        assert _read_until_closed(sock) == b""


def test_a_body_slower_than_the_body_deadline_is_answered_408_and_closed(
    tight_api: str, api_key: str
) -> None:
    with _connect(tight_api) as sock:
        sock.sendall(
            f"POST /v1/datasets HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {api_key}\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n--b\r\n".encode()
        )
        answer = _read_until_closed(sock)
    assert _status(answer) == 408, answer
    assert b'"request_timeout"' in answer and b"connection: close" in answer.lower()


def test_an_answer_to_an_unread_body_closes_the_connection(tight_api: str) -> None:
    with _connect(tight_api) as sock:
        # A wrong key: answered 401 before the app reads a byte of the body, which then never comes.
        sock.sendall(
            b"POST /v1/datasets HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer peagle_sk_wrong\r\n"
            b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n--b\r\n"
        )
        answer = _read_until_closed(sock)
    assert _status(answer) == 401, answer


def test_one_address_holds_at_most_its_connection_cap(tight_api: str, db_url: str, api_key: str) -> None:
    job_id = _queued_job(db_url, api_key)
    held = [_connect(tight_api) for _ in range(4)]
    try:
        for sock in held:  # four open event streams: requests in progress, no deadline applies
            sock.sendall(_stream_request(job_id, api_key))
            assert _status(sock.recv(65536)) == 200
        with _connect(tight_api) as fifth:
            refused = _read_until_closed(fifth)
        assert _status(refused) in (429, None), refused  # answered 429, or reset before it was read
        assert refused == b"" or b'"too_many_connections"' in refused
        # Another address is not affected by this one's cap.
        with _connect(tight_api, source="127.0.0.2") as other:
            other.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            assert _status(other.recv(65536)) == 200
        held.pop().close()
        # Under the cap again once the server has seen that close (it learns of it asynchronously).
        answers = []

        def admitted() -> bool:
            with _connect(tight_api) as again:
                try:
                    again.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
                    answers.append(again.recv(65536))
                except ConnectionResetError:  # still refused: the server has not seen the close yet
                    answers.append(b"")
            return _status(answers[-1]) == 200

        wait_until(
            admitted,
            message=lambda: f"a connection under the cap again, last answer {answers[-1]!r}",
            timeout=WAIT_S,
            interval=0.01,
        )
    finally:
        for sock in held:
            sock.close()


async def _ask_stream(
    host: str, port: int, job_id: str, key: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(_stream_request(job_id, key))
    await writer.drain()
    return reader, writer


async def _status_of(reader: asyncio.StreamReader) -> int | None:
    return _status(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S))


def test_a_burst_from_one_key_leaves_another_keys_requests_answered(
    roomy_api: str, db_url: str, api_key: str, other_api_key: str
) -> None:
    job_id = _queued_job(db_url, api_key)
    url = httpx.URL(roomy_api)

    async def scenario() -> tuple[list[int | None], list[int]]:
        # All of the burst is sent before the other key asks, and answered while it does.
        burst = await asyncio.gather(*(_ask_stream(url.host, url.port, job_id, api_key) for _ in range(150)))
        async with httpx.AsyncClient(base_url=roomy_api, timeout=WAIT_S) as other:
            headers = {"Authorization": f"Bearer {other_api_key}"}
            answers, codes = await asyncio.gather(
                asyncio.gather(
                    *(other.get("/v1/jobs", headers=headers) for _ in range(10))
                ),  # under its own cap
                asyncio.gather(*(_status_of(reader) for reader, _ in burst)),
            )
        for _, writer in burst:
            writer.close()
        return list(codes), [r.status_code for r in answers]

    burst_codes, other_codes = asyncio.run(scenario())
    assert other_codes == [200] * 10
    # One key's burst gets its streams (PEAGLE_MAX_STREAMS_PER_KEY) and 429s; nothing waits for the pool.
    assert set(burst_codes) <= {200, 429} and burst_codes.count(200) == 8, sorted(map(str, burst_codes))
