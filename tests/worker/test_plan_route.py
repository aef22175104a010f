"""POST /v1/jobs/plan through the real API and a real worker: the plan comes back, rates are stored and
reused, nothing is queued, bad data is a 422, and no free worker is a 503 (not a hang)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.worker.conftest import Stack, toy_spec


@pytest.fixture
def api(stack: Stack, toy_verifier_dir: Path, tmp_path: Path):
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.crud.projects import create_key

    settings = stack.settings.model_copy(
        update={
            "allowed_model_roots": [toy_verifier_dir.parent],
            "allowed_data_roots": [tmp_path],
            "plan_timeout_s": 300.0,
        }
    )
    with stack.sessions() as s:
        key, _ = create_key(s, "plan-tests")
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        yield client, settings


def test_a_worker_plans_the_job_and_nothing_is_queued(
    api, stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path
) -> None:
    client, _ = api
    data = tmp_path / "chat.jsonl"
    data.write_bytes(toy_dataset_path.read_bytes())
    spec = toy_spec(
        toy_verifier_dir,
        data,
        dataset={"max_samples": 16},
        training={"max_steps": 3},
    )
    stack.worker()
    r = client.post("/v1/jobs/plan", json={"spec": spec})
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["estimates_from"] == "calibration"
    assert plan["counts"]["samples"] == 16 and plan["optimizer_steps"] == 3
    assert set(plan["stages_s"]) == {"regenerate", "hidden_states", "train", "eval"}
    assert plan["stages_s"]["regenerate"] == 0 and plan["stages_s"]["train"] > 0
    assert set(plan["cache"]["by_dtype"]) == {"bf16", "fp8", "fp32"}
    assert plan["cache"]["free_bytes"] > 0

    again = client.post("/v1/jobs/plan", json={"spec": spec}).json()
    assert again["estimates_from"] == "stored" and again["stages_s"] == plan["stages_s"]
    assert client.get("/v1/jobs").json()["data"] == []  # planning created no job

    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')  # no assistant turn
    bad = client.post("/v1/jobs/plan", json={"spec": spec})
    assert bad.status_code == 422, bad.text
    assert bad.json()["error"]["param"] == "line 1" and "assistant" in bad.json()["error"]["message"]


def test_no_free_worker_is_a_503_not_a_hang(
    api, stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient
    from rq import Queue

    from service.app import create_app

    _, settings = api
    data = tmp_path / "chat.jsonl"
    data.write_bytes(toy_dataset_path.read_bytes())
    spec = toy_spec(toy_verifier_dir, data, resources={"queue": "nobody-listens"})
    short = settings.model_copy(update={"plan_timeout_s": 1.0})
    with TestClient(create_app(short), raise_server_exceptions=False) as client:
        client.headers.update(api[0].headers)
        r = client.post("/v1/jobs/plan", json={"spec": spec})
    assert r.status_code == 503 and r.json()["error"]["code"] == "plan_timeout", r.text
    assert Queue("nobody-listens", connection=stack.redis).count == 0  # the unanswered request is withdrawn
    assert json.loads(r.text)["error"]["message"].startswith("no worker of queue 'nobody-listens'")
