"""Per-project limits set with `peagle projects set`: queues (403), running jobs (429), storage (403), each
naming the limit; SSE streams capped per key and ended when the key is revoked."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from service.crud.limits import set_limits
from service.db.models import Project
from service.db.session import session_factory
from tests.fixtures.stack import new_key

ROW = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})


@pytest.fixture
def project(client, auth, db_url) -> Iterator[str]:
    """The name of `auth`'s project."""
    from service.crud.projects import project_for_key

    with session_factory(db_url)() as s:
        yield project_for_key(s, auth["Authorization"].split()[1]).name


def _limits(db_url: str, name: str, **limits: object) -> None:
    with session_factory(db_url)() as s:
        set_limits(s, s.query(Project).filter_by(name=name).one(), **limits)
        s.commit()


def test_queues_and_running_jobs_are_limited_per_project(
    client, auth, other_auth, spec, project, db_url, monkeypatch
) -> None:
    from cli import build_app
    from service.settings import get_settings

    monkeypatch.setenv("PEAGLE_DATABASE_URL", db_url)
    get_settings.cache_clear()
    try:
        cmd = ["projects", "set", project, "--queues", "gpu-a,gpu-b", "--max-running-jobs", "1"]
        result = CliRunner().invoke(build_app(), cmd)
        assert result.exit_code == 0, result.output
    finally:
        get_settings.cache_clear()

    r = client.post("/v1/jobs", json={"spec": spec}, headers=auth)  # queue "default"
    assert r.status_code == 403 and r.json()["error"]["code"] == "queue_not_allowed"
    assert "allowed_queues: gpu-a, gpu-b" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "spec.resources.queue"
    on_a = {**spec, "resources": {"queue": "gpu-a"}}
    first = client.post("/v1/jobs", json={"spec": on_a}, headers=auth)
    assert first.status_code == 201, first.text
    r = client.post("/v1/jobs", json={"spec": on_a}, headers=auth)
    assert r.status_code == 429 and "max_running_jobs: 1" in r.json()["error"]["message"]
    assert r.headers["retry-after"]
    assert client.post("/v1/jobs", json={"spec": spec}, headers=other_auth).status_code == 201  # per project
    client.post(f"/v1/jobs/{first.json()['id']}/cancel", headers=auth)
    assert client.post("/v1/jobs", json={"spec": on_a}, headers=auth).status_code == 201


def test_storage_cap(client, auth, spec, project, db_url) -> None:
    data = (ROW + "\n").encode()
    _limits(db_url, project, storage_cap_bytes=len(data) * 2 + 10)
    for _ in range(2):
        r = client.post("/v1/datasets", files={"file": ("d.jsonl", data)}, headers=auth)
        assert r.status_code == 201, r.text
    r = client.post("/v1/datasets", files={"file": ("d.jsonl", data)}, headers=auth)
    assert r.status_code == 403 and r.json()["error"]["code"] == "storage_quota_exceeded"
    assert "storage_cap_bytes" in r.json()["error"]["message"]
    _limits(db_url, project, storage_cap_bytes=len(data) * 2)  # full: no new job either
    r = client.post("/v1/jobs", json={"spec": spec}, headers=auth)
    assert r.status_code == 403 and "storage_cap_bytes" in r.json()["error"]["message"]
    _limits(db_url, project, storage_cap_bytes=None)
    assert client.post("/v1/jobs", json={"spec": spec}, headers=auth).status_code == 201


def test_event_streams_are_capped_per_key_and_end_on_revocation(
    make_settings, db_url, spec, redis_conn
) -> None:
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.crud.projects import list_keys, revoke_key

    key = new_key(db_url)
    auth = {"Authorization": f"Bearer {key}"}
    sse = {**auth, "Accept": "text/event-stream"}
    with TestClient(create_app(make_settings(max_streams_per_key=1, events_poll_s=0.05))) as c:
        job = c.post("/v1/jobs", json={"spec": spec}, headers=auth).json()
        with c.stream("GET", f"/v1/jobs/{job['id']}/events", headers=sse) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("id: ")  # the stream is open
            second = c.get(f"/v1/jobs/{job['id']}/events", headers=sse)
            assert (
                second.status_code == 429
                and "PEAGLE_MAX_STREAMS_PER_KEY: 1" in second.json()["error"]["message"]
            )
            with session_factory(db_url)() as s:
                (row,) = [k for k, _ in list_keys(s) if key.startswith(k.prefix) and k.revoked_at is None][:1]
                revoke_key(s, row.id)
                s.commit()
            rest = list(lines)  # ends by itself, although the job is still queued
        assert "event: end" in rest and any("api key revoked" in line for line in rest)
        assert c.get(f"/v1/jobs/{job['id']}", headers=auth).status_code == 401


def test_an_event_stream_gives_the_request_session_back(app, db_url) -> None:
    """Under uvicorn the request's session is closed only when the response ends; a stream that kept its
    transaction would hold a pooled connection (idle in transaction) for as long as it stays open."""
    from starlette.requests import Request

    from service.api.routes.jobs import EventsQuery, events_answer
    from service.crud.jobs import create_job_row
    from service.crud.projects import create_key
    from service.db.models import Project

    with app.state.sessions() as db:
        _, key = create_key(db, "one-stream")
        job_id = create_job_row(db, key.project_id, {}, max_attempts=1).id
        db.commit()
        request = Request(
            {"type": "http", "headers": [(b"accept", b"text/event-stream")], "app": app, "state": {}}
        )
        request.state.key_hash = key.key_hash
        query = EventsQuery(project=db.get(Project, key.project_id), job_id=job_id)
        answer = events_answer(
            query, request=request, db=db, sessions=app.state.sessions, settings=app.state.settings
        )
        assert answer.media_type == "text/event-stream"
        assert not db.in_transaction()  # its connection is back in the pool while the stream runs
