"""An EAGLE-3 job through the API: `model.method: eagle3` is trained with training-time test, evaluated by
us and by vLLM, passes the publish gate and is published as speculators' eagle3 type, its serving
recommendation naming the method on the API, the job page and the CLI; bad EAGLE-3 input is a 422 naming
the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.worker.conftest import VLLM_ON, Stack, toy_spec


@pytest.fixture
def api(stack: Stack) -> Iterator[tuple[Any, dict[str, str]]]:
    """The stack's API in this process and a key of the stack's project."""
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.crud.projects import create_key
    from service.db.models import Project

    with stack.sessions() as s:
        key, _ = create_key(s, s.get(Project, stack.project_id).name)
    with TestClient(create_app(stack.settings), base_url="http://localhost") as client:
        yield client, {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("model", "param"),
    [
        ({"ttt_steps": 2}, "model.ttt_steps"),  # EAGLE-3's field on a P-EAGLE job
        ({"method": "eagle3", "ttt_steps": 0}, "model.ttt_steps"),
        ({"method": "eagle3", "ttt_steps": 33}, "model.ttt_steps"),
        ({"method": "eagle3", "down_sample_ratio": 0.5}, "model.down_sample_ratio"),  # P-EAGLE's on EAGLE-3
    ],
)
def test_bad_eagle3_input_is_a_422_naming_the_field(
    api, toy_verifier_dir: Path, toy_dataset_path: Path, model: dict, param: str
) -> None:
    client, auth = api
    spec = toy_spec(toy_verifier_dir, toy_dataset_path, model=model)
    r = client.post("/v1/jobs", json={"spec": spec}, headers=auth)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == f"spec.{param}" and param in error["message"]
    assert client.get("/v1/jobs", headers=auth).json()["data"] == []  # nothing was stored


def test_an_eagle3_job_through_the_api_is_published_and_served_without_parallel_drafting(
    stack: Stack, api, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    from typer.testing import CliRunner

    from cli import build_app
    from peagle_core.serving.recommendation import ServingRecommendation
    from tests.fixtures.stack import serve_app
    from tests.service.ui.test_ui import sign_in

    client, auth = api
    evaluation = {
        **VLLM_ON["evaluation"],
        "measure_speedup": True,
        "speedup_batch_sizes": [1],
        "speedup_rounds": 1,  # one paired round: what the recommendation shows is what this test checks
    }
    spec = toy_spec(
        toy_verifier_dir,
        toy_dataset_path,
        model={"method": "eagle3", "ttt_steps": 2},
        evaluation=evaluation,
        export=VLLM_ON["export"],
    )
    r = client.post("/v1/jobs", json={"spec": spec}, headers=auth)
    assert r.status_code in (200, 201), r.text
    job_id = r.json()["id"]
    assert r.json()["spec"]["model"]["method"] == "eagle3"
    stack.run_burst()
    job = stack.job(job_id)
    assert job.status == "succeeded", (job.error, [e.message for e in stack.events(job_id)])

    metrics = stack.metrics(job_id)
    assert any("acc_1" in m for m in metrics) and not any("acc_2" in m for m in metrics)  # ttt_steps: 2
    (ckpt,) = stack.checkpoints(job_id)
    assert ckpt.servable == "verified"  # vLLM loaded it, lossless, its AL above our floor
    serving = ckpt.metrics["eval"]["serving"]
    result = ckpt.metrics["eval"]["results"]["k=2"]
    assert serving["ours_acceptance_length"] == result["acceptance_length"]

    from service.artifacts import ArtifactStore

    store = ArtifactStore(stack.settings.artifact_root)
    cfg = json.loads(b"".join(store.iter_range(f"{ckpt.uri}/config.json")))
    assert cfg["speculators_model_type"] == "eagle3" and "mask_token_id" not in cfg

    rec = ServingRecommendation.of(serving)
    assert rec is not None and rec.method == "eagle3"
    sentence = rec.sentence()
    assert "EAGLE-3 drafter" in sentence
    got = client.get(f"/v1/jobs/{job_id}", headers=auth).json()
    assert got["progress"]["recommendation"]["method"] == "eagle3"
    assert got["progress"]["recommendation"]["sentence"] == sentence
    sign_in(client, auth["Authorization"].removeprefix("Bearer "))
    page = client.get(f"/ui/jobs/{job_id}/panel?part=details").text
    assert f"How to serve it: <strong>{sentence}</strong>" in page and 'data-method="eagle3"' in page
    assert "parallel_drafting" not in page  # the serve command, for an EAGLE-3 drafter
    with serve_app(client.app) as url:
        out = CliRunner().invoke(
            build_app(),
            ["jobs", "logs", job_id, "--follow", "--url", url, "--key", auth["Authorization"][7:]],
        )
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines()[-1] == f"measured in vLLM: {sentence}"
