"""What one client can see or make the server do: bounded /metrics label sets, cross-project gauges behind
PEAGLE_METRICS_TOKEN, no server paths in events or errors, and the SDK never writing outside --out."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from service.db.session import session_factory
from tests.service.conftest import create_job


def test_made_up_methods_share_one_series(client) -> None:
    for method in ("FOO", "BAR", "X" * 100):
        client.request(method, "/healthz")
    text = client.get("/metrics").text
    assert 'method="other"' in text
    assert "FOO" not in text and "BAR" not in text and "XXXX" not in text


def test_cross_project_gauges_need_the_metrics_token(make_settings, redis_conn) -> None:
    from fastapi.testclient import TestClient

    from service.app import create_app

    with TestClient(create_app(make_settings(metrics_token="scrape-me"))) as c:
        c.get("/healthz")
        public = c.get("/metrics").text
        assert "peagle_http_requests_total" in public and "peagle_jobs" not in public
        assert "peagle_jobs" not in c.get("/metrics", headers={"Authorization": "Bearer wrong"}).text
        full = c.get("/metrics", headers={"Authorization": "Bearer scrape-me"}).text
        assert "peagle_jobs" in full and "peagle_queue_depth" in full


def test_events_and_errors_never_show_server_paths(client, auth, spec, db_url) -> None:
    from peagle_core.errors import DataError
    from service.crud.events import add_event
    from worker.job_io import error_for

    job = create_job(client, auth, spec)
    with session_factory(db_url)() as s:
        add_event(
            s,
            job["id"],
            "log",
            "cannot read /srv/peagle/artifacts/caches/hs-1/shard-00003.safetensors",
            data={"dir": "/srv/peagle/scratch/job_x/work", "uri": "s3://bucket/k", "ratio": "3/10"},
        )
        s.commit()
    last = client.get(f"/v1/jobs/{job['id']}/events", headers=auth).json()["data"][-1]
    assert last["message"] == "cannot read <server>/shard-00003.safetensors"
    assert last["data"] == {"dir": "<server>/work", "uri": "s3://bucket/k", "ratio": "3/10"}
    err = error_for(DataError("dataset.path /data/team-b/secret.jsonl does not exist"), stage="prepare")
    assert "/data/team-b" not in err["message"] and "<server>/secret.jsonl" in err["message"]


@pytest.mark.parametrize("name", ["../escape.txt", "/tmp/abs.txt", "a/../../escape.txt", "~/x", "a\\..\\b"])
def test_sdk_refuses_file_names_escaping_out(client, auth, spec, db_url, tmp_path, name) -> None:
    from client.sdk import ClientError, PeagleClient
    from service.crud.checkpoints import add_checkpoint
    from service.db.models import Job

    job = create_job(client, auth, spec)
    sha = hashlib.sha256(b"x").hexdigest()
    with session_factory(db_url)() as s:
        row = add_checkpoint(
            s,
            job_id=job["id"],
            project_id=s.get(Job, job["id"]).project_id,
            step=1,
            uri="checkpoints/evil",
            files=[{"name": "ok.txt", "size": 1, "sha256": sha}, {"name": name, "size": 1, "sha256": sha}],
        )
        s.commit()
        ckpt_id = row.id
    out = tmp_path / "out"
    sdk = PeagleClient("http://testserver", auth["Authorization"].split()[1], http=client)
    with pytest.raises(ClientError) as info:
        sdk.download_checkpoint(ckpt_id, out)
    assert info.value.code == "unsafe_file_name"
    assert not out.exists() or list(out.iterdir()) == []  # nothing written, not even the safe file
    assert not (tmp_path / "escape.txt").exists()
    assert not Path("/tmp/abs.txt").exists()


def test_redaction_is_idempotent() -> None:
    from service.redact import redact_paths

    once = redact_paths("verifier.name_or_path: '/srv/models/x/test-seed0' is outside s3://b/k, 3/10")
    assert once == "verifier.name_or_path: '<server>/test-seed0' is outside s3://b/k, 3/10"
    assert redact_paths(once) == once  # an error redacted where raised is stored unchanged
