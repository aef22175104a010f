"""The worker re-checks server paths and trust_remote_code against its own current settings: a job the API
accepted under wider settings fails with a message naming the field, before any data is read."""

from __future__ import annotations

from pathlib import Path

from service.db.models import Job
from tests.worker.conftest import Stack, toy_spec
from worker.runner import JobRunner


def test_narrowed_settings_fail_the_job_before_it_reads_anything(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path
) -> None:
    narrowed = stack.settings.model_copy(update={"allowed_data_roots": [tmp_path / "elsewhere"]})
    job_id = stack.submit(toy_spec(toy_verifier_dir, toy_dataset_path), enqueue=False)
    assert JobRunner(narrowed, job_id, "w1").run() == "failed"
    with stack.sessions() as s:
        job = s.get(Job, job_id)
        assert job.error["code"] == "invalid_spec"
        assert "dataset.path" in job.error["message"] and "outside the allowed roots" in job.error["message"]
        assert job.progress is None or job.progress.get("stage") in (None, "claim", "prepare")

    remote_code = toy_spec(toy_verifier_dir, toy_dataset_path, verifier={"trust_remote_code": True})
    job_id = stack.submit(remote_code, enqueue=False)
    assert JobRunner(stack.settings, job_id, "w1").run() == "failed"
    with stack.sessions() as s:
        assert "trust_remote_code is disabled" in s.get(Job, job_id).error["message"]
