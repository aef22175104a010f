"""Racing state changes on one row (issue 44, class 3): concurrent cancels and deletes of one job, deletes of
one dataset against job creates naming it, deletes of one checkpoint against its job's delete, and reads
of rows another request deletes. Every answer is the one a later request would get (404) or a conflict
(409), never a 500, and the final state is consistent. Runs on SQLite and, when configured, Postgres."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
from sqlalchemy import select

from service.db.models import Checkpoint, Job
from service.db.session import session_factory
from tests.fixtures.race import at_once
from tests.service.api.test_doors import _jsonl
from tests.service.conftest import create_job

ROUNDS = 6
REQUESTS = 16  # per round: 6 x 16 = 96 requests, as the probe fired


@pytest.fixture
def client(make_settings: Any, redis_conn: Any) -> Iterator[Any]:
    """The suite's client on an app whose per-caller in-flight caps let one key race itself."""
    from fastapi.testclient import TestClient

    from service.app import create_app

    settings = make_settings(max_writes_in_flight_per_caller=64, max_requests_in_flight_per_caller=64)
    with TestClient(create_app(settings), base_url="http://localhost", raise_server_exceptions=False) as c:
        yield c


def _statuses(answers: list[Any], allowed: set[int]) -> Counter[int]:
    seen = Counter(r.status_code for r in answers)
    bad = [r for r in answers if r.status_code not in allowed]
    assert not bad, [(r.status_code, r.text[:300]) for r in bad]
    for r in answers:
        if r.status_code in (404, 409):
            assert r.json()["error"]["code"], r.text
    return seen


def test_concurrent_cancels_and_deletes_of_one_job(client, auth, spec, db_url) -> None:
    rng = random.Random(44)
    totals: Counter[int] = Counter()
    for _ in range(ROUNDS):
        job = create_job(client, auth, spec)["id"]
        cancel = partial(client.post, f"/v1/jobs/{job}/cancel", headers=auth)
        delete = partial(client.delete, f"/v1/jobs/{job}", headers=auth)
        calls = [cancel if rng.random() < 0.5 else delete for _ in range(REQUESTS)]
        answers = at_once(calls)
        totals += _statuses(answers, {200, 404, 409})
        # Consistent: the job is cancelled, or gone if a delete came after a cancel.
        after = client.get(f"/v1/jobs/{job}", headers=auth)
        deleted = any(r.request.method == "DELETE" and r.status_code == 200 for r in answers)
        if deleted:
            assert after.status_code == 404, after.text
        else:
            assert after.json()["status"] == "cancelled", after.text
        # Each delete that answered 200 was the only one.
        assert sum(r.request.method == "DELETE" and r.status_code == 200 for r in answers) <= 1
    assert totals[200] and (totals[404] or totals[409]), totals


