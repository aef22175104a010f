"""POST/GET /v1/datasets: streamed upload with sha256, size cap (413), JSONL validation (422 + line)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tests.service.conftest import create_job

ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    for i in range(3)
]
GOOD = "".join(json.dumps(r) + "\n" for r in ROWS).encode()


def _artifact_files(settings) -> list[Path]:
    root = Path(settings.artifact_root) / "datasets"
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_upload_list_get_and_use_in_a_job(client, auth, settings, spec) -> None:
    r = client.post("/v1/datasets", files={"file": ("chat.jsonl", GOOD)}, headers=auth)
    assert r.status_code == 201, r.text
    ds = r.json()
    assert ds["sha256"] == hashlib.sha256(GOOD).hexdigest() and ds["size"] == len(GOOD)
    assert (ds["num_records"], ds["format"], ds["filename"]) == (3, "messages", "chat.jsonl")
    stored = Path(settings.artifact_root) / "datasets" / ds["id"] / "data.jsonl"
    assert stored.read_bytes() == GOOD
    assert client.get(f"/v1/datasets/{ds['id']}", headers=auth).json() == ds
    assert [d["id"] for d in client.get("/v1/datasets", headers=auth).json()["data"]] == [ds["id"]]
    job = create_job(client, auth, {**spec, "dataset": {"id": ds["id"], "seq_len": 64}})
    assert job["spec"]["dataset"]["id"] == ds["id"]


def test_prompts_only_data_is_accepted_with_regeneration_and_422_without(client, auth, spec) -> None:
    prompts = [{"messages": [{"role": "user", "content": f"q{i}"}], "category": "writing"} for i in range(2)]
    data = GOOD + "".join(json.dumps(r) + "\n" for r in prompts).encode()
    r = client.post("/v1/datasets", files={"file": ("prompts.jsonl", data)}, headers=auth)
    assert r.status_code == 201, r.text
    ds = r.json()
    assert (ds["num_records"], ds["prompts_only_records"]) == (5, 2)

    body = {**spec, "dataset": {"id": ds["id"], "seq_len": 64}}
    for path in ("/v1/jobs", "/v1/jobs/plan"):
        r = client.post(path, json={"spec": body}, headers=auth)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["param"] == "spec.dataset.regenerate" and err["code"] == "prompts_only_dataset"
        assert "2 of 5 conversations without an assistant turn" in err["message"]
    assert client.get("/v1/jobs", headers=auth).json()["data"] == []

    job = create_job(client, auth, {**spec, "dataset": {"id": ds["id"], "seq_len": 64, "regenerate": True}})
    assert job["spec"]["dataset"]["regenerate"]["max_new_tokens"] == 512
    # a dataset with answers needs no regeneration
    r = client.post("/v1/datasets", files={"file": ("chat.jsonl", GOOD)}, headers=auth)
    assert r.json()["prompts_only_records"] == 0
    create_job(client, auth, {**spec, "dataset": {"id": r.json()["id"], "seq_len": 64}})


def test_oversized_upload_is_413_and_leaves_nothing(client, auth, make_settings) -> None:
    from fastapi.testclient import TestClient

    from service.app import create_app

    settings = make_settings(max_upload_bytes=len(GOOD) - 1)
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/datasets", files={"file": ("chat.jsonl", GOOD)}, headers=auth)
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        big = GOOD * 50_000  # declared length far over the cap: refused before the body is read
        r = c.post("/v1/datasets", files={"file": ("chat.jsonl", big)}, headers=auth)
        assert r.status_code == 413
        assert c.get("/v1/datasets", headers=auth).json()["data"] == []
    assert _artifact_files(settings) == []
    assert list((Path(settings.data_dir) / "tmp").iterdir()) == []


def test_bad_jsonl_is_422_with_the_line(client, auth, settings) -> None:
    bad = GOOD + b'{"messages": [{"role": "wizard", "content": "x"}]}\n'
    r = client.post("/v1/datasets", files={"file": ("chat.jsonl", bad)}, headers=auth)
    assert r.status_code == 422
    assert "line 4" in r.json()["error"]["message"]
    r = client.post("/v1/datasets", files={"file": ("chat.jsonl", GOOD + b"{not json\n")}, headers=auth)
    assert r.status_code == 422 and "line 4" in r.json()["error"]["message"]
    assert _artifact_files(settings) == []


def test_upload_needs_multipart_file_field(client, auth) -> None:
    r = client.post("/v1/datasets", content=GOOD, headers={**auth, "Content-Type": "application/jsonl"})
    assert r.status_code == 415
    r = client.post("/v1/datasets", files={"other": ("x.jsonl", GOOD)}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "file"


def test_long_or_deeply_nested_lines_are_422_naming_the_line(make_settings, auth, redis_conn) -> None:
    from fastapi.testclient import TestClient

    from service.app import create_app

    settings = make_settings(max_line_bytes=4096)
    long_line = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode() + b"\n"
    deep = b"[" * 2000 + b"]" * 2000 + b"\n"
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        r = c.post("/v1/datasets", files={"file": ("a.jsonl", GOOD + long_line)}, headers=auth)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "line_too_long" and "line 4" in r.json()["error"]["message"]
        r = c.post("/v1/datasets", files={"file": ("b.jsonl", GOOD + deep)}, headers=auth)
        assert r.status_code == 422, r.text
        assert "line 4: JSON nested too deeply" in r.json()["error"]["message"]
    assert _artifact_files(settings) == []


class _Waiter:
    """Notes when a thread other than the test's issues a statement that takes (or waits for) a lock."""

    def __init__(self, engine) -> None:
        import threading

        self.engine, self.main, self.seen = engine, threading.get_ident(), threading.Event()

    def __enter__(self) -> _Waiter:
        from sqlalchemy import event

        event.listen(self.engine, "before_cursor_execute", self._check)
        return self

    def __exit__(self, *exc: object) -> None:
        from sqlalchemy import event

        event.remove(self.engine, "before_cursor_execute", self._check)

    def _check(self, _conn, _cursor, statement: str, *_args) -> None:
        import threading

        words = statement.lstrip().split(None, 1)
        locking = "FOR UPDATE" in statement or (words and words[0].upper() in ("UPDATE", "DELETE", "INSERT"))
        if threading.get_ident() != self.main and locking:
            self.seen.set()


