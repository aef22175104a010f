"""Artifact store: datasets, training work dirs and published checkpoints under one fsspec root URI.

A local directory by default, any fsspec filesystem (s3:// via s3fs) when several machines share work.
Every write lands under a temporary key and is renamed into place only when complete and verified,
so a reader (or a DB row inserted afterwards) never sees a partial artifact. No torch import here.

Key layout: `datasets/<ds_id>/data.jsonl`, `jobs/<job_id>/work/...`, `checkpoints/<ckpt_id>/...`, and
each project's reusable stage outputs `projects/<project_id>/{regenerated,prepared,caches}/<stage key>/...`
(`peagle_core.pipeline.stages`; this class is its `Store`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, TypedDict

import fsspec
from fsspec.implementations.local import LocalFileSystem

from peagle_core.errors import PeagleError

CHUNK = 1 << 20


class FileEntry(TypedDict):
    name: str
    size: int
    sha256: str


class ArtifactError(PeagleError):
    """An artifact that is missing, too large, or failed checksum verification."""

    code = "artifact_error"


class ArtifactTooLarge(ArtifactError):
    code = "payload_too_large"


def manifest_sha256(files: list[FileEntry]) -> str:
    """The checksum of a published directory: sha256 of its canonical file list (names, sizes, hashes)."""
    canon = sorted(
        ({"name": f["name"], "size": f["size"], "sha256": f["sha256"]} for f in files),
        key=lambda f: f["name"],
    )
    return hashlib.sha256(json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_key(key: str) -> str:
    # Keys come from our own ids, but a file name from a URL can reach `files/{name}`: refuse escapes.
    parts = key.split("/")
    if not key or key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise ArtifactError(f"invalid artifact key {key!r}", code="invalid_key", param="key")
    return key


class ArtifactStore:
    """Keys are relative POSIX paths (`checkpoints/ckpt_x/model.safetensors`) under `root_uri`."""

    def __init__(self, root_uri: str | os.PathLike[str], **storage_options: Any):
        self.root_uri = str(root_uri)
        self._storage_options = storage_options
        self.fs, root = fsspec.core.url_to_fs(self.root_uri, **storage_options)
        self.root = root.rstrip("/")
        self.is_local = isinstance(self.fs, LocalFileSystem)
        if self.is_local:
            Path(self.root).mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"ArtifactStore({self.root_uri!r})"

    def scoped(self, prefix: str) -> ArtifactStore:
        """The store of the keys under `prefix` (a project's own stage outputs: `projects/<id>`)."""
        return ArtifactStore(posixpath.join(self.root_uri, _check_key(prefix)), **self._storage_options)

    def _path(self, key: str) -> str:
        return posixpath.join(self.root, _check_key(key))

    def _tmp_key(self, key: str) -> str:
        head, tail = posixpath.split(key)
        return posixpath.join(head, f".{tail}.tmp-{uuid.uuid4().hex[:12]}")

    # -- reading -----------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key))

    def size(self, key: str) -> int:
        """Size in bytes of a file key; raises ArtifactError(code="not_found") when missing."""
        try:
            return int(self.fs.size(self._path(key)))
        except FileNotFoundError:
            raise ArtifactError(f"artifact {key} not found", code="not_found", param="key") from None

    def size_under(self, key: str) -> int:
        """Bytes of every file under `key` (a file or a directory); 0 when it does not exist."""
        path = self._path(key)
        if not self.fs.exists(path):
            return 0
        return int(self.fs.du(path, total=True))

    def open_read(self, key: str) -> IO[bytes]:
        try:
            return self.fs.open(self._path(key), "rb")
        except FileNotFoundError:
            raise ArtifactError(f"artifact {key} not found", code="not_found", param="key") from None

    def iter_range(
        self, key: str, start: int = 0, end: int | None = None, chunk: int = CHUNK
    ) -> Iterator[bytes]:
        """Yield bytes [start, end) of a file (end exclusive, None = to the end): HTTP Range `a-b` is (a, b+1)."""
        with self.open_read(key) as f:
            f.seek(start)
            remaining = None if end is None else max(0, end - start)
            while remaining is None or remaining > 0:
                block = f.read(chunk if remaining is None else min(chunk, remaining))
                if not block:
                    return
                if remaining is not None:
                    remaining -= len(block)
                yield block

    def list_files(self, key: str) -> list[str]:
        """Relative names of every file under a directory key, sorted; [] when it does not exist."""
        base = self._path(key)
        if not self.fs.exists(base):
            return []
        out = []
        for path in self.fs.find(base):
            rel = posixpath.relpath(self.fs._strip_protocol(path), self.fs._strip_protocol(base))
            if not any(p.startswith(".") and ".tmp-" in p for p in rel.split("/")):
                out.append(rel)
        return sorted(out)

    def local_path(self, key: str) -> Path | None:
        """The filesystem path of `key` for a local store (it may not exist yet), else None."""
        return Path(self._path(key)) if self.is_local else None

    def fetch_file(self, key: str, dest: str | os.PathLike[str]) -> Path:
        """Copy a file key to a local path (atomically); returns the path."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with self.open_read(key) as src, open(tmp, "wb") as out:
                while block := src.read(CHUNK):
                    out.write(block)
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        return dest

    def fetch_dir(self, key: str, dest: str | os.PathLike[str]) -> Path:
        """Copy every file under a directory key into a local directory."""
        dest = Path(dest)
        for name in self.list_files(key):
            self.fetch_file(f"{key}/{name}", dest / name)
        return dest

    # -- writing -----------------------------------------------------------------------------------

    def write_stream(
        self, key: str, chunks: Iterable[bytes], *, max_bytes: int | None = None
    ) -> tuple[str, int]:
        """Write a file from byte chunks; returns (sha256 hex, size). Nothing appears at `key` unless complete.

        Raises ArtifactTooLarge (leaving nothing behind) once more than `max_bytes` arrive.
        """
        final = self._path(key)
        tmp = self._path(self._tmp_key(key))
        h, size = hashlib.sha256(), 0
        self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as f:
                for block in chunks:
                    size += len(block)
                    if max_bytes is not None and size > max_bytes:
                        raise ArtifactTooLarge(f"upload exceeds the limit of {max_bytes} bytes", param="file")
                    h.update(block)
                    f.write(block)
                if self.is_local:
                    f.flush()
                    os.fsync(f.fileno())
            self._rename(tmp, final)
        except BaseException:
            self._remove(tmp)
            raise
        return h.hexdigest(), size

    def write_bytes(self, key: str, data: bytes) -> tuple[str, int]:
        return self.write_stream(key, [data])

    def publish_dir(self, local_dir: str | os.PathLike[str], key: str) -> list[FileEntry]:
        """Publish a local directory at `key`: copy under a temporary key, verify every sha256, rename.

        Returns the file list ({name, size, sha256}, sorted by name). Only after this returns may the
        caller insert the DB row that points at `key`; a crash before leaves at most a hidden temp key.
        """
        src = Path(local_dir)
        if not src.is_dir():
            raise ArtifactError(f"{src} is not a directory", code="not_found", param="local_dir")
        names = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
        tmp_key = self._tmp_key(key)
        files: list[FileEntry] = []
        try:
            for name in names:
                sha, size = self._copy_in(src / name, f"{tmp_key}/{name}")
                files.append({"name": name, "size": size, "sha256": sha})
            # Read back what landed: the source may have changed under us, or the remote may have lost bytes.
            for entry in files:
                got = self._sha256_key(f"{tmp_key}/{entry['name']}")
                if got != entry["sha256"]:
                    raise ArtifactError(
                        f"checksum mismatch publishing {entry['name']} to {key}", code="checksum_mismatch"
                    )
            self._replace_dir(self._path(tmp_key), self._path(key))
        except BaseException:
            self._remove(self._path(tmp_key))
            raise
        return files

    def verify_files(self, key: str, files: list[FileEntry]) -> list[str]:
        """Problems with a published directory against its recorded file list (empty when intact)."""
        problems = []
        for entry in files:
            sub = f"{key}/{entry['name']}"
            if not self.exists(sub):
                problems.append(f"{entry['name']}: missing")
            elif self.size(sub) != entry["size"]:
                problems.append(f"{entry['name']}: size {self.size(sub)} != {entry['size']}")
            elif self._sha256_key(sub) != entry["sha256"]:
                problems.append(f"{entry['name']}: sha256 mismatch")
        return problems

    def delete(self, key: str) -> None:
        """Remove a file or directory key; a missing key is not an error."""
        self._remove(self._path(key))

    # -- internals ---------------------------------------------------------------------------------

    def _copy_in(self, src: Path, key: str) -> tuple[str, int]:
        def chunks() -> Iterator[bytes]:
            with open(src, "rb") as f:
                while block := f.read(CHUNK):
                    yield block

        h, size = hashlib.sha256(), 0
        dest = self._path(key)
        self.fs.makedirs(posixpath.dirname(dest), exist_ok=True)
        with self.fs.open(dest, "wb") as f:
            for block in chunks():
                h.update(block)
                size += len(block)
                f.write(block)
            if self.is_local:
                f.flush()
                os.fsync(f.fileno())
        return h.hexdigest(), size

    def _sha256_key(self, key: str) -> str:
        h = hashlib.sha256()
        with self.open_read(key) as f:
            while block := f.read(CHUNK):
                h.update(block)
        return h.hexdigest()

    def _rename(self, src: str, dest: str) -> None:
        if self.is_local:
            os.replace(src, dest)
        else:
            self.fs.mv(src, dest)

    def _replace_dir(self, src: str, dest: str) -> None:
        if self.fs.exists(dest):
            old = f"{dest}.old-{uuid.uuid4().hex[:8]}"
            self._rename_dir(dest, old)
            self._rename_dir(src, dest)
            self._remove(old)
        else:
            self._rename_dir(src, dest)

    def _rename_dir(self, src: str, dest: str) -> None:
        if self.is_local:
            os.replace(src, dest)
        else:
            # Object stores have no directory rename: copy then delete. The DB row is inserted only after
            # this returns, so readers never follow a row to a half-moved prefix. File by file, because a
            # recursive `mv` also tries to copy the implied sub-"directories", which S3 does not have.
            base = self.fs._strip_protocol(src)
            for path in self.fs.find(src):
                rel = posixpath.relpath(self.fs._strip_protocol(path), base)
                self.fs.copy(path, posixpath.join(dest, rel))
            self.fs.rm(src, recursive=True)

    def _remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if self.fs.isdir(path):
                self.fs.rm(path, recursive=True)
            elif self.fs.exists(path):
                self.fs.rm(path)
