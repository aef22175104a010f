"""A database outage mid-job: Postgres (a private server of this test's own) is stopped while a job trains,
for 2.5x the time after which a heartbeat counts as stale. Training goes on, its progress is buffered and
written when the database returns, the reconciler does not take the job for dead, the API answers 503 with
Retry-After meanwhile and recovers without a restart, and the job succeeds on its first attempt.

The full minute (and repeated trials) is `bench/chaos.py --pg-outage N --outage-s 60`: a long fault scenario,
kept out of the suite's time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.pg_cluster import PrivatePostgres, postgres_bindir
from tests.worker.conftest import Stack, toy_roots, toy_spec
from worker.monitor import stale_after_s

HEARTBEAT_S = 1.0
OUTAGE_S = 2.5 * stale_after_s(HEARTBEAT_S)  # 20 s: the database heartbeat is well past stale


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    bindir = postgres_bindir()
    if bindir is None:
        pytest.skip("no Postgres server binaries (initdb, pg_ctl) on this machine")
    from service.db.session import dispose_engines

    pg = PrivatePostgres(bindir)
    try:
        yield pg
    finally:
        dispose_engines()
        pg.close()


def test_a_database_outage_mid_job_is_ridden_out(
    private_pg: PrivatePostgres,
    make_settings: Any,
    redis_conn: Any,
    toy_verifier_dir: Path,
    toy_dataset_path: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from fastapi.testclient import TestClient
    from sqlalchemy import select

    from service.app import create_app
    from service.crud.projects import create_key
    from service.db.migrate import upgrade
    from service.db.models import JobMetric, utcnow
    from service.db.session import session_scope
    from worker.reconcile import reconcile_once

    upgrade(private_pg.url)
    roots = toy_roots(tmp_path_factory)
    settings = make_settings(
        database_url=private_pg.url,
        worker_heartbeat_s=HEARTBEAT_S,
        allowed_model_roots=roots,
        allowed_data_roots=roots,
    )
    stack = Stack(settings, redis_conn, tmp_path)
    with session_scope(private_pg.url) as s:
        key, row = create_key(s, "outage")
        stack.project_id = row.project_id
    auth = {"Authorization": f"Bearer {key}"}
    client = TestClient(create_app(settings), raise_server_exceptions=False)
    try:
        spec = toy_spec(
            toy_verifier_dir,
            toy_dataset_path,
            training={"max_steps": 300, "checkpoint_every_steps": 50, "epochs": 100},
            evaluation={"prompts": 1},
        )
        job_id = stack.submit(spec)
        worker = stack.worker()
        stack.wait_for("training steps", lambda: (stack.job(job_id).progress or {}).get("step", 0) >= 3)

        private_pg.stop()
        down_at, until = utcnow(), time.monotonic() + OUTAGE_S
        answers = []
        while time.monotonic() < until:
            r = client.get(f"/v1/jobs/{job_id}", headers=auth)
            answers.append((r.status_code, r.headers.get("Retry-After"), r.json()["error"]["code"]))
            assert worker.poll() is None, "the worker died during the outage"
            time.sleep(2.0)  # pacing the probe over the outage's fixed length, not waiting on a race
        private_pg.start()
        up_at = utcnow()

        assert answers and set(answers) == {(503, "5", "database_unavailable")}
        # The API recovers by itself: its pool drops the dead connections on the first failure.
        stack.wait_for(
            "the API to answer again",
            lambda: client.get(f"/v1/jobs/{job_id}", headers=auth).status_code == 200,
            timeout=60,
        )
        # The database heartbeat is stale by its own clock, but the worker's Redis liveness key is fresh.
        assert job_id not in reconcile_once(settings, redis=redis_conn, min_queued_age_s=0).requeued

        job = stack.wait_status(job_id, "succeeded", "failed", "cancelled", timeout=600)
    finally:
        stack.stop_all()
        client.close()
    assert job.status == "succeeded", job.error
    assert job.attempt == 1
    statuses = [e.data["status"] for e in stack.events(job_id) if e.type == "status"]
    assert statuses == ["queued", "running", "succeeded"]

    with stack.sessions() as s:
        rows = s.execute(
            select(JobMetric.step, JobMetric.values, JobMetric.created_at).where(JobMetric.job_id == job_id)
        ).all()
    train_steps = sorted(step for step, values, _ in rows if "loss" in values)
    assert train_steps == list(range(1, 301))  # every step's row, the buffered ones included, exactly once
    during = [step for step, values, at in rows if "loss" in values and down_at < at < up_at]
    assert during, "no step was trained while the database was down"
    (ckpt,) = stack.checkpoints(job_id)
    assert ckpt.step == 300
