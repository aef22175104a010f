"""Project isolation: a key never sees another project's objects; every such request is a 404."""

from __future__ import annotations

import pytest

from tests.service.conftest import create_job

GOOD = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'

ROUTES = [
    ("GET", "/v1/jobs/{job}"),
    ("POST", "/v1/jobs/{job}/cancel"),
    ("GET", "/v1/jobs/{job}/events"),
    ("GET", "/v1/jobs/{job}/metrics"),
    ("GET", "/v1/jobs/{job}/checkpoints"),
    ("GET", "/v1/datasets/{ds}"),
    ("GET", "/v1/checkpoints/{ckpt}"),
    ("GET", "/v1/checkpoints/{ckpt}/archive"),
    ("GET", "/v1/checkpoints/{ckpt}/files/config.json"),
]


@pytest.fixture
def owned(client, auth, spec, db_url, tmp_path, settings) -> dict[str, str]:
    from service.artifacts import ArtifactStore
    from service.crud.checkpoints import add_checkpoint
    from service.db.models import Job
    from service.db.session import session_factory

    job = create_job(client, auth, spec)["id"]
    ds = client.post("/v1/datasets", files={"file": ("d.jsonl", GOOD)}, headers=auth).json()["id"]
    src = tmp_path / "ck"
    src.mkdir()
    (src / "config.json").write_text("{}")
    files = ArtifactStore(settings.artifact_root).publish_dir(src, "checkpoints/ckpt_iso")
    with session_factory(db_url)() as s:
        row = add_checkpoint(
            s,
            job_id=job,
            project_id=s.get(Job, job).project_id,
            step=1,
            uri="checkpoints/ckpt_iso",
            files=files,
        )
        s.commit()
        return {"job": job, "ds": ds, "ckpt": row.id}


@pytest.mark.parametrize(("method", "template"), ROUTES)
def test_other_project_gets_404_owner_gets_200(client, auth, other_auth, owned, method, template) -> None:
    path = template.format(**owned)
    theirs = client.request(method, path, headers=other_auth)
    assert theirs.status_code == 404, theirs.text
    assert theirs.json()["error"]["type"] == "not_found_error"
    mine = client.request(method, path, headers=auth)
    assert mine.status_code == 200, mine.text


def test_lists_are_scoped(client, auth, other_auth, owned) -> None:
    for path in ("/v1/jobs", "/v1/datasets"):
        assert client.get(path, headers=other_auth).json()["data"] == []
        assert len(client.get(path, headers=auth).json()["data"]) == 1
    # Another project's id is not a usable cursor either.
    r = client.get("/v1/jobs", params={"after": owned["job"]}, headers=other_auth)
    assert r.status_code == 422


def test_other_projects_dataset_cannot_be_used(client, other_auth, owned, spec) -> None:
    r = client.post(
        "/v1/jobs", json={"spec": {**spec, "dataset": {"id": owned["ds"], "seq_len": 64}}}, headers=other_auth
    )
    assert r.status_code == 422 and r.json()["error"]["param"] == "spec.dataset.id"


@pytest.mark.parametrize("header", [None, "Bearer nope", "Basic abc", "Bearer "])
def test_missing_or_bad_key_is_401(client, owned, header) -> None:
    headers = {"Authorization": header} if header else {}
    for path in ("/v1/jobs", f"/v1/jobs/{owned['job']}", "/v1/datasets"):
        r = client.get(path, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
