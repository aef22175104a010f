"""`model.init_from` through the API and a real worker: the job runs the spec its user wrote, so a field
left unset takes the checkpoint's value, whatever that field's default is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peagle_core.pipeline.stages import run_pipeline
from peagle_core.spec import JobSpec
from tests.worker.conftest import Stack, toy_spec


def test_a_job_fine_tunes_from_a_checkpoint_unlike_the_defaults(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.crud.projects import create_key

    # A drafter unlike every architecture default: 1 layer (default 4), a 256-token draft vocabulary
    # (default 32,000).
    base = toy_spec(toy_verifier_dir, toy_dataset_path, training={"max_steps": 2})
    first = run_pipeline(JobSpec.model_validate(base), tmp_path / "ckpt", resume=False)
    assert first.status == "completed" and first.export_dir is not None

    spec: dict[str, Any] = {k: v for k, v in base.items() if k != "model"}
    spec["model"] = {"init_from": str(first.export_dir), "num_depths": 2}
    with stack.sessions() as s:
        key, _ = create_key(s, "init-from-tests")
    with TestClient(create_app(stack.settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        r = client.post("/v1/jobs", json={"spec": spec})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        stack.run_burst()
        job = client.get(f"/v1/jobs/{job_id}").json()

    assert job["status"] == "succeeded", (job["error"], [e.message for e in stack.events(job_id)])
    # Shown: the resolved spec (defaults filled in) and, apart, what the user sent and the worker ran.
    assert job["spec"]["model"]["num_layers"] == 4 and job["spec"]["model"]["draft_vocab_size"] == 32000
    assert job["spec_submitted"]["model"] == spec["model"]
    (ckpt,) = stack.checkpoints(job_id)
    from peagle_core.model.speculators import read_checkpoint
    from service.artifacts import ArtifactStore

    published = ArtifactStore(stack.settings.artifact_root).local_path(ckpt.uri)
    config, _ = read_checkpoint(published)
    assert config.num_layers == 1 and config.draft_vocab_size == 256
