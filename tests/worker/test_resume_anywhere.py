"""Resume on any machine: a job whose worker was SIGKILLed (worker and horse) resumes on another worker with an
empty scratch directory, from the training checkpoint mirrored to an S3 artifact store (a moto server over
real HTTP). This is also the suite's SIGKILL-and-resume test."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from service.artifacts import ArtifactStore
from tests.fixtures.servers import free_port
from tests.worker.conftest import Stack, toy_spec


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """A moto S3 server on a free port, configured through the standard AWS variables (which the worker
    subprocesses inherit), and a fresh bucket."""
    moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (the [dev] extras)")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ArtifactStore("s3://peagle-resume").fs.mkdir("peagle-resume")
    try:
        yield env
    finally:
        server.stop()


def test_a_second_worker_resumes_from_the_mirrored_checkpoint(
    make_settings: Any,
    isolated_db_url: str,
    redis_conn: Any,
    s3_env: dict[str, str],
    toy_verifier_dir: Path,
    toy_dataset_path: Path,
    tmp_path: Path,
) -> None:
    from worker.reconcile import reconcile_once

    settings = make_settings(
        database_url=isolated_db_url, artifact_root="s3://peagle-resume/root", worker_heartbeat_s=1.0
    )
    stack = Stack(settings, redis_conn, tmp_path)
    stack.env.update(s3_env)
    try:
        spec = toy_spec(
            toy_verifier_dir,
            toy_dataset_path,
            # Long enough (the toy trains ~15 steps/s) that the kill lands mid-training.
            training={"max_steps": 150, "checkpoint_every_steps": 5, "epochs": 50},
            evaluation={"prompts": 1},
        )
        job_id = stack.submit(spec)

        # Machine A: its own scratch; killed (worker and horse, SIGKILL) once a checkpoint is mirrored.
        stack.env["PEAGLE_DATA_DIR"] = str(tmp_path / "machine-a")
        first = stack.worker(log_name="machine-a")
        stack.wait_for(
            "a mirrored checkpoint", lambda: (stack.job(job_id).resume_step or 0) >= 2, timeout=300
        )
        for p in [*psutil.Process(first.pid).children(recursive=True), psutil.Process(first.pid)]:
            os.kill(p.pid, signal.SIGKILL)
        first.wait()
        stack.procs.remove(first)
        job = stack.job(job_id)
        saved = job.resume_step
        assert saved < 150, "the first worker finished before it was killed: lengthen the job"
        assert job.resume_uri.startswith(f"jobs/{job_id}/checkpoints/a1/")
        assert ArtifactStore(settings.artifact_root).exists(f"{job.resume_uri}/model.safetensors")

        requeued = stack.wait_for(
            "the reconciler to notice the dead worker",
            lambda: reconcile_once(settings, redis=redis_conn, min_queued_age_s=0).requeued,
            timeout=60,
            every=1.0,
        )
        assert requeued == [job_id]

        # Machine B: an empty scratch directory of its own; only the store connects it to machine A.
        stack.env["PEAGLE_DATA_DIR"] = str(tmp_path / "machine-b")
        stack.run_burst()
    finally:
        stack.stop_all()

    job = stack.job(job_id)
    assert job.status == "succeeded", job.error
    assert job.attempt == 2
    resumed = [e.data["resume_step"] for e in stack.events(job_id) if e.data and "resume_step" in e.data]
    assert resumed[-1] == saved >= 2  # from the mirror, not from step 0
    second = [m["step"] for m in stack.metrics(job_id) if m.get("attempt") == 2 and "loss" in m]
    assert min(second) == saved + 1 and max(second) == 150
    (ckpt,) = stack.checkpoints(job_id)
    assert ArtifactStore(settings.artifact_root).verify_files(ckpt.uri, ckpt.files) == []
    # Each machine's scratch is its own; B's attempt directory is cleaned up after the job.
    assert not list((tmp_path / "machine-b" / "scratch" / "jobs" / job_id).glob("attempt-*"))
