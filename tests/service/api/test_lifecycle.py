"""Lifecycle: DELETE datasets, jobs (finished only, with their artifacts) and checkpoints, files first;
retention applied by the reconciler; API keys listed, revoked (401 at once) and rotated; idempotency keys
expire after 24 h; the SDK sends an Idempotency-Key on every create."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

from sqlalchemy import update
from typer.testing import CliRunner

from service.artifacts import ArtifactStore
from service.crud.checkpoints import add_checkpoint
from service.db.models import IdempotencyKey, Job, utcnow
from service.db.session import session_factory
from tests.service.conftest import create_job

ROW = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def _publish_checkpoint(settings, db_url: str, job_id: str, tmp_path: Path) -> tuple[str, Path]:
    src = tmp_path / f"export-{job_id}"
    src.mkdir()
    (src / "config.json").write_text("{}")
    key = f"checkpoints/ckpt_{job_id[4:]}"
    files = ArtifactStore(settings.artifact_root).publish_dir(src, key)
    with session_factory(db_url)() as s:
        project_id = s.get(Job, job_id).project_id
        row = add_checkpoint(
            s, job_id=job_id, project_id=project_id, step=1, uri=key, files=files, checkpoint_id=key[12:]
        )
        s.commit()
        return row.id, Path(settings.artifact_root) / key


def test_delete_dataset_job_and_checkpoint(
    client, auth, other_auth, spec, settings, db_url, tmp_path
) -> None:
    ds = client.post(
        "/v1/datasets", files={"file": ("d.jsonl", json.dumps(ROW).encode() + b"\n")}, headers=auth
    ).json()
    job = create_job(client, auth, {**spec, "dataset": {"id": ds["id"], "seq_len": 64}})
    ckpt_id, ckpt_dir = _publish_checkpoint(settings, db_url, job["id"], tmp_path)
    work = Path(settings.artifact_root) / "jobs" / job["id"] / "work"
    work.mkdir(parents=True)
    (work / "state.pt").write_bytes(b"x")

    # Not while a job will still read it / not while the job may still run; never another project's.
    r = client.delete(f"/v1/datasets/{ds['id']}", headers=auth)
    assert r.status_code == 409 and job["id"] in r.json()["error"]["message"]
    r = client.delete(f"/v1/jobs/{job['id']}", headers=auth)
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_finished"
    assert client.delete(f"/v1/jobs/{job['id']}", headers=other_auth).status_code == 404
    assert client.delete(f"/v1/checkpoints/{ckpt_id}", headers=other_auth).status_code == 404
    assert client.delete(f"/v1/datasets/{ds['id']}", headers=other_auth).status_code == 404
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth).json()["status"] == "cancelled"

    stored = Path(settings.artifact_root) / "datasets" / ds["id"]
    assert stored.is_dir()
    r = client.delete(f"/v1/datasets/{ds['id']}", headers=auth)
    assert r.status_code == 200 and r.json() == {"id": ds["id"], "object": "dataset", "deleted": True}
    assert not stored.exists()
    assert client.get(f"/v1/datasets/{ds['id']}", headers=auth).status_code == 404
    assert client.delete(f"/v1/datasets/{ds['id']}", headers=auth).status_code == 404

    r = client.delete(f"/v1/jobs/{job['id']}", headers=auth)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert not ckpt_dir.exists() and not work.parent.exists()
    for path in (f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/events", f"/v1/checkpoints/{ckpt_id}"):
        assert client.get(path, headers=auth).status_code == 404, path

    # A checkpoint alone: files, then row; the job stays.
    job2 = create_job(client, auth, spec)
    ckpt2, dir2 = _publish_checkpoint(settings, db_url, job2["id"], tmp_path)
    assert client.delete(f"/v1/checkpoints/{ckpt2}", headers=auth).json()["object"] == "checkpoint"
    assert not dir2.exists()
    assert client.get(f"/v1/checkpoints/{ckpt2}", headers=auth).status_code == 404
    assert client.get(f"/v1/jobs/{job2['id']}/checkpoints", headers=auth).json()["data"] == []


def test_retention_is_applied_by_the_reconciler(make_settings, isolated_db_url, redis_conn, tmp_path) -> None:
    from service.crud import jobstate
    from service.crud.jobs import create_job_row
    from service.crud.projects import create_key
    from worker.reconcile import reconcile_once

    settings = make_settings(database_url=isolated_db_url, retention_days=7)
    sessions = session_factory(isolated_db_url)
    with sessions() as s:
        _, key = create_key(s, "retention")
        ids = [create_job_row(s, key.project_id, {"name": n}, max_attempts=1).id for n in ("old", "new")]
        s.commit()
        for job_id in ids:
            assert jobstate.transition(s, job_id, "cancelled", expect=["queued"], event="cancelled")
        s.commit()
        # The old job finished 8 days ago (tests may age a row; production rows are written by crud only).
        s.execute(update(Job).where(Job.id == ids[0]).values(finished_at=utcnow() - timedelta(days=8)))
        s.commit()
    _, old_dir = _publish_checkpoint(settings, isolated_db_url, ids[0], tmp_path)

    report = reconcile_once(settings, redis=redis_conn)
    assert report.expired == [ids[0]]
    assert not old_dir.exists()
    with sessions() as s:
        assert s.get(Job, ids[0]) is None and s.get(Job, ids[1]) is not None


def test_keys_list_revoke_rotate(client, db_url, monkeypatch) -> None:
    from cli import build_app
    from service.crud.projects import create_key, list_keys
    from service.settings import get_settings

    monkeypatch.setenv("PEAGLE_DATABASE_URL", db_url)
    get_settings.cache_clear()
    peagle, runner = build_app(), CliRunner()
    try:
        with session_factory(db_url)() as s:
            plaintext, row = create_key(s, "keys-test")
            key_id = row.id
        auth = {"Authorization": f"Bearer {plaintext}"}
        assert client.get("/v1/jobs", headers=auth).status_code == 200
        listed = runner.invoke(peagle, ["keys", "list", "--project", "keys-test"])
        assert listed.exit_code == 0 and key_id in listed.output and "revoked=-" in listed.output

        rotated = runner.invoke(peagle, ["keys", "rotate", key_id])
        assert rotated.exit_code == 0, rotated.output
        new_key = rotated.stdout.strip().splitlines()[0]
        assert client.get("/v1/jobs", headers=auth).status_code == 401  # the old key, at once
        new_auth = {"Authorization": f"Bearer {new_key}"}
        assert client.get("/v1/jobs", headers=new_auth).status_code == 200

        with session_factory(db_url)() as s:
            (new_id,) = [k.id for k, _ in list_keys(s, "keys-test") if k.revoked_at is None]
        assert runner.invoke(peagle, ["keys", "revoke", new_id]).exit_code == 0
        r = client.get("/v1/jobs", headers=new_auth)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert runner.invoke(peagle, ["keys", "revoke", "key_nope"]).exit_code == 1
    finally:
        get_settings.cache_clear()


def test_idempotency_keys_expire_after_a_day(client, auth, spec, db_url) -> None:
    first = create_job(client, auth, spec, **{"Idempotency-Key": "retry-1"})
    again = client.post("/v1/jobs", json={"spec": spec}, headers={**auth, "Idempotency-Key": "retry-1"})
    assert again.status_code == 200 and again.json()["id"] == first["id"]
    with session_factory(db_url)() as s:  # a day and a bit later
        s.execute(
            update(IdempotencyKey)
            .where(IdempotencyKey.job_id == first["id"])
            .values(created_at=utcnow() - timedelta(hours=25))
        )
        s.commit()
    later = create_job(client, auth, spec, **{"Idempotency-Key": "retry-1"})
    assert later["id"] != first["id"]


def test_sdk_sends_an_idempotency_key_on_every_create(client, auth, spec) -> None:
    from client.sdk import PeagleClient

    sent: list[str | None] = []
    client.event_hooks["request"].append(
        lambda request: (
            sent.append(request.headers.get("idempotency-key")) if request.method == "POST" else None
        )
    )
    sdk = PeagleClient("http://testserver", auth["Authorization"].split()[1], http=client)
    a, b = sdk.create_job(spec), sdk.create_job(spec)
    assert a["id"] != b["id"] and len(sent) == 2 and all(sent) and sent[0] != sent[1]
    assert (
        sdk.create_job(spec, idempotency_key="mine")["id"]
        == sdk.create_job(spec, idempotency_key="mine")["id"]
    )