def _in_thread(fn):
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def test_dataset_delete_and_job_create_are_serialised(client, auth, spec, settings, db_url) -> None:
    """A DELETE racing a job create on the same dataset: whichever holds the dataset's lock first wins, and
    the other sees its commit, so no queued job is ever left on a deleted dataset (both databases)."""
    from service.artifacts import ArtifactStore
    from service.crud import datasets as datasets_crud
    from service.crud.jobs import create_job_row
    from service.crud.projects import project_for_key
    from service.db.session import get_engine, session_factory
    from service.lifecycle import delete_dataset_with_files

    sessions = session_factory(db_url)
    with sessions() as s:
        project_id = project_for_key(s, auth["Authorization"].split()[1]).id

    def upload() -> str:
        r = client.post("/v1/datasets", files={"file": ("chat.jsonl", GOOD)}, headers=auth)
        assert r.status_code == 201, r.text
        return r.json()["id"]

    # A create holds the lock (its job not committed yet): the DELETE waits, then sees the job: 409.
    ds = upload()
    body = {**spec, "dataset": {"id": ds, "seq_len": 64}}
    with sessions() as create, _Waiter(get_engine(db_url)) as waiter:
        assert datasets_crud.lock_dataset(create, project_id, ds) is not None
        create_job_row(create, project_id, body, max_attempts=3)
        deleting = _in_thread(lambda: client.delete(f"/v1/datasets/{ds}", headers=auth))
        assert waiter.seen.wait(60), "the DELETE never reached its lock"
        create.commit()
        r = deleting.result(timeout=60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "dataset_in_use", r.text

    # A DELETE holds the lock (the row gone but not committed): the create waits, then finds no dataset.
    ds = upload()
    body = {**spec, "dataset": {"id": ds, "seq_len": 64}}
    with sessions() as deleter, _Waiter(get_engine(db_url)) as waiter:
        row = datasets_crud.lock_dataset(deleter, project_id, ds)
        delete_dataset_with_files(deleter, ArtifactStore(settings.artifact_root), row)
        creating = _in_thread(lambda: client.post("/v1/jobs", json={"spec": body}, headers=auth))
        assert waiter.seen.wait(60), "the create never reached its lock"
        deleter.commit()
        r = creating.result(timeout=60)
    assert r.status_code == 422 and r.json()["error"]["param"] == "spec.dataset.id", r.text
