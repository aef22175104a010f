"""Every limit holds under concurrency, on SQLite and Postgres: N requests fired at once at a limit (running
jobs, plans per key and per project, storage with declared and with chunked uploads) pass at most the
allowed number; the project lock is a real lock on both databases; configured queues only; and the storage
ledger frees what a DELETE removes."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from service.crud.limits import set_limits, storage_used
from service.crud.locks import lock_project
from service.crud.projects import create_key, project_for_key
from service.db.models import Job, Project, StorageUsage
from service.db.session import session_factory
from tests.fixtures.race import at_once
from tests.fixtures.wait import DEFAULT_TIMEOUT_S, until

N = 12
ROW = json.dumps(
    {"messages": [{"role": "user", "content": "q" * 200}, {"role": "assistant", "content": "a"}]}
)


def fire(n: int, request: Callable[[int], Any]) -> list[int]:
    """Send `n` requests at once; their status codes."""
    return [r.status_code for r in at_once([lambda i=i: request(i) for i in range(n)])]


@pytest.fixture
def api(make_settings, redis_conn) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from service.app import create_app

    # The per-caller cap on writes in flight is lifted here: these tests aim at the limits behind it.
    settings = make_settings(
        max_plans_per_key=3, max_plans_per_project=5, plan_timeout_s=600, max_writes_in_flight_per_caller=100
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.app_settings = settings
        yield client


def _project(db_url: str, key: str) -> Project:
    with session_factory(db_url)() as s:
        project = project_for_key(s, key)
        s.expunge(project)
        return project


def _limits(db_url: str, project_id: str, **limits: object) -> None:
    with session_factory(db_url)() as s:
        set_limits(s, s.get(Project, project_id), **limits)
        s.commit()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_parallel_creates_pass_at_most_max_running_jobs(api, api_key, other_api_key, db_url, spec) -> None:
    project = _project(db_url, api_key)
    _limits(db_url, project.id, max_running_jobs=2)
    codes = fire(N, lambda _: api.post("/v1/jobs", json={"spec": spec}, headers=_bearer(api_key)))
    assert sorted(codes) == [201] * 2 + [429] * (N - 2), codes
    with session_factory(db_url)() as s:
        assert len(s.scalars(select(Job).where(Job.project_id == project.id)).all()) == 2
    # Another project is not held back by this one's limit.
    assert api.post("/v1/jobs", json={"spec": spec}, headers=_bearer(other_api_key)).status_code == 201


def test_parallel_plans_pass_at_most_the_key_and_project_limits(api, api_key, db_url, spec) -> None:
    # No worker serves this queue: every admitted plan stays in flight.
    on_idle = {**spec, "resources": {"queue": "nobody-listens"}}
    project = _project(db_url, api_key)
    with session_factory(db_url)() as s:
        second_key, _ = create_key(s, project.name)  # a second key of the same project

    def plan(key: str) -> Callable[[int], Any]:
        return lambda _: api.post("/v1/jobs/plan", json={"spec": on_idle}, headers=_bearer(key))

    codes = fire(N, plan(api_key))
    assert sorted(codes) == [202] * 3 + [429] * (N - 3), codes  # PEAGLE_MAX_PLANS_PER_KEY: 3
    codes = fire(N, plan(second_key))
    assert sorted(codes) == [202] * 2 + [429] * (N - 2), codes  # PEAGLE_MAX_PLANS_PER_PROJECT: 5
    r = api.post("/v1/jobs/plan", json={"spec": on_idle}, headers=_bearer(second_key))
    assert r.status_code == 429 and "PEAGLE_MAX_PLANS_PER_PROJECT: 5" in r.json()["error"]["message"]


def test_plans_obey_allowed_queues_and_max_running_jobs(api, api_key, other_api_key, db_url, spec) -> None:
    project = _project(db_url, api_key)
    _limits(db_url, project.id, allowed_queues=["gpu-a"], max_running_jobs=1)
    r = api.post("/v1/jobs/plan", json={"spec": spec}, headers=_bearer(api_key))  # queue "default"
    assert r.status_code == 403 and r.json()["error"]["code"] == "queue_not_allowed"
    assert r.json()["error"]["param"] == "spec.resources.queue"
    on_a = {**spec, "resources": {"queue": "gpu-a"}}
    codes = fire(N, lambda _: api.post("/v1/jobs/plan", json={"spec": on_a}, headers=_bearer(api_key)))
    assert sorted(codes) == [202] + [429] * (N - 1), codes
    r = api.post("/v1/jobs/plan", json={"spec": on_a}, headers=_bearer(api_key))
    assert "max_running_jobs: 1" in r.json()["error"]["message"]
    # The plan is a resource of its project only.
    plan_id = next(iter(_plans(db_url, project.id)))
    assert api.get(f"/v1/plans/{plan_id}", headers=_bearer(api_key)).json()["status"] == "queued"
    assert api.get(f"/v1/plans/{plan_id}", headers=_bearer(other_api_key)).status_code == 404


def _plans(db_url: str, project_id: str) -> list[str]:
    from service.db.models import Plan

    with session_factory(db_url)() as s:
        return list(s.scalars(select(Plan.id).where(Plan.project_id == project_id)))


def test_unknown_queues_are_refused_and_never_become_a_metric(api, api_key, spec) -> None:
    made_up = {**spec, "resources": {"queue": f"made-up-{uuid.uuid4().hex[:6]}"}}
    for route in ("/v1/jobs", "/v1/jobs/plan"):
        r = api.post(route, json={"spec": made_up}, headers=_bearer(api_key))
        assert r.status_code == 422 and r.json()["error"]["param"] == "spec.resources.queue", r.text
        assert r.json()["error"]["code"] == "unknown_queue"
    from rq import Queue

    Queue("stray", connection=api.app.state.redis).enqueue_call("os.getpid")  # a queue nobody configured
    metrics = api.get("/metrics").text
    depths = {line.split('"')[1] for line in metrics.splitlines() if line.startswith("peagle_queue_depth{")}
    assert depths == set(api.app_settings.queues)


def _upload_size(api: Any, key: str, body: bytes) -> int:
    return api.post("/v1/datasets", files={"file": ("d.jsonl", body)}, headers=_bearer(key)).status_code


def test_parallel_uploads_pass_at_most_the_storage_cap(api, api_key, db_url) -> None:
    data = ((ROW + "\n") * 40).encode()  # ~10 KiB; multipart framing adds a few hundred bytes
    project = _project(db_url, api_key)
    cap = 3 * len(data) + 2048
    _limits(db_url, project.id, storage_cap_bytes=cap)
    codes = fire(
        N, lambda _: api.post("/v1/datasets", files={"file": ("d.jsonl", data)}, headers=_bearer(api_key))
    )
    assert codes.count(201) <= 3 and codes.count(201) >= 1, codes
    assert set(codes) <= {201, 403}, codes
    with session_factory(db_url)() as s:
        assert storage_used(s, project.id) == codes.count(201) * len(data) <= cap
        kinds = set(s.scalars(select(StorageUsage.kind).where(StorageUsage.project_id == project.id)))
        assert kinds <= {"dataset"}  # every reservation settled or released


def _chunked_multipart(data: bytes) -> tuple[dict[str, str], Iterator[bytes]]:
    boundary = uuid.uuid4().hex
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="d.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()

    def body() -> Iterator[bytes]:  # a generator: sent chunked, no Content-Length
        yield head
        for i in range(0, len(data), 4096):
            yield data[i : i + 4096]
        yield f"\r\n--{boundary}--\r\n".encode()

    return {"Content-Type": f"multipart/form-data; boundary={boundary}"}, body()


def test_parallel_chunked_uploads_pass_at_most_the_storage_cap(api, api_key, db_url) -> None:
    data = ((ROW + "\n") * 40).encode()
    project = _project(db_url, api_key)
    cap = 3 * len(data) + 2048
    _limits(db_url, project.id, storage_cap_bytes=cap)

    def upload(_: int) -> Any:
        headers, body = _chunked_multipart(data)
        return api.post("/v1/datasets", content=body, headers={**_bearer(api_key), **headers})

    codes = fire(N, upload)
    assert 1 <= codes.count(201) <= 3 and set(codes) <= {201, 403}, codes
    with session_factory(db_url)() as s:
        assert storage_used(s, project.id) == codes.count(201) * len(data) <= cap
    # Sequentially each fits while there is room: the reservation is settled to the bytes stored.
    while storage_used_of(db_url, project.id) + len(data) <= cap:
        headers, body = _chunked_multipart(data)
        r = api.post("/v1/datasets", content=body, headers={**_bearer(api_key), **headers})
        assert r.status_code == 201, r.text
    headers, body = _chunked_multipart(data)
    r = api.post("/v1/datasets", content=body, headers={**_bearer(api_key), **headers})
    assert r.status_code == 403 and r.json()["error"]["code"] == "storage_quota_exceeded"


def storage_used_of(db_url: str, project_id: str) -> int:
    with session_factory(db_url)() as s:
        return storage_used(s, project_id)


def test_the_project_lock_is_a_real_lock(db_url, api_key) -> None:
    project = _project(db_url, api_key)
    sessions = session_factory(db_url)
    with sessions() as holder, sessions() as other:
        assert lock_project(holder, project.id) is not None
        if other.bind.dialect.name == "sqlite":
            # Fail at once rather than wait for the holder. busy_timeout belongs to the pooled connection,
            # not to the transaction: it is set back on this same connection, whatever happens, or the
            # session-wide engine hands a later test's request a connection that fails "database is
            # locked" (a 503) at the first contention instead of waiting.
            raw = other.connection().connection.dbapi_connection
            busy_ms = raw.execute("PRAGMA busy_timeout").fetchone()[0]
            raw.execute("PRAGMA busy_timeout = 0")
            try:
                with pytest.raises(OperationalError, match="locked"):
                    lock_project(other, project.id)
            finally:
                raw.execute(f"PRAGMA busy_timeout = {busy_ms}")
        else:
            with pytest.raises(OperationalError, match="could not obtain lock"):
                other.execute(select(Project).where(Project.id == project.id).with_for_update(nowait=True))
        other.rollback()
        holder.commit()
        assert lock_project(other, project.id) is not None  # free once the holder's transaction ends
        other.rollback()


def test_deleting_a_job_frees_every_byte_it_caused(api, api_key, db_url, spec) -> None:
    from service.artifacts import ArtifactStore
    from service.crud import jobstate
    from service.crud.usage import record_usage

    project = _project(db_url, api_key)
    store = ArtifactStore(api.app_settings.artifact_root)
    ids = [api.post("/v1/jobs", json={"spec": spec}, headers=_bearer(api_key)).json()["id"] for _ in range(2)]
    with session_factory(db_url)() as s:
        for job_id in ids:
            jobstate.transition(s, job_id, "cancelled", expect=["queued"], event="test")
        s.commit()
    shared, own = "prepared/p1", "caches/hs-c1"
    store.write_bytes(f"{shared}/data.bin", b"p" * 100)
    store.write_bytes(f"{own}/shard.bin", b"c" * 40)
    store.write_bytes(f"jobs/{ids[0]}/checkpoints/a1/step_2/w.bin", b"t" * 7)
    with session_factory(db_url)() as s:
        for job_id in ids:
            record_usage(s, project.id, "prepared", shared, 100, job_id=job_id)
            s.commit()
        record_usage(s, project.id, "cache", own, 40, job_id=ids[0])
        record_usage(s, project.id, "training_checkpoint", f"jobs/{ids[0]}/checkpoints", 7, job_id=ids[0])
        s.commit()
        assert storage_used(s, project.id) == 147  # the shared key counts once

    assert api.delete(f"/v1/jobs/{ids[0]}", headers=_bearer(api_key)).status_code == 200
    assert not store.exists(own) and not store.exists(f"jobs/{ids[0]}")
    assert store.exists(f"{shared}/data.bin")  # the other job still uses it
    assert storage_used_of(db_url, project.id) == 100
    assert api.delete(f"/v1/jobs/{ids[1]}", headers=_bearer(api_key)).status_code == 200
    assert not store.exists(shared)
    assert storage_used_of(db_url, project.id) == 0


def test_one_caller_holds_at_most_its_share_of_writes_in_flight() -> None:
    import asyncio

    import httpx

    from service.api.fair_share import FairShareMiddleware

    entered, release = asyncio.Event(), asyncio.Event()
    inside = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:  # a write that waits (on a lock, say)
        nonlocal inside
        inside += 1
        if inside == 2:
            entered.set()
        await asyncio.wait_for(release.wait(), DEFAULT_TIMEOUT_S)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario() -> tuple[list[int], int, int]:
        transport = httpx.ASGITransport(app=FairShareMiddleware(app, limit=2, cookie_name="peagle_session"))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            key = {"Authorization": "Bearer a"}
            held = [asyncio.create_task(c.post("/x", headers=key)) for _ in range(2)]
            await asyncio.wait_for(entered.wait(), DEFAULT_TIMEOUT_S)
            refused = await c.post("/x", headers=key)  # answered at once, while both still wait
            other = asyncio.create_task(c.post("/x", headers={"Authorization": "Bearer b"}))
            read = asyncio.create_task(c.get("/x", headers=key))  # reads are not capped
            await until(lambda: inside >= 4, message="the other key's write and the read to be let in")
            release.set()
            codes = [r.status_code for r in await asyncio.gather(*held, other, read)]
            return codes, refused.status_code, refused.json()["error"]["code"] == "too_many_in_flight"

    codes, refused, named = asyncio.run(scenario())
    assert codes == [200, 200, 200, 200] and refused == 429 and named
