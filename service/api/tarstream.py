"""A tar archive of stored files, streamed on the fly: headers computed up front, bodies read in chunks."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from typing import Any

from service.artifacts import ArtifactStore

_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE

TarPlan = list[tuple[bytes, dict[str, Any]]]


def tar_plan(top: str, files: list[dict[str, Any]], mtime: int) -> tuple[TarPlan, int]:
    """Tar headers for `files` ({name, size}, placed under the directory `top`) and the archive's size."""
    plan, total = [], 0
    for f in sorted(files, key=lambda f: f["name"]):
        info = tarfile.TarInfo(f"{top}/{f['name']}")
        info.size = int(f["size"])
        info.mode = 0o644
        info.mtime = mtime
        header = info.tobuf(format=tarfile.PAX_FORMAT)
        plan.append((header, f))
        total += len(header) + -(-info.size // _BLOCK) * _BLOCK
    total += 2 * _BLOCK
    total += -total % _RECORD
    return plan, total


def tar_stream(store: ArtifactStore, key: str, plan: TarPlan, total: int) -> Iterator[bytes]:
    """The archive's bytes: each file of `plan` read from `{key}/{name}`, exactly its planned size
    (a file still growing, such as a live event file, is cut at the size it had when planned)."""
    sent = 0
    for header, f in plan:
        yield header
        sent += len(header)
        size = 0
        for block in store.iter_range(f"{key}/{f['name']}", 0, int(f["size"])):
            size += len(block)
            yield block
        if size != int(f["size"]):
            # A truncated member would corrupt the archive silently; abort the stream instead.
            raise RuntimeError(f"stored file {f['name']} changed size in the store")
        pad = -size % _BLOCK
        sent += size + pad
        if pad:
            yield b"\0" * pad
    yield b"\0" * (total - sent)
