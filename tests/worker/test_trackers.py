"""`tracking.report_to`: TensorBoard event files (read back with TensorBoard's own reader), a run on a real
`mlflow server` (read back with the MLflow client), and a tracker outage that leaves the job succeeded."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.archives import extract_archive
from tests.fixtures.servers import free_port, wait_until_healthy
from tests.fixtures.wait import wait_until
from tests.worker.conftest import Stack, toy_spec

pytest.importorskip("mlflow", reason="the trackers extra is not installed")
# One xdist worker runs the module: the mlflow server is a module fixture, started once per worker.
pytestmark = pytest.mark.xdist_group("trackers")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `mlflow server` (SQLite backend, proxied artifacts) on a free port."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "mlflow", "server"),
            *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
            *("--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"),
            *("--artifacts-destination", str(root / "artifacts")),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the server forks uvicorn: stop the whole group
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(f"{url}/health", proc, root / "server.log", timeout_s=180)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)  # nothing to save: the database is the test's
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _api_key(stack: Stack) -> str:
    from service.crud.projects import create_key
    from service.db.models import Project

    with stack.sessions() as s:
        name = s.get(Project, stack.project_id).name
        key, _ = create_key(s, name)
    return key


def _series(stack: Stack, job_id: str, key: str) -> list[tuple[int, float]]:
    return [(m["step"], m[key]) for m in stack.metrics(job_id) if m.get(key) is not None]


def test_tensorboard_and_mlflow_hold_the_api_metrics_and_the_checkpoint(
    stack: Stack, mlflow_server: str, toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing import event_accumulator

    from service.app import create_app

    stack.env["PEAGLE_MLFLOW_TRACKING_URI"] = mlflow_server
    spec = toy_spec(toy_verifier_dir, toy_dataset_path, tracking={"report_to": ["tensorboard", "mlflow"]})
    job_id = stack.submit(spec)
    stack.run_burst()
    job = stack.job(job_id)
    assert job.status == "succeeded", (job.error, [e.message for e in stack.events(job_id)])
    assert not [e for e in stack.events(job_id) if e.level == "warning"]

    # TensorBoard: the archive the API serves, read with TensorBoard's own reader.
    app = create_app(stack.settings)
    with TestClient(app) as client:
        auth = {"Authorization": f"Bearer {_api_key(stack)}"}
        res = client.get(f"/v1/jobs/{job_id}/tensorboard", headers=auth)
        assert res.status_code == 200, res.text
        api_loss = client.get(f"/v1/jobs/{job_id}/metrics", headers=auth).json()["data"]
    with tarfile.open(fileobj=io.BytesIO(res.content)) as tar:
        extract_archive(tar, tmp_path / "tb")
    logdir = tmp_path / "tb" / f"{job_id}-tensorboard"
    assert any(p.name.startswith("events.out.tfevents") for p in logdir.iterdir())
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    api_series = {
        k: [(m["step"], m["values"][k]) for m in api_loss if m["values"].get(k) is not None]
        for k in ("loss", "acc_0", "lr", "tokens_per_s", "eval/acceptance_length@2")
    }
    assert api_series["loss"] and api_series["eval/acceptance_length@2"]
    for key, series in api_series.items():
        tb = [(e.step, e.value) for e in acc.Scalars(key)]
        assert [s for s, _ in tb] == [s for s, _ in series], key
        assert [v for _, v in tb] == pytest.approx([v for _, v in series], rel=1e-6), key  # float32 in TB

    # MLflow: one run for the job, its params, per-step metrics and the checkpoint's files.
    ml = MlflowClient(tracking_uri=mlflow_server)
    experiment = ml.get_experiment_by_name("peagle")
    (run,) = ml.search_runs([experiment.experiment_id], filter_string=f"tags.`peagle.job_id` = '{job_id}'")
    assert run.info.status == "FINISHED"
    assert run.data.params["training.max_steps"] == "4"
    assert run.data.params["tracking.report_to"] == '["tensorboard", "mlflow"]'
    history = sorted((m.step, m.value) for m in ml.get_metric_history(run.info.run_id, "loss"))
    assert history == _series(stack, job_id, "loss")  # MLflow keeps doubles: exact
    (acceptance,) = ml.get_metric_history(run.info.run_id, "eval/acceptance_length_2")
    assert [(acceptance.step, acceptance.value)] == _series(stack, job_id, "eval/acceptance_length@2")
    (ckpt,) = stack.checkpoints(job_id)
    names = {a.path for a in ml.list_artifacts(run.info.run_id, "checkpoint")}
    assert {f"checkpoint/{f['name']}" for f in ckpt.files} <= names
    weights = next(f for f in ckpt.files if f["name"] == "model.safetensors")
    local = ml.download_artifacts(run.info.run_id, "checkpoint/model.safetensors", str(tmp_path / "ml"))
    assert hashlib.sha256(Path(local).read_bytes()).hexdigest() == weights["sha256"]


def test_a_tracker_outage_leaves_the_job_succeeded_with_one_warning(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    # Nothing listens on this port: every MLflow call fails (connection refused).
    stack.env["PEAGLE_MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{free_port()}"
    spec = toy_spec(toy_verifier_dir, toy_dataset_path, tracking={"report_to": ["mlflow", "tensorboard"]})
    job_id = stack.submit(spec)
    stack.run_burst()
    job = stack.job(job_id)
    assert job.status == "succeeded", (job.error, [e.message for e in stack.events(job_id)])
    warnings = [e for e in stack.events(job_id) if e.level == "warning"]
    assert len(warnings) == 1, [w.message for w in warnings]
    assert warnings[0].type == "warning" and warnings[0].data["tracker"] == "mlflow"
    assert "mlflow tracker failed" in warnings[0].message
    # The other tracker carried on.
    from service.artifacts import ArtifactStore
    from service.tracking import tensorboard_key

    assert ArtifactStore(stack.settings.artifact_root).list_files(tensorboard_key(job_id))


def _claimed_job(sessions, report_to: list[str]) -> tuple[str, str, Any]:
    """A job row claimed as attempt 1 (no worker runs it: the test drives its trackers in this process)."""
    from peagle_core.spec import JobSpec
    from service.crud import jobstate
    from service.crud.jobs import create_job_row
    from service.crud.projects import get_or_create_project

    spec = toy_spec(Path("/models/v"), Path("/data/d.jsonl"), tracking={"report_to": report_to})
    with sessions() as s:
        project_id = get_or_create_project(s, f"trackers-{uuid.uuid4().hex[:8]}").id
        job_id = create_job_row(s, project_id, spec, max_attempts=3).id
        s.commit()
        assert jobstate.claim(s, job_id, "test-worker")
        s.commit()
    return job_id, project_id, JobSpec.model_validate(spec)


def _log_steps(sessions, job_id: str, steps: range, attempt: int = 1) -> int:
    from service.crud.metrics import add_metrics

    with sessions() as s:
        rows = [add_metrics(s, job_id, step, {"loss": 1.0 / step, "attempt": attempt}) for step in steps]
        s.commit()
        return rows[-1].id


def _tensorboard_steps(store: Any, job_id: str, dest: Path) -> list[int]:
    from tensorboard.backend.event_processing import event_accumulator

    from service.tracking import tensorboard_key

    store.fetch_dir(tensorboard_key(job_id), dest)
    acc = event_accumulator.EventAccumulator(str(dest), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return [e.step for e in acc.Scalars("loss")]


def test_trackers_ride_out_a_database_outage_and_are_always_closed(
    mlflow_server: str, make_settings: Any, tmp_path: Path
) -> None:
    """The tracker thread survives Postgres going away: one warning event, no metric row lost, the MLflow
    run ended and the TensorBoard files published (to a remote store, fenced by the attempt)."""
    from mlflow import MlflowClient
    from sqlalchemy import select

    from service.artifacts import ArtifactStore
    from service.crud import jobstate
    from service.db.migrate import upgrade
    from service.db.models import JobEvent
    from service.db.session import dispose_engines, session_factory
    from tests.fixtures.pg_cluster import PrivatePostgres, postgres_bindir
    from worker.attempt import AttemptContext
    from worker.trackers import JobTrackers

    bindir = postgres_bindir()
    if bindir is None:
        pytest.skip("no Postgres server binaries (initdb, pg_ctl) on this machine")
    pg = PrivatePostgres(bindir)
    try:
        upgrade(pg.url)
        settings = make_settings(
            database_url=pg.url, db_outage_tolerance_s=1.0, mlflow_tracking_uri=mlflow_server
        )
        sessions = session_factory(pg.url)
        store = ArtifactStore(f"memory://trackers-{uuid.uuid4().hex[:8]}")  # remote: files are published
        job_id, project_id, spec = _claimed_job(sessions, ["tensorboard", "mlflow"])
        last = _log_steps(sessions, job_id, range(1, 6))
        trackers = JobTrackers(
            settings, AttemptContext(sessions, job_id, 1), store, project_id, spec, poll_s=0.2
        ).start()
        wait_until(
            lambda: trackers._cursor == last, message="the first rows forwarded", timeout=120, interval=0.1
        )

        pg.stop()
        wait_until(
            lambda: trackers._warned_db,
            message="the outage to outlast the retries",
            timeout=120,
            interval=0.1,
        )
        assert trackers._thread.is_alive()
        pg.start()
        last = _log_steps(sessions, job_id, range(6, 11))
        wait_until(
            lambda: trackers._cursor == last and not trackers._pending,
            message="the thread to catch up",
            timeout=120,
            interval=0.1,
        )
        with sessions() as s:
            assert jobstate.transition(s, job_id, "succeeded", expect=("running",), fence=1, event="done")
        trackers.finish()
        assert not trackers._thread.is_alive()

        with sessions() as s:
            warnings = s.scalars(
                select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.level == "warning")
            ).all()
        assert len(warnings) == 1, [w.message for w in warnings]
        assert warnings[0].data["action"] == "metrics" and "database" in warnings[0].message
        ml = MlflowClient(tracking_uri=mlflow_server)
        experiment = ml.get_experiment_by_name("peagle")
        (run,) = ml.search_runs(
            [experiment.experiment_id], filter_string=f"tags.`peagle.job_id` = '{job_id}'"
        )
        assert run.info.status == "FINISHED"
        assert sorted(m.step for m in ml.get_metric_history(run.info.run_id, "loss")) == list(range(1, 11))
        assert _tensorboard_steps(store, job_id, tmp_path / "tb") == list(range(1, 11))
    finally:
        dispose_engines()
        pg.close()


def test_a_stale_attempts_trackers_write_nothing(
    make_settings: Any, monkeypatch: Any, tmp_path: Path
) -> None:
    """Tracker warnings and the TensorBoard publish are fenced by the attempt: once the job was claimed
    again, the old attempt's trackers close without a trace; the new attempt's land."""
    from sqlalchemy import select

    from service.artifacts import ArtifactStore
    from service.crud import jobstate
    from service.db.models import JobEvent
    from service.db.session import session_factory
    from service.tracking import tensorboard_key
    from worker.attempt import AttemptContext
    from worker.trackers import JobTrackers

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the refused connection fails at once
    settings = make_settings(mlflow_tracking_uri=f"http://127.0.0.1:{free_port()}")
    sessions = session_factory(settings.database_url)
    store = ArtifactStore(f"memory://trackers-{uuid.uuid4().hex[:8]}")
    job_id, project_id, spec = _claimed_job(sessions, ["tensorboard", "mlflow"])
    _log_steps(sessions, job_id, range(1, 4))
    with sessions() as s:  # the reconciler took the job back and another worker claimed it
        assert jobstate.transition(s, job_id, "queued", expect=("running",), fence=1, event="requeued")
        assert jobstate.claim(s, job_id, "other-worker")
        s.commit()

    def run(attempt: int) -> list[Any]:
        trackers = JobTrackers(
            settings, AttemptContext(sessions, job_id, attempt), store, project_id, spec, poll_s=0.1
        )
        trackers.start().finish()
        with sessions() as s:
            return list(
                s.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.level == "warning"))
            )

    assert run(1) == [] and store.list_files(tensorboard_key(job_id)) == []
    (warning,) = run(2)  # the owner's failure is reported, its files published
    assert warning.data == {"tracker": "mlflow", "action": "start", "error": warning.data["error"]}
    assert store.list_files(tensorboard_key(job_id))
