"""POST /v1/jobs/plan through the real API and a real worker: 202 and a plan to poll, answered by the
worker (through the SDK, as `peagle jobs plan` uses it); rates are stored and reused, nothing is queued, bad
data is a 422 naming the line, and no free worker fails the plan with plan_timeout (never a hang)."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.sdk import ClientError, PeagleClient
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
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "queued" and r.headers["location"] == f"/v1/plans/{r.json()['id']}"
    sdk = PeagleClient(str(client.base_url), None, http=client)
    answered = sdk.get_plan(r.json()["id"], wait=60)
    while answered["status"] not in ("succeeded", "failed"):
        answered = sdk.get_plan(r.json()["id"], wait=60)
    assert answered["status"] == "succeeded", answered
    plan = answered["result"]
    assert plan["estimates_from"] == "calibration"
    assert plan["counts"]["samples"] == 16 and plan["optimizer_steps"] == 3
    assert set(plan["stages_s"]) == {"regenerate", "hidden_states", "train", "eval"}
    assert plan["stages_s"]["regenerate"] == 0 and plan["stages_s"]["train"] > 0
    assert set(plan["cache"]["by_dtype"]) == {"bf16", "fp8", "fp32"}
    assert plan["cache"]["free_bytes"] > 0

    again = sdk.plan_job(spec)
    assert again["estimates_from"] == "stored" and again["stages_s"] == plan["stages_s"]
    assert client.get("/v1/jobs").json()["data"] == []  # planning created no job

    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')  # no assistant turn
    with pytest.raises(ClientError) as bad:
        sdk.plan_job(spec)
    assert bad.value.status == 422 and bad.value.param == "line 1" and "assistant" in bad.value.message


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
        assert r.status_code == 202, r.text
        plan = client.get(f"/v1/plans/{r.json()['id']}", params={"wait": 30}).json()
    assert plan["status"] == "failed" and plan["error"]["code"] == "plan_timeout", plan
    assert Queue("nobody-listens", connection=stack.redis).count == 0  # the unanswered request is withdrawn
    assert plan["error"]["message"].startswith("no worker of queue 'nobody-listens'")
