"""Checkpoint downloads: tar archive built on the fly, single files with Range, names checked."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from service.crud.checkpoints import add_checkpoint
from service.db.session import session_factory
from tests.service.conftest import create_job

FILES = {
    "config.json": b'{"a": 1}\n',
    "model.safetensors": bytes(range(256)) * 40,
    "README.md": b"# drafter\n",
}


@pytest.fixture
def checkpoint(client, auth, spec, settings, db_url, tmp_path) -> dict:
    from service.artifacts import ArtifactStore

    job = create_job(client, auth, spec)
    src = tmp_path / "export"
    src.mkdir()
    for name, data in FILES.items():
        (src / name).write_bytes(data)
    store = ArtifactStore(settings.artifact_root)
    files = store.publish_dir(src, f"checkpoints/ckpt_{job['id'][4:]}")
    with session_factory(db_url)() as s:
        row = add_checkpoint(
            s,
            job_id=job["id"],
            project_id=_project_of(s, job["id"]),
            step=2,
            uri=f"checkpoints/ckpt_{job['id'][4:]}",
            files=files,
            metrics={"acceptance_length": 2.1},
            servable="verified",
            checkpoint_id=f"ckpt_{job['id'][4:]}",
        )
        s.commit()
        return {"id": row.id, "job_id": job["id"]}


def _project_of(session, job_id: str) -> str:
    from service.db.models import Job

    return session.get(Job, job_id).project_id


def test_list_and_inspect(client, auth, checkpoint) -> None:
    listed = client.get(f"/v1/jobs/{checkpoint['job_id']}/checkpoints", headers=auth).json()["data"]
    assert [c["id"] for c in listed] == [checkpoint["id"]]
    ck = client.get(f"/v1/checkpoints/{checkpoint['id']}", headers=auth).json()
    assert {f["name"]: f["sha256"] for f in ck["files"]} == {
        n: hashlib.sha256(d).hexdigest() for n, d in FILES.items()
    }
    assert ck["size"] == sum(map(len, FILES.values())) and ck["step"] == 2
    assert ck["servable"] == "verified" and listed[0]["servable"] == "verified"


def test_archive_is_a_valid_tar_of_every_file(client, auth, checkpoint) -> None:
    r = client.get(f"/v1/checkpoints/{checkpoint['id']}/archive", headers=auth)
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert got == {f"{checkpoint['id']}/{n}": d for n, d in FILES.items()}


def test_file_download_with_checksum(client, auth, checkpoint) -> None:
    r = client.get(f"/v1/checkpoints/{checkpoint['id']}/files/model.safetensors", headers=auth)
    data = FILES["model.safetensors"]
    assert r.status_code == 200 and r.content == data
    assert r.headers["x-checksum-sha256"] == hashlib.sha256(data).hexdigest()
    assert r.headers["accept-ranges"] == "bytes" and r.headers["repr-digest"].startswith("sha-256=:")
    # Always a download, never rendered or sniffed by a browser.
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["content-disposition"].startswith('attachment; filename="model.safetensors"')
    readme = client.get(f"/v1/checkpoints/{checkpoint['id']}/files/README.md", headers=auth)
    assert readme.headers["content-disposition"].startswith("attachment")


@pytest.mark.parametrize(
    ("header", "span"),
    [
        ("bytes=0-99", (0, 100)),
        ("bytes=100-", (100, None)),
        ("bytes=-10", (-10, None)),
        ("bytes=10000-20000", (10000, None)),
        ("bytes=0-" + "9" * 5000, (0, None)),  # an end past the parser: the rest of the file
        ("bytes=-" + "9" * 5000, (0, None)),
    ],
)
def test_single_ranges(client, auth, checkpoint, header, span) -> None:
    data = FILES["model.safetensors"]
    r = client.get(
        f"/v1/checkpoints/{checkpoint['id']}/files/model.safetensors", headers={**auth, "Range": header}
    )
    assert r.status_code == 206 and r.content == data[span[0] : span[1]]
    start = span[0] % len(data)
    assert r.headers["content-range"] == f"bytes {start}-{start + len(r.content) - 1}/{len(data)}"


def test_unsatisfiable_range_is_416(client, auth, checkpoint) -> None:
    size = len(FILES["model.safetensors"])
    for header in (f"bytes={size}-", "bytes=-0", "bytes=50-10", "bytes=" + "9" * 5000 + "-"):
        r = client.get(
            f"/v1/checkpoints/{checkpoint['id']}/files/model.safetensors", headers={**auth, "Range": header}
        )
        assert r.status_code == 416, header
        assert (
            r.headers["content-range"] == f"bytes */{size}"
            and r.json()["error"]["code"] == "range_not_satisfiable"
        )


@pytest.mark.parametrize(
    "name", ["../../../etc/passwd", "..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", "nope.bin", "%2E%2E"]
)
def test_traversal_and_unknown_names_are_404(client, auth, checkpoint, name) -> None:
    r = client.get(f"/v1/checkpoints/{checkpoint['id']}/files/{name}", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
