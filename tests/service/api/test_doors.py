"""One rule per action, whatever the door: uploading a dataset, creating, cancelling and deleting a job,
and deleting a dataset answer the same through `/v1` (bearer key) and the dashboard (session cookie and
CSRF token): the same size caps, quotas, allowed queues, idempotency and errors, with the same cases."""

from __future__ import annotations

import html
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from service.crud.limits import set_limits
from service.crud.projects import project_for_key
from service.db.session import session_factory
from tests.service.conftest import create_job
from tests.service.ui.test_ui import csrf_of, sign_in

ROW = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})


def _jsonl(size: int) -> bytes:
    """Valid JSONL of about `size` bytes."""
    line = (ROW + "\n").encode()
    return line * max(1, size // len(line))


@dataclass
class Outcome:
    status: int  # the API's status; for a dashboard form shown again with errors, 422
    code: str | None = None
    message: str | None = None
    job_id: str | None = None


class ApiDoor:
    name = "api"

    def __init__(self, client: Any, key: str):
        self.client, self.auth = client, {"Authorization": f"Bearer {key}"}

    def _outcome(self, r: Any, *, job: bool = False) -> Outcome:
        if r.status_code >= 400:
            error = r.json()["error"]
            return Outcome(r.status_code, error["code"], error["message"])
        return Outcome(r.status_code, job_id=r.json()["id"] if job else None)

    def upload(self, body: bytes) -> Outcome:
        return self._outcome(
            self.client.post("/v1/datasets", files={"file": ("d.jsonl", body)}, headers=self.auth)
        )

    def create(self, spec: dict[str, Any], key: str | None = None) -> Outcome:
        headers = {**self.auth, **({"Idempotency-Key": key} if key else {})}
        return self._outcome(self.client.post("/v1/jobs", json={"spec": spec}, headers=headers), job=True)

    def cancel(self, job_id: str) -> Outcome:
        return self._outcome(self.client.post(f"/v1/jobs/{job_id}/cancel", headers=self.auth))

    def delete_job(self, job_id: str) -> Outcome:
        return self._outcome(self.client.delete(f"/v1/jobs/{job_id}", headers=self.auth))

    def delete_dataset(self, dataset_id: str) -> Outcome:
        return self._outcome(self.client.delete(f"/v1/datasets/{dataset_id}", headers=self.auth))


class UiDoor:
    name = "ui"

    def __init__(self, client: Any, key: str):
        self.client = client
        sign_in(client, key)
        self.csrf = csrf_of(client, "/ui/datasets")

    def _form(self, url: str, **data: str) -> Outcome:
        r = self.client.post(url, data={"csrf_token": self.csrf, **data}, follow_redirects=False)
        if r.status_code == 303:
            return Outcome(303)
        error = r.json()["error"]
        return Outcome(r.status_code, error["code"], error["message"])

    def upload(self, body: bytes) -> Outcome:
        r = self.client.post(
            "/ui/data/datasets", files={"file": ("d.jsonl", body)}, headers={"X-CSRF-Token": self.csrf}
        )
        if r.status_code >= 400:
            error = r.json()["error"]
            return Outcome(r.status_code, error["code"], error["message"])
        return Outcome(r.status_code)

    def create(self, spec: dict[str, Any], key: str | None = None) -> Outcome:
        form = {"spec_yaml": yaml.safe_dump(spec), "action": "submit", "idempotency_key": key or ""}
        r = self.client.post("/ui/jobs/new", data={"csrf_token": self.csrf, **form}, follow_redirects=False)
        if r.status_code == 303:
            return Outcome(201, job_id=r.headers["location"].rsplit("/", 1)[1])
        assert r.status_code == 200 and 'role="alert"' in r.text, r.text[:300]
        return Outcome(422, message=html.unescape(r.text))

    def cancel(self, job_id: str) -> Outcome:
        return self._form(f"/ui/jobs/{job_id}/cancel")

    def delete_job(self, job_id: str) -> Outcome:
        return self._form(f"/ui/jobs/{job_id}/delete")

    def delete_dataset(self, dataset_id: str) -> Outcome:
        return self._form(f"/ui/datasets/{dataset_id}/delete")


DOORS = {"api": ApiDoor, "ui": UiDoor}


@pytest.fixture(params=list(DOORS))
def door(request, client, api_key) -> Iterator[ApiDoor | UiDoor]:
    yield DOORS[request.param](client, api_key)


def _limits(db_url: str, api_key: str, **limits: object) -> None:
    with session_factory(db_url)() as s:
        set_limits(s, project_for_key(s, api_key), **limits)
        s.commit()


def _make_client(make_settings: Any, **overrides: Any) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from service.app import create_app

    with TestClient(create_app(make_settings(**overrides)), base_url="http://localhost") as c:
        yield c


# -- upload ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (_jsonl(2 << 20), 201, None),  # over the spec cap (1 MiB), under the upload cap: the old 413
        (_jsonl(1024) + b"{not json\n", 422, "invalid_data"),
        (_jsonl(1024) + b'{"messages": [{"role": "user", "content": "a\\u0000"}]}\n', 422, "invalid_text"),
        (b"", 422, "invalid_data"),
    ],
    ids=["2MiB", "malformed-line", "nul-line", "empty"],
)
def test_upload_answers_alike(door, body, status, code) -> None:
    outcome = door.upload(body)
    assert (outcome.status, outcome.code) == (status, code), outcome


