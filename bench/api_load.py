"""API latency under load: p50/p99 and sustained req/s of GET /v1/jobs/{id} and POST /v1/jobs.

Creates a scratch Postgres database with N existing jobs (written through crud, as the API writes them),
serves the API with uvicorn in a subprocess and drives it from another process at a fixed (open-loop)
request rate with httpx.
Prints one JSON object per measurement on stdout.

    python bench/api_load.py --postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres \
        --redis-url redis://127.0.0.1:6379/0 --rate 100 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup_db(admin_url: str, n_jobs: int, spec: dict[str, Any]) -> tuple[str, str, str, list[str]]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from service.crud.jobs import create_job
    from service.crud.projects import create_key
    from service.db.migrate import upgrade
    from service.db.session import session_scope

    name = f"peagle_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    with session_scope(url) as s:
        key, row = create_key(s, "bench")
        project_id = row.project_id
    # The API's own write path (job row + its `queued` event), committed in batches.
    ids: list[str] = []
    for start in range(0, n_jobs, 2000):
        with session_scope(url) as s:
            for _ in range(min(2000, n_jobs - start)):
                ids.append(create_job(s, project_id, spec, max_attempts=3).id)
    return name, url, key, ids


def _drop_db(admin_url: str, name: str) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


async def _drive(
    base: str, key: str, method: str, paths: list[str], body: Any, rate: float, duration: float
) -> dict:
    """Open loop: request i is sent at t0 + i/rate whatever the latency of earlier ones."""
    headers = {"Authorization": f"Bearer {key}"}
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=30) as client:

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


def _driver_process(args: tuple, out: Any) -> None:
    out.put(asyncio.run(_drive(*args)))


def _run_load(*args: Any) -> dict:
    # A separate process, so the load generator does not share a GIL (or a core's scheduling) with the API.
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_driver_process, args=(args, out))
    proc.start()
    result = out.get()
    proc.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "PEAGLE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        ),
    )
    ap.add_argument(
        "--redis-url", default=os.environ.get("PEAGLE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    ap.add_argument("--jobs", type=int, default=10_000, help="existing jobs to create first")
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per measurement")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of unrecorded load first")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="peagle-bench-"))
    model_dir = tmp / "models" / "verifier"
    model_dir.mkdir(parents=True)
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    spec = {
        "verifier": {"name_or_path": str(model_dir)},
        "dataset": {"path": str(tmp / "d.jsonl"), "seq_len": 64},
        "training": {"total_seq_len": 128},
        "resources": {"queue": queue},
    }
    (tmp / "d.jsonl").write_text('{"messages": []}\n')

    name, url, key, ids = _setup_db(args.postgres_url, args.jobs, spec)
    port = _free_port()
    env = {
        **os.environ,
        "PEAGLE_DATA_DIR": str(tmp / "data"),
        "PEAGLE_DATABASE_URL": url,
        "PEAGLE_REDIS_URL": args.redis_url,
        "PEAGLE_ALLOWED_MODEL_ROOTS": str(tmp / "models"),
        "PEAGLE_ALLOWED_DATA_ROOTS": str(tmp),
    }
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "service.app:create_app",
            "--factory",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the API did not become ready")
            time.sleep(0.2)
        get_paths = [f"/v1/jobs/{i}" for i in ids]
        measurements = [
            ("GET /v1/jobs/{id}", "GET", get_paths, None),
            ("POST /v1/jobs", "POST", ["/v1/jobs"], {"spec": spec}),
        ]
        for label, method, paths, body in measurements:
            _run_load(base, key, method, paths, body, args.rate, args.warmup)
            result = _run_load(base, key, method, paths, body, args.rate, args.duration)
            print(
                json.dumps(
                    {
                        "bench": "api_load",
                        "endpoint": label,
                        "backend": "postgres",
                        "existing_jobs": args.jobs,
                        "target_rps": args.rate,
                        "duration_s": args.duration,
                        **result,
                    }
                ),
                flush=True,
            )
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        _drop_db(args.postgres_url, name)
        from rq import Queue

        from service.queue import redis_from_url

        redis = redis_from_url(args.redis_url)
        Queue(queue, connection=redis).empty()
        Queue(queue, connection=redis).delete()


if __name__ == "__main__":
    main()