@pytest.mark.parametrize(("call", "cancelled_first"), [("cancel", False), ("delete", True)])
def test_a_job_deleted_between_read_and_write_answers_404(
    client, auth, spec, db_url, monkeypatch, call, cancelled_first
) -> None:
    """The losing side of the race, made certain: another request deletes the job right after this one
    read it, before it writes (a queued job's cancel) or re-reads it under the lock (a finished job's
    delete)."""
    from service.crud import jobs as jobs_crud

    job = create_job(client, auth, spec)["id"]
    if cancelled_first:
        assert client.post(f"/v1/jobs/{job}/cancel", headers=auth).status_code == 200
    real_get = jobs_crud.get_job_row

    def get_then_vanish(db: Any, project_id: str, job_id: str) -> Any:
        row = real_get(db, project_id, job_id)
        with session_factory(db_url)() as other:
            other.execute(Job.__table__.delete().where(Job.id == job_id))
            other.commit()
        return row

    monkeypatch.setattr(jobs_crud, "get_job_row", get_then_vanish)  # the actions read through it
    if call == "cancel":
        r = client.post(f"/v1/jobs/{job}/cancel", headers=auth)
    else:
        r = client.delete(f"/v1/jobs/{job}", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", r.text


def test_concurrent_deletes_of_one_dataset_and_jobs_naming_it(client, auth, spec) -> None:
    for _ in range(3):
        ds = client.post("/v1/datasets", files={"file": ("d.jsonl", _jsonl(512))}, headers=auth).json()["id"]
        named = {**spec, "dataset": {"id": ds, "seq_len": 64}}
        delete = partial(client.delete, f"/v1/datasets/{ds}", headers=auth)
        create = partial(client.post, "/v1/jobs", json={"spec": named}, headers=auth)
        calls = [delete if i % 2 else create for i in range(8)]
        answers = at_once(calls)
        _statuses(answers, {200, 201, 404, 409, 422})
        created = [r.json()["id"] for r in answers if r.status_code == 201]
        gone = client.get(f"/v1/datasets/{ds}", headers=auth).status_code == 404
        # Never a queued job on a deleted dataset.
        assert not (gone and created), (created, [r.status_code for r in answers])
        for job in created:
            client.post(f"/v1/jobs/{job}/cancel", headers=auth)


def test_concurrent_deletes_of_a_checkpoint_and_its_job(
    client, auth, spec, db_url, tmp_path, settings
) -> None:
    from service.artifacts import ArtifactStore
    from service.crud.checkpoints import add_checkpoint

    store = ArtifactStore(settings.artifact_root)
    src = tmp_path / "ck"
    src.mkdir()
    (src / "config.json").write_text("{}")
    for n in range(3):
        job = create_job(client, auth, spec)["id"]
        assert client.post(f"/v1/jobs/{job}/cancel", headers=auth).status_code == 200
        files = store.publish_dir(src, f"checkpoints/ckpt_race{n}")
        with session_factory(db_url)() as s:
            row = add_checkpoint(
                s,
                job_id=job,
                project_id=s.get(Job, job).project_id,
                step=1,
                uri=f"checkpoints/ckpt_race{n}",
                files=files,
            )
            s.commit()
            ckpt = row.id
        delete_ckpt = partial(client.delete, f"/v1/checkpoints/{ckpt}", headers=auth)
        delete_job = partial(client.delete, f"/v1/jobs/{job}", headers=auth)
        calls = [delete_ckpt if i % 3 else delete_job for i in range(9)]
        answers = at_once(calls)
        _statuses(answers, {200, 404, 409})
        deletes = [r for r in answers if "/checkpoints/" in str(r.request.url)]
        assert sum(r.status_code == 200 for r in deletes) <= 1, [r.status_code for r in deletes]
        with session_factory(db_url)() as s:
            assert s.scalar(select(Checkpoint).where(Checkpoint.id == ckpt)) is None


def test_reads_racing_a_delete_answer_200_or_404(client, auth, spec) -> None:
    for route in ("/v1/jobs/{job}", "/v1/jobs/{job}/events", "/v1/jobs/{job}/checkpoints"):
        job = create_job(client, auth, spec)["id"]
        assert client.post(f"/v1/jobs/{job}/cancel", headers=auth).status_code == 200
        calls = [partial(client.get, route.format(job=job), headers=auth)] * 7
        calls.append(partial(client.delete, f"/v1/jobs/{job}", headers=auth))
        _statuses(at_once(calls), {200, 404})


def test_a_plan_purged_under_its_refresh_answers_404(
    make_settings, redis_conn, auth, spec, db_url, monkeypatch
):
    """Housekeeping deletes a plan between the GET's read and its write (the plan's deadline passed, so
    the GET records its timeout): the answer is the 404 a later GET gets, not the ORM's StaleDataError."""
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.crud import plans as plans_crud
    from service.db.models import Plan

    app = create_app(make_settings(plan_timeout_s=0.001))
    with TestClient(app, base_url="http://localhost", raise_server_exceptions=False) as c:
        r = c.post("/v1/jobs/plan", json={"spec": spec}, headers=auth)
        assert r.status_code == 202, r.text
        plan_id = r.json()["id"]
        real_get = plans_crud.get_plan_row

        def get_then_purge(db: Any, project_id: str, ident: str) -> Any:
            row = real_get(db, project_id, ident)
            with session_factory(db_url)() as other:
                other.execute(Plan.__table__.delete().where(Plan.id == ident))
                other.commit()
            return row

        monkeypatch.setattr(plans_crud, "get_plan_row", get_then_purge)
        r = c.get(f"/v1/plans/{plan_id}", headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "plan_not_found", r.text


def test_concurrent_rotations_of_one_key_make_one_successor(db_url, api_key) -> None:
    from service.crud.projects import hash_key, rotate_key
    from service.db.models import ApiKey

    with session_factory(db_url)() as s:
        key_id = s.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_key(api_key)))

    def rotate() -> Any:
        with session_factory(db_url)() as s:
            return rotate_key(s, key_id)

    results = at_once([rotate] * 6)
    assert sum(r is not None for r in results) == 1, results


def test_concurrent_first_sign_ins_share_one_session_nonce(client, api_key) -> None:
    """Two first sign-ins of one key at once: both cookies work (each used to store its own nonce, so
    the later commit signed the earlier cookie out)."""
    from fastapi.testclient import TestClient

    from tests.service.ui.test_ui import csrf_of

    with TestClient(client.app, base_url="http://localhost", raise_server_exceptions=False) as other:
        browsers = [client, other]
        tokens = [csrf_of(b) for b in browsers]
        sign_ins = [
            partial(b.post, "/ui/login", data={"api_key": api_key, "csrf_token": t}, follow_redirects=False)
            for b, t in zip(browsers, tokens, strict=True)
        ]
        assert [r.status_code for r in at_once(sign_ins)] == [303, 303]
        for b in browsers:
            assert b.get("/ui/", follow_redirects=False).status_code == 200
