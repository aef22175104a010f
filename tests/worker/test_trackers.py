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
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.archives import extract_archive
from tests.fixtures.servers import free_port, wait_until_healthy
from tests.worker.conftest import Stack, toy_spec

pytest.importorskip("mlflow", reason="the trackers extra is not installed")


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
