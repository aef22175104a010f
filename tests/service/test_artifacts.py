"""Artifact store: atomic writes, verified publishing, ranges, key checks (a local dir, fsspec's memory
filesystem, and S3 through s3fs against a local moto server)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from peagle_core.io import sha256_file
from service.artifacts import ArtifactError, ArtifactStore, ArtifactTooLarge, manifest_sha256
from tests.fixtures.servers import free_port


@pytest.fixture(scope="session")
def s3_options() -> Iterator[dict[str, Any]]:
    """fsspec storage options for a moto S3 server on a free local port (the `[dev]` extras)."""
    pytest.importorskip("s3fs", reason="the s3 store test needs the [dev] extras (s3fs)")
    moto_server = pytest.importorskip("moto.server", reason="the s3 store test needs moto[server]")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "eu-west-1"},
        }
    finally:
        server.stop()


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path: Path) -> ArtifactStore:
    if request.param == "local":
        return ArtifactStore(tmp_path / "artifacts")
    if request.param == "s3":
        options = request.getfixturevalue("s3_options")
        bucket = f"peagle-test-{uuid.uuid4().hex[:12]}"
        s3 = ArtifactStore(f"s3://{bucket}", **options)
        s3.fs.mkdir(bucket)
        return ArtifactStore(f"s3://{bucket}/root", **options)
    # memory:// stands in for an object store: no local paths, rename is copy+delete.
    return ArtifactStore(f"memory://peagle-test-{uuid.uuid4().hex}")


def test_write_stream_roundtrip_and_ranges(store: ArtifactStore) -> None:
    data = bytes(range(256)) * 5000
    sha, size = store.write_stream(
        "datasets/ds_1/data.jsonl", (data[i : i + 7000] for i in range(0, len(data), 7000))
    )
    assert size == len(data)
    import hashlib

    assert sha == hashlib.sha256(data).hexdigest()
    assert store.exists("datasets/ds_1/data.jsonl")
    assert store.size("datasets/ds_1/data.jsonl") == len(data)
    with store.open_read("datasets/ds_1/data.jsonl") as f:
        assert f.read() == data
    assert b"".join(store.iter_range("datasets/ds_1/data.jsonl", 10, 20)) == data[10:20]
    assert (
        b"".join(store.iter_range("datasets/ds_1/data.jsonl", 1_000_000, None, chunk=4096))
        == data[1_000_000:]
    )
    assert store.list_files("datasets/ds_1") == ["data.jsonl"]
    store.delete("datasets/ds_1")
    assert not store.exists("datasets/ds_1/data.jsonl")
    store.delete("datasets/ds_1")  # missing is fine


def test_failed_stream_leaves_nothing(store: ArtifactStore) -> None:
    def chunks():
        yield b"a" * 100
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError):
        store.write_stream("datasets/ds_2/data.jsonl", chunks())
    assert not store.exists("datasets/ds_2/data.jsonl")
    assert store.list_files("datasets/ds_2") == []

    with pytest.raises(ArtifactTooLarge) as exc:
        store.write_stream("datasets/ds_3/data.jsonl", [b"x" * 60, b"x" * 60], max_bytes=100)
    assert exc.value.code == "payload_too_large"
    assert not store.exists("datasets/ds_3/data.jsonl")
    assert store.list_files("datasets/ds_3") == []


def test_overwrite_is_all_or_nothing(store: ArtifactStore) -> None:
    store.write_bytes("a/b.txt", b"old")

    def chunks():
        yield b"new-partial"
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.write_stream("a/b.txt", chunks())
    with store.open_read("a/b.txt") as f:
        assert f.read() == b"old"


def test_publish_dir_checksums(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "export"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "model.safetensors").write_bytes(b"\x00\x01" * 10000)
    (src / "sub" / "eval.json").write_text("{}")
    files = store.publish_dir(src, "checkpoints/ckpt_1")
    assert [f["name"] for f in files] == ["config.json", "model.safetensors", "sub/eval.json"]
    for f in files:
        assert f["sha256"] == sha256_file(src / f["name"])
        assert f["size"] == (src / f["name"]).stat().st_size
    assert store.list_files("checkpoints/ckpt_1") == [f["name"] for f in files]
    assert store.verify_files("checkpoints/ckpt_1", files) == []
    assert len(manifest_sha256(files)) == 64
    assert manifest_sha256(list(reversed(files))) == manifest_sha256(files)
    # A tampered file is reported by name.
    store.write_bytes("checkpoints/ckpt_1/config.json", b'{"a": 2}')
    assert store.verify_files("checkpoints/ckpt_1", files) == ["config.json: sha256 mismatch"]


def test_publish_failure_leaves_no_key(store: ArtifactStore, tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "export"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights")
    real = store._sha256_key

    def corrupt(key: str) -> str:  # the remote lost bytes between write and read-back
        return "0" * 64 if key.endswith("model.safetensors") else real(key)

    monkeypatch.setattr(store, "_sha256_key", corrupt)
    with pytest.raises(ArtifactError) as exc:
        store.publish_dir(src, "checkpoints/ckpt_2")
    assert exc.value.code == "checksum_mismatch"
    assert not store.exists("checkpoints/ckpt_2")
    assert store.list_files("checkpoints") == []


@pytest.mark.parametrize("key", ["../x", "/etc/passwd", "a/../../b", "a//b", "", "a\\b"])
def test_bad_keys_refused(store: ArtifactStore, key: str) -> None:
    with pytest.raises(ArtifactError) as exc:
        store.exists(key)
    assert exc.value.code == "invalid_key"


def test_local_path(tmp_path: Path) -> None:
    s = ArtifactStore(tmp_path / "root")
    assert s.local_path("jobs/j/work") == tmp_path / "root" / "jobs" / "j" / "work"
    assert ArtifactStore(f"memory://x-{uuid.uuid4().hex}").local_path("a") is None
    missing = ArtifactStore(tmp_path / "root")
    with pytest.raises(ArtifactError) as exc:
        missing.size("nope/file")
    assert exc.value.code == "not_found"
