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
