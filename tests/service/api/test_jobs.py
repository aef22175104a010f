"""POST/GET /v1/jobs, cancel, events (JSON and SSE), metrics, checkpoints list."""

from __future__ import annotations

import json
import threading
from typing import Any

from rq import Queue
from sqlalchemy import select

from service.crud import jobstate
from service.crud.events import add_event
from service.crud.metrics import add_metrics
from service.db.models import Job
from service.db.session import session_factory
from tests.fixtures.race import at_once
from tests.fixtures.wait import DEFAULT_TIMEOUT_S
from tests.service.conftest import create_job


def test_create_returns_resolved_spec_and_enqueues(client, auth, spec, settings, redis_conn) -> None:
    job = create_job(client, auth, spec)
    assert job["id"].startswith("job_") and job["status"] == "queued" and job["attempt"] == 0
    assert job["spec"]["training"]["lr"] == 6e-4  # a default, filled in
    assert job["spec"]["dataset"]["seq_len"] == 64
    queue = Queue("default", connection=redis_conn)
    assert job["id"] in queue.job_ids
    rq_job = queue.fetch_job(job["id"])
    assert rq_job.func_name == "worker.tasks.run_job" and rq_job.args == (job["id"],)
    assert rq_job.timeout == settings.job_timeout_s
    got = client.get(f"/v1/jobs/{job['id']}", headers=auth).json()
    assert got["spec"] == job["spec"] and got["queued_at"] is not None
    # Apart from the resolved spec, the spec as sent: what the worker runs (unset fields stay unset).
    assert got["spec_submitted"] == job["spec_submitted"] == spec
    with session_factory(settings.database_url)() as s:
        assert s.get(Job, job["id"]).spec_submitted == spec