@pytest.mark.parametrize("name", list(DOORS))
def test_upload_cap_and_storage_quota_alike(make_settings, redis_conn, api_key, db_url, name) -> None:
    for client in _make_client(make_settings, max_upload_bytes=64 << 10):
        door = DOORS[name](client, api_key)
        outcome = door.upload(_jsonl(200 << 10))
        assert (outcome.status, outcome.code) == (413, "payload_too_large"), outcome
        _limits(db_url, api_key, storage_cap_bytes=10 << 10)
        outcome = door.upload(_jsonl(20 << 10))
        assert (outcome.status, outcome.code) == (403, "storage_quota_exceeded"), outcome


# -- create ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("patch", "code", "needle"),
    [
        ({"resources": {"queue": "nowhere"}}, "unknown_queue", "unknown queue 'nowhere'"),
        ({"tracking": {"report_to": ["mlflow"]}}, "tracker_unavailable", "no MLflow tracking server"),
        ({"verifier": {"name_or_path": "/etc"}}, "invalid_spec", "verifier.name_or_path"),
        (
            {"dataset": {"id": "ds_missing", "seq_len": 64}},
            "dataset_not_found",
            "no dataset with id 'ds_missing'",
        ),
    ],
    ids=["queue", "tracker", "path", "dataset"],
)
def test_create_refuses_alike(door, spec, patch, code, needle) -> None:
    outcome = door.create({**spec, **patch})
    assert outcome.status == 422 and needle in (outcome.message or ""), outcome
    if door.name == "api":
        assert outcome.code == code


def test_create_counts_the_same_limits(door, spec, db_url, api_key) -> None:
    _limits(db_url, api_key, max_running_jobs=1)
    assert door.create(spec).status == 201
    outcome = door.create(spec)
    assert "max_running_jobs: 1" in (outcome.message or ""), outcome
    _limits(db_url, api_key, max_running_jobs=None, allowed_queues=["gpu-a"])
    outcome = door.create(spec)
    assert "allowed_queues: gpu-a" in (outcome.message or ""), outcome


@pytest.mark.parametrize("first", list(DOORS))
def test_one_idempotency_key_across_both_doors(client, api_key, spec, door, first) -> None:
    """A key used at one door replays at the other: one rule, one record."""
    other = door if first == door.name else DOORS[first](client, api_key)
    a = other.create(spec, key="retry-1")
    b = door.create(spec, key="retry-1")
    assert a.job_id is not None and a.job_id == b.job_id, (a, b)
    changed = door.create({**spec, "name": "another"}, key="retry-1")
    assert "Idempotency-Key was already used" in (changed.message or ""), changed
    bad = door.create(spec, key="a\x1bb")
    assert "control character" in (bad.message or ""), bad


# -- cancel and delete -----------------------------------------------------------------------------


def test_cancel_and_delete_answer_alike(door, client, auth, spec) -> None:
    job = create_job(client, auth, spec)["id"]
    outcome = door.delete_job(job)
    assert (outcome.status, outcome.code) == (409, "job_not_finished"), outcome
    assert door.cancel(job).status in (200, 303)
    assert client.get(f"/v1/jobs/{job}", headers=auth).json()["status"] == "cancelled"
    assert door.delete_job(job).status in (200, 303)
    assert client.get(f"/v1/jobs/{job}", headers=auth).status_code == 404
    for outcome in (door.cancel(job), door.delete_job(job)):
        assert (outcome.status, outcome.code) == (404, "job_not_found"), outcome


def test_dataset_delete_answers_alike(door, client, auth, spec) -> None:
    r = client.post("/v1/datasets", files={"file": ("d.jsonl", _jsonl(1024))}, headers=auth)
    dataset = r.json()["id"]
    job = create_job(client, auth, {**spec, "dataset": {"id": dataset, "seq_len": 64}})["id"]
    outcome = door.delete_dataset(dataset)
    assert (outcome.status, outcome.code) == (409, "dataset_in_use"), outcome
    assert client.post(f"/v1/jobs/{job}/cancel", headers=auth).status_code == 200
    assert door.delete_dataset(dataset).status in (200, 303)
    outcome = door.delete_dataset(dataset)
    assert (outcome.status, outcome.code) == (404, "dataset_not_found"), outcome
