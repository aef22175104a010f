"""The harness that api_load.py and flood.py share: a scratch database (a Postgres database of its own, or a
SQLite file), the API served by uvicorn in a subprocess on loopback, an open-loop request driver, async
loads run in processes of their own, and the cleanup afterwards."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
from _common import free_port

from peagle_core.processes import stop_process


def add_service_args(ap: argparse.ArgumentParser, *, sqlite: bool = False) -> None:
    """--postgres-url (the admin URL scratch databases are created from) and --redis-url; with `sqlite`,
    --sqlite too (a SQLite file instead of a scratch Postgres database)."""
    ap.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "PEAGLE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        ),
    )
    ap.add_argument(
        "--redis-url", default=os.environ.get("PEAGLE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    if sqlite:
        ap.add_argument(
            "--sqlite", action="store_true", help="a SQLite file instead of a scratch Postgres database"
        )


def scratch_database(admin_url: str, sqlite_dir: Path | None = None) -> tuple[str, str | None]:
    """A migrated, empty database: its URL, and the name of the Postgres database created from `admin_url`
    (None for a SQLite file in `sqlite_dir`)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from service.db.migrate import upgrade

    name = None
    if sqlite_dir is not None:
        url = f"sqlite:///{sqlite_dir / 'peagle.db'}"
    else:
        name = f"peagle_bench_{uuid.uuid4().hex[:10]}"
        admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
        url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    return url, name


def drop_db(admin_url: str, name: str) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def clear_queue(redis_url: str, queue: str) -> None:
    from rq import Queue

    from service.queue import redis_from_url

    redis = redis_from_url(redis_url)
    Queue(queue, connection=redis).empty()
    Queue(queue, connection=redis).delete()


def service_env(tmp: Path, database_url: str, redis_url: str, **extra: str) -> dict[str, str]:
    """The API's environment: data under `tmp/data`, models under `tmp/models`, datasets anywhere in `tmp`."""
    return {
        **os.environ,
        "PEAGLE_DATA_DIR": str(tmp / "data"),
        "PEAGLE_DATABASE_URL": database_url,
        "PEAGLE_REDIS_URL": redis_url,
        "PEAGLE_ALLOWED_MODEL_ROOTS": str(tmp / "models"),
        "PEAGLE_ALLOWED_DATA_ROOTS": str(tmp),
        **extra,
    }


@contextlib.contextmanager
def served_api(env: dict[str, str], ready_timeout_s: float = 60, production: bool = False) -> Iterator[str]:
    """Serve the API with uvicorn in a subprocess on a free loopback port; yield its base URL once
    /readyz answers, and stop the server on the way out. `production`: launched as `peagle api` is, with
    its uvicorn settings (timeouts, limits, proxy headers), not a bare uvicorn command line."""
    port = free_port()
    if production:
        argv = ["-m", "cli", "api", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    else:
        argv = ["-m", "uvicorn", "service.app:create_app", "--factory", "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning", "--no-access-log"]  # fmt: skip
    server = subprocess.Popen([sys.executable, *argv], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the API did not become ready")
            time.sleep(0.2)
        yield base
    finally:
        stop_process(server, grace_s=30)


async def drive(
    base: str,
    key: str,
    method: str,
    paths: list[str],
    body: Any,
    rate: float,
    duration: float,
    local_address: str | None = None,
) -> dict:
    """Open loop: request i is sent at t0 + i/rate whatever the latency of earlier ones; from
    `local_address` (a loopback address such as 127.0.0.2) when given."""
    headers = {"Authorization": f"Bearer {key}"}
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    transport = httpx.AsyncHTTPTransport(limits=limits, local_address=local_address)
    async with httpx.AsyncClient(base_url=base, headers=headers, transport=transport, timeout=30) as client:

        async def one(path: str) -> None:
            nonlocal errors
            start = time.perf_counter()
            try:
                r = await client.request(method, path, json=body)
                ok = r.status_code < 400
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - start)
            else:
                errors += 1

        n = int(rate * duration)
        t0 = time.perf_counter()
        tasks = []
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(random.choice(paths))))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    latencies.sort()

    def pct(p: float) -> float:
        return (
            round(1000 * latencies[min(len(latencies) - 1, int(p * len(latencies)))], 2)
            if latencies
            else float("nan")
        )

    return {
        "requests": n,
        "errors": errors,
        "achieved_rps": round(len(latencies) / elapsed, 1),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": round(1000 * latencies[-1], 2) if latencies else None,
    }


def _run_async(fn: Callable[..., Coroutine[Any, Any, Any]], args: tuple, out: Any) -> None:
    out.put(asyncio.run(fn(*args)))


class InProcess:
    """`fn(*args)`, an async function, run in a spawned process of its own, so a load generator does not
    share a GIL (or a core's scheduling) with the API or with another load. `fn` must be a module-level
    function (it is pickled)."""

    def __init__(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.proc = ctx.Process(target=_run_async, args=(fn, args, self.out))
        self.proc.start()

    def result(self, timeout: float | None = None) -> Any:
        """What `fn` returned; with a `timeout`, a process that dies without answering fails the run."""
        result = self.out.get(timeout=timeout)
        self.proc.join()
        return result