def test_invalid_spec_names_the_field(client, auth, spec) -> None:
    spec["training"]["lr"] = -1
    r = client.post("/v1/jobs", json={"spec": spec}, headers=auth)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["param"] == "spec.training.lr" and err["type"] == "invalid_request_error"
    spec["training"]["lr"] = 1e-3
    r = client.post("/v1/jobs", json={"spec": {**spec, "bogus": 1}}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "spec.bogus"


def test_server_paths_must_be_under_allowed_roots(client, auth, spec, tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.jsonl").write_text("{}\n")
    root = spec["dataset"]["path"].rsplit("/", 1)[0]
    link = tmp_path / "data-root" / "escape"
    link.symlink_to(outside)
    cases = [
        ("spec.verifier.name_or_path", {**spec, "verifier": {"name_or_path": str(outside)}}),
        ("spec.verifier.name_or_path", {**spec, "verifier": {"name_or_path": "relative/../dir/x"}}),
        ("spec.dataset.path", {**spec, "dataset": {**spec["dataset"], "path": str(outside / "x.jsonl")}}),
        # `..` and a symlink pointing out of the root are resolved before the check.
        ("spec.dataset.path", {**spec, "dataset": {**spec["dataset"], "path": str(link / "x.jsonl")}}),
        (
            "spec.hidden_states.cache_uri",
            {**spec, "hidden_states": {"cache_uri": f"{root}/../outside/cache"}},
        ),
        ("spec.dataset.path", {**spec, "dataset": {**spec["dataset"], "path": f"{root}/missing.jsonl"}}),
        ("spec.model.init_from", {**spec, "model": {"init_from": str(outside)}}),
    ]
    for param, bad in cases:
        r = client.post("/v1/jobs", json={"spec": bad}, headers=auth)
        assert r.status_code == 422, (param, r.text)
        assert r.json()["error"]["param"] == param
    inside = {**spec, "model": {"init_from": spec["verifier"]["name_or_path"]}}
    assert client.post("/v1/jobs", json={"spec": inside}, headers=auth).status_code == 201


def test_hub_ids_and_remote_code_need_operator_opt_in(client, auth, spec, make_settings) -> None:
    hub = {**spec, "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B"}}
    r = client.post("/v1/jobs", json={"spec": hub}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "spec.verifier.name_or_path"
    remote = {**spec, "verifier": {**spec["verifier"], "trust_remote_code": True}}
    r = client.post("/v1/jobs", json={"spec": remote}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "spec.verifier.trust_remote_code"

    from fastapi.testclient import TestClient

    from service.app import create_app

    with TestClient(create_app(make_settings(allow_hub=True, allow_trust_remote_code=True))) as open_client:
        assert open_client.post("/v1/jobs", json={"spec": hub}, headers=auth).status_code == 201
        assert open_client.post("/v1/jobs", json={"spec": remote}, headers=auth).status_code == 201


def test_unknown_dataset_id_is_422(client, auth, spec) -> None:
    bad = {**spec, "dataset": {"id": "ds_nope", "seq_len": 64}}
    r = client.post("/v1/jobs", json={"spec": bad}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "spec.dataset.id"


def test_idempotency_replay_and_conflict(client, auth, other_auth, spec) -> None:
    first = client.post("/v1/jobs", json={"spec": spec}, headers={**auth, "Idempotency-Key": "k1"})
    assert first.status_code == 201 and "Idempotent-Replayed" not in first.headers
    # Same body, keys reordered: the same request.
    again = client.post(
        "/v1/jobs",
        content=json.dumps({"spec": dict(reversed(spec.items()))}),
        headers={**auth, "Idempotency-Key": "k1", "Content-Type": "application/json"},
    )
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    other = {**spec, "training": {**spec["training"], "lr": 1e-4}}
    conflict = client.post("/v1/jobs", json={"spec": other}, headers={**auth, "Idempotency-Key": "k1"})
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "idempotency_key_reused"
    # Keys are scoped per project: another project's k1 is a new job.
    theirs = client.post("/v1/jobs", json={"spec": spec}, headers={**other_auth, "Idempotency-Key": "k1"})
    assert theirs.status_code == 201 and theirs.json()["id"] != first.json()["id"]
    listed = client.get("/v1/jobs", headers=auth).json()["data"]
    assert [j["id"] for j in listed] == [first.json()["id"]]


def test_concurrent_idempotent_posts_create_one_job(client, auth, spec) -> None:
    def post() -> Any:
        return client.post("/v1/jobs", json={"spec": spec}, headers={**auth, "Idempotency-Key": "race"})

    answers = at_once([post] * 4)
    assert sorted(r.status_code for r in answers) == [200, 200, 200, 201]
    assert len({r.json()["id"] for r in answers}) == 1


def test_pagination_no_duplicates_or_gaps_under_inserts(client, auth, spec) -> None:
    initial = [create_job(client, auth, spec)["id"] for _ in range(7)]
    seen: list[str] = []
    inserted: list[str] = []
    after = None
    while True:
        params = {"limit": 3, **({"after": after} if after else {})}
        page = client.get("/v1/jobs", params=params, headers=auth).json()
        seen += [j["id"] for j in page["data"]]
        # A new job arrives between page fetches: it is newer than the cursor, so it never shifts pages.
        inserted.append(create_job(client, auth, spec)["id"])
        if not page["has_more"]:
            assert "next_cursor" not in page or page["next_cursor"] is None
            break
        after = page["next_cursor"]
    assert seen == list(reversed(initial))
    first_page = client.get("/v1/jobs", params={"limit": 100}, headers=auth).json()["data"]
    assert [j["id"] for j in first_page] == list(reversed(initial + inserted))


def test_status_filter_and_bad_cursor(client, auth, spec, db_url) -> None:
    a, b = create_job(client, auth, spec)["id"], create_job(client, auth, spec)["id"]
    with session_factory(db_url)() as s:
        assert jobstate.transition(s, a, "running")
    running = client.get("/v1/jobs", params={"status": "running"}, headers=auth).json()["data"]
    assert [j["id"] for j in running] == [a]
    queued = client.get("/v1/jobs", params={"status": "queued"}, headers=auth).json()["data"]
    assert [j["id"] for j in queued] == [b]
    assert client.get("/v1/jobs", params={"status": "nope"}, headers=auth).status_code == 422
    r = client.get("/v1/jobs", params={"after": "job_missing"}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "after"
    assert client.get("/v1/jobs", params={"limit": 101}, headers=auth).json()["error"]["param"] == "limit"


def test_cancel_queued_running_and_terminal(client, auth, spec, db_url, redis_conn) -> None:
    queued = create_job(client, auth, spec)
    r = client.post(f"/v1/jobs/{queued['id']}/cancel", headers=auth)
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["finished_at"]
    assert queued["id"] not in Queue("default", connection=redis_conn).job_ids

    running = create_job(client, auth, spec)
    with session_factory(db_url)() as s:
        assert jobstate.transition(s, running["id"], "running")
    r = client.post(f"/v1/jobs/{running['id']}/cancel", headers=auth)
    assert r.json()["status"] == "cancelling" and r.json()["cancel_requested_at"]
    assert client.post(f"/v1/jobs/{running['id']}/cancel", headers=auth).json()["status"] == "cancelling"

    r = client.post(f"/v1/jobs/{queued['id']}/cancel", headers=auth)
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_finished"


def _seed_events(db_url: str, job_id: str, n: int) -> None:
    with session_factory(db_url)() as s:
        for i in range(n):
            add_event(s, job_id, "log", f"line {i}")
        s.commit()


def test_events_pages(client, auth, spec, db_url) -> None:
    job = create_job(client, auth, spec)
    _seed_events(db_url, job["id"], 5)
    got, after = [], None
    while True:
        page = client.get(
            f"/v1/jobs/{job['id']}/events",
            params={"limit": 2, **({"after": after} if after else {})},
            headers=auth,
        ).json()
        got += page["data"]
        if not page["has_more"]:
            break
        after = page["next_cursor"]
    assert [e["message"] for e in got] == ["job queued"] + [f"line {i}" for i in range(5)]
    assert [e["id"] for e in got] == sorted({e["id"] for e in got})


def _read_sse(response) -> list[dict[str, Any]]:
    events, current = [], {}
    for line in response.iter_lines():
        if not line:
            if current:
                events.append(current)
            current = {}
            continue
        field, _, value = line.partition(": ")
        current[field] = value
    return events


def test_events_sse_follows_until_terminal(client, auth, spec, db_url) -> None:
    job = create_job(client, auth, spec)
    _seed_events(db_url, job["id"], 2)
    done = threading.Event()

    def finish_later() -> None:
        # Runs once the stream has delivered its first event, so the rest arrive while following.
        done.wait(30)
        _seed_events(db_url, job["id"], 1)
        with session_factory(db_url)() as s:
            jobstate.transition(s, job["id"], "running")
            jobstate.transition(s, job["id"], "succeeded")

    worker = threading.Thread(target=finish_later)
    worker.start()
    received = []
    with client.stream(
        "GET", f"/v1/jobs/{job['id']}/events", headers={**auth, "Accept": "text/event-stream"}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        block: dict[str, str] = {}
        for line in r.iter_lines():
            if line:
                k, _, v = line.partition(": ")
                block[k] = v
                continue
            received.append(block)
            block = {}
            done.set()
    worker.join(DEFAULT_TIMEOUT_S)
    assert not worker.is_alive(), "the job never finished"
    kinds = [b.get("event") for b in received]
    assert kinds[-1] == "end" and json.loads(received[-1]["data"])["status"] == "succeeded"
    messages = [json.loads(b["data"])["message"] for b in received[:-1]]
    assert messages[:3] == ["job queued", "line 0", "line 1"] and "line 0" in messages
    assert [json.loads(b["data"])["data"]["status"] for b in received if b.get("event") == "status"][
        -1
    ] == "succeeded"
    # Last-Event-ID resumes after the given event.
    ids = [int(b["id"]) for b in received if "id" in b]
    with client.stream(
        "GET",
        f"/v1/jobs/{job['id']}/events",
        headers={**auth, "Accept": "text/event-stream", "Last-Event-ID": str(ids[1])},
    ) as r:
        resumed = [int(b["id"]) for b in _read_sse(r) if "id" in b]
    assert resumed == ids[2:]


def test_metrics_series(client, auth, spec, db_url) -> None:
    job = create_job(client, auth, spec)
    with session_factory(db_url)() as s:
        for step in range(1, 4):
            add_metrics(s, job["id"], step, {"loss": 1.0 / step, "acc_0": 0.1 * step, "lr": 1e-4})
        add_metrics(s, job["id"], 3, {"eval/acceptance_length@4": 2.5})
        s.commit()
    page = client.get(f"/v1/jobs/{job['id']}/metrics", params={"limit": 3}, headers=auth).json()
    assert [m["step"] for m in page["data"]] == [1, 2, 3] and page["has_more"]
    rest = client.get(
        f"/v1/jobs/{job['id']}/metrics", params={"after": page["next_cursor"]}, headers=auth
    ).json()
    assert rest["data"][0]["values"] == {"eval/acceptance_length@4": 2.5} and not rest["has_more"]


def test_redis_down_leaves_job_queued(make_settings, auth, spec) -> None:
    from fastapi.testclient import TestClient

    from service.app import create_app

    settings = make_settings(redis_url="unix:///nonexistent/redis.sock?db=0")
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/jobs", json={"spec": spec}, headers=auth)
        assert r.status_code == 201 and r.json()["status"] == "queued"
    with session_factory(settings.database_url)() as s:
        job = s.scalars(select(Job).where(Job.id == r.json()["id"])).one()
        assert job.status == "queued" and job.rq_job_id is None
