"""Worker test helpers: submit jobs through crud + the real queue, run real `peagle worker` subprocesses,
and poll the database (with a deadline) for the states the tests wait on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from peagle_core.processes import stop_process
from tests.fixtures.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
PEAGLE = [sys.executable, "-m", "cli"]


# Overrides for a job that is evaluated by vLLM too and published through the vLLM gate.
VLLM_ON: dict[str, Any] = {"evaluation": {"engine": "both"}, "export": {"vllm_check": True}}


def toy_spec(verifier_dir: Path, data_path: Path, **overrides: Any) -> dict[str, Any]:
    """A job spec that trains a one-layer drafter on the toy verifier in a few seconds."""
    spec: dict[str, Any] = {
        "verifier": {"name_or_path": str(verifier_dir)},
        "dataset": {"path": str(data_path), "seq_len": 128, "val_fraction": 0.1},
        "hidden_states": {"mode": "online"},
        "model": {"num_layers": 1, "num_depths": 2, "draft_vocab_size": 256},
        "training": {
            "total_seq_len": 256,
            "lr": 1e-3,
            "max_steps": 4,
            "checkpoint_every_steps": 2,
            "seed": 3,
        },
        # vLLM runs in the tests that use VLLM_ON (and tests/integration); elsewhere it would only add an engine
        # start to every job.
        "evaluation": {"prompts": 2, "max_new_tokens": 8, "engine": "peagle"},
        "export": {"vllm_check": False},
    }
    for section, values in overrides.items():
        spec[section] = {**spec.get(section, {}), **values} if isinstance(values, dict) else values
    return spec


def toy_roots(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Server roots a test worker must allow: it re-checks every path of a spec, and the toy verifier and
    corpus live in the session's tmp tree (or in $PEAGLE_CACHE_DIR, tests/fixtures/toy.py)."""
    roots = [tmp_path_factory.getbasetemp()]
    if os.environ.get("PEAGLE_CACHE_DIR"):
        roots.append(Path(os.environ["PEAGLE_CACHE_DIR"]))
    return roots


class Stack:
    """The test's view of the service: database sessions, Redis, and worker subprocesses."""

    def __init__(self, settings: Any, redis: Any, tmp_path: Path):
        from service.crud.projects import get_or_create_project
        from service.db.session import session_factory

        self.settings = settings
        self.redis = redis
        self.tmp_path = tmp_path
        self.sessions = session_factory(settings.database_url)
        with self.sessions() as s:
            self.project_id = get_or_create_project(s, f"worker-tests-{uuid.uuid4().hex[:8]}").id
            s.commit()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "PEAGLE_DATA_DIR": str(settings.data_dir),
            "PEAGLE_DATABASE_URL": settings.database_url,
            "PEAGLE_REDIS_URL": settings.redis_url,
            "PEAGLE_ARTIFACT_ROOT": settings.artifact_root,
            "PEAGLE_WORKER_HEARTBEAT_S": "1",
            "PEAGLE_CANCEL_GRACE_S": str(settings.cancel_grace_s),
            "PEAGLE_ALLOWED_MODEL_ROOTS": json.dumps([str(p) for p in settings.allowed_model_roots]),
            "PEAGLE_ALLOWED_DATA_ROOTS": json.dumps([str(p) for p in settings.allowed_data_roots]),
            "PYTHONPATH": str(REPO),
        }

    def submit(self, spec: dict[str, Any], *, enqueue: bool = True) -> str:
        from service.crud.jobs import create_job_row
        from service.queue import enqueue_run

        with self.sessions() as s:
            job = create_job_row(s, self.project_id, spec, max_attempts=self.settings.max_attempts)
            s.commit()
            job_id = job.id
        if enqueue:
            enqueue_run(self.redis, job_id, "default", self.settings.job_timeout_s)
        return job_id

    def worker(self, *args: str, log_name: str = "worker") -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"{log_name}-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [*PEAGLE, "worker", "--no-reconcile", *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        self.procs.append(proc)
        return proc

    def run_burst(self, timeout: float = 300) -> None:
        proc = self.worker("--burst")
        proc.wait(timeout=timeout)

    def job(self, job_id: str) -> Any:
        from service.db.models import Job

        with self.sessions() as s:
            job = s.get(Job, job_id)
            s.expunge(job)
            return job

    def events(self, job_id: str) -> list[Any]:
        from sqlalchemy import select

        from service.db.models import JobEvent

        with self.sessions() as s:
            rows = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all()
            s.expunge_all()
            return list(rows)

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        from sqlalchemy import select

        from service.db.models import JobMetric

        with self.sessions() as s:
            rows = s.scalars(select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.id)).all()
            return [dict(r.values, step=r.step) for r in rows]

    def checkpoints(self, job_id: str) -> list[Any]:
        from sqlalchemy import select

        from service.db.models import Checkpoint

        with self.sessions() as s:
            rows = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)).all()
            s.expunge_all()
            return list(rows)

    def wait_for(self, what: str, cond: Callable[[], Any], timeout: float = 240, every: float = 0.2) -> Any:
        def ready() -> Any:
            value = cond()
            for p in () if value else self.procs:  # a dead worker ends the wait: nothing will change now
                if p.poll() not in (None, 0):
                    raise AssertionError(f"a worker exited with {p.returncode} while waiting for {what}")
            return value

        return wait_until(ready, message=what, timeout=timeout, interval=every)

    def wait_status(self, job_id: str, *statuses: str, timeout: float = 240) -> Any:
        return self.wait_for(
            f"{job_id} to be {statuses}",
            lambda: (j := self.job(job_id)).status in statuses and j,
            timeout=timeout,
        )

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:  # all asked to stop first, so they stop side by side
            stop_process(p, grace_s=30)


@pytest.fixture
def stack(
    make_settings: Callable[..., Any],
    isolated_db_url: str,
    redis_conn: Any,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    # Workers and the reconciler act on every job in the database: give each test a database of its own.
    # The worker re-checks server paths, so the session's tmp tree (toy verifier, corpus) is an allowed root.
    roots = toy_roots(tmp_path_factory)
    settings = make_settings(
        database_url=isolated_db_url,
        worker_heartbeat_s=1.0,
        cancel_grace_s=60.0,
        allowed_model_roots=roots,
        allowed_data_roots=roots,
    )
    s = Stack(settings, redis_conn, tmp_path)
    try:
        yield s
    finally:
        s.stop_all()
