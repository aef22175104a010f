"""The hidden-state cache: sharded safetensors keyed by a (verifier, layers, dataset) fingerprint.

A cache directory holds `manifest.json` and `shard-NNNNN.safetensors` files. Each shard concatenates
its samples' rows (`aux [N,3H]`, `last [N,H]`, `input_ids [N]`, plus per-row scales for fp8); the
manifest lists every shard's samples, row offsets, byte size and sha256. Shards are written under a
temporary name and renamed; the manifest is rewritten atomically after each shard, so a build killed at
any point resumes from the last whole shard.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from peagle_core.errors import CacheError
from peagle_core.hidden_states.codec import DTYPES, HiddenRecord, decode_rows, encode_rows
from peagle_core.io import atomic_write_json, sha256_file
from peagle_core.keys import content_key

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
CACHE_MANIFEST = "manifest.json"
LOCK = ".lock"
DEFAULT_SHARD_BYTES = 128 << 20


class CacheMissError(CacheError):
    """A sample the cache does not hold."""

    code = "cache_miss"


class CacheCorruptError(CacheError):
    """A shard whose bytes, tensors or token ids do not match the manifest; `shard` names it."""

    code = "cache_corrupt"

    def __init__(self, message: str, *, shard: str):
        super().__init__(message, param=shard)
        self.shard = shard


class CacheMismatchError(CacheError):
    """A cache built for another verifier, other layers, other data or another dtype."""

    code = "cache_mismatch"


class TokenDataset(Protocol):
    """What the cache needs from a prepared dataset: `len`, `ds[i] -> (input_ids, loss_mask)`, each sample's
    token count (`lengths`, without reading the sample) and the fingerprint."""

    fingerprint: str
    lengths: Sequence[int]

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


ComputeFn = Callable[[list[int]], list[HiddenRecord]]


# --- fingerprint ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheFingerprint:
    """What a cache's contents depend on; two caches with equal keys hold the same hidden states."""

    verifier: str
    layer_ids: tuple[int, ...]
    dataset: str

    @property
    def key(self) -> str:
        return content_key(self.verifier, list(self.layer_ids), self.dataset)

    @classmethod
    def of(cls, verifier: Any, dataset: TokenDataset) -> CacheFingerprint:
        """The fingerprint for `verifier` (a peagle_core.hidden_states.verifier.Verifier, whose `fingerprint` is
        `peagle_core.keys.verifier_fingerprint`) over `dataset`."""
        return cls(str(verifier.fingerprint), tuple(int(i) for i in verifier.layer_ids), dataset.fingerprint)

    def to_json(self) -> dict[str, Any]:
        return {
            "verifier": self.verifier,
            "layer_ids": list(self.layer_ids),
            "dataset": self.dataset,
            "key": self.key,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CacheFingerprint:
        return cls(str(d["verifier"]), tuple(int(i) for i in d["layer_ids"]), str(d["dataset"]))

    def differences(self, other: CacheFingerprint) -> list[str]:
        """Human-readable reasons why a cache built for `self` cannot serve `other`."""
        out = []
        if self.verifier != other.verifier:
            out.append(f"another verifier (cache: {self.verifier[:12]}, requested: {other.verifier[:12]})")
        if self.layer_ids != other.layer_ids:
            out.append(f"other layer ids (cache: {list(self.layer_ids)}, requested: {list(other.layer_ids)})")
        if self.dataset != other.dataset:
            out.append(f"other data (cache: {self.dataset[:12]}, requested: {other.dataset[:12]})")
        return out


# --- the cache -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    shard: str
    offset: int
    length: int


def _shard_name(n: int) -> str:
    return f"shard-{n:05d}.safetensors"


class HiddenStateCache:
    """A cache directory: read samples by index, and (as a writer) append or rewrite whole shards.

    Readers take no lock: they see the manifest as of `open`/`refresh`, and shards are only ever
    replaced by rename. Writers serialise on an flock and re-read the manifest under it, so several
    processes (DDP ranks, a second build) can add shards to the same directory safely.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], *, max_open_shards: int = 8):
        self.path = path
        self._manifest = manifest
        self._index: dict[int, _Entry] = {}
        self._open: OrderedDict[str, Any] = OrderedDict()
        self._verified: set[tuple[str, str]] = set()
        self._max_open = max_open_shards
        self._manifest_stat: tuple[int, int] | None = None
        self._reindex()

    # construction

    @classmethod
    def open(
        cls,
        path: str | Path,
        fingerprint: CacheFingerprint | None = None,
        *,
        dataset_fingerprint: str | None = None,
    ) -> HiddenStateCache:
        """Open an existing cache, refusing one built for another fingerprint (or dataset, if given)."""
        path = Path(path)
        if not (path / CACHE_MANIFEST).is_file():
            raise CacheMissError(
                f"no hidden-state cache at {path} (missing {CACHE_MANIFEST})", param=str(path)
            )
        cache = cls(path, _read_manifest(path))
        cache._check(fingerprint, dataset_fingerprint)
        return cache

    @classmethod
    def create(
        cls,
        path: str | Path,
        fingerprint: CacheFingerprint,
        *,
        dtype: str = "bf16",
        num_dataset_samples: int | None = None,
        dataset_dir: str | None = None,
        backend: str = "transformers",
    ) -> HiddenStateCache:
        """Open the cache at `path` for writing, creating it if absent.

        An existing cache must match `fingerprint` and `dtype` exactly; it is resumed, never overwritten.
        `backend` records who computes its states (a new cache only; the manifest's `engine`), so later misses
        use the same one.
        """
        if dtype not in DTYPES:
            raise CacheError(f"unknown cache dtype {dtype!r}; use one of {', '.join(DTYPES)}", param="dtype")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            if (path / CACHE_MANIFEST).is_file():
                cache = cls(path, _read_manifest(path))
                cache._check(fingerprint, None)
                if cache.dtype != dtype:
                    raise CacheMismatchError(
                        f"cache at {path} stores {cache.dtype}, not {dtype}; use its dtype or another directory",
                        param="dtype",
                    )
                return cache
            manifest = {
                "format_version": CACHE_FORMAT_VERSION,
                "fingerprint": fingerprint.to_json(),
                "dtype": dtype,
                "aux_dim": None,
                "last_dim": None,
                "num_dataset_samples": num_dataset_samples,
                "dataset_dir": dataset_dir,
                "engine": backend,
                "shards": {},
            }
            atomic_write_json(path / CACHE_MANIFEST, manifest)
            return cls(path, manifest)

    def _check(self, fingerprint: CacheFingerprint | None, dataset_fingerprint: str | None) -> None:
        ours = self.fingerprint
        if fingerprint is not None:
            diffs = ours.differences(fingerprint)
            if diffs:
                raise CacheMismatchError(
                    f"hidden-state cache at {self.path} was built for " + " and ".join(diffs),
                    param=str(self.path),
                )
        if dataset_fingerprint is not None and dataset_fingerprint != ours.dataset:
            raise CacheMismatchError(
                f"hidden-state cache at {self.path} was built for other data "
                f"(cache: {ours.dataset[:12]}, requested: {dataset_fingerprint[:12]})",
                param=str(self.path),
            )

    # manifest views

    @property
    def manifest(self) -> dict[str, Any]:
        return self._manifest

    @property
    def fingerprint(self) -> CacheFingerprint:
        return CacheFingerprint.from_json(self._manifest["fingerprint"])

    @property
    def dtype(self) -> str:
        return self._manifest["dtype"]

    @property
    def backend(self) -> str:
        """The hidden-state backend that built this cache (the manifest's `engine`; caches older than the
        field: transformers)."""
        return self._manifest.get("engine", "transformers")

    @property
    def shards(self) -> dict[str, dict[str, Any]]:
        return self._manifest["shards"]

    @property
    def total_bytes(self) -> int:
        return sum(s["bytes"] for s in self.shards.values())

    @property
    def num_tokens(self) -> int:
        return sum(e.length for e in self._index.values())

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, index: int) -> bool:
        return index in self._index

    def indices(self) -> list[int]:
        return sorted(self._index)

    def shard_of(self, index: int) -> str:
        return self._entry(index).shard

    def is_complete(self) -> bool:
        n = self._manifest.get("num_dataset_samples")
        return n is not None and all(i in self._index for i in range(n))

    def _reindex(self) -> None:
        index = {}
        for name, shard in self.shards.items():
            offs = shard["offsets"]
            for k, i in enumerate(shard["samples"]):
                index[int(i)] = _Entry(name, offs[k], offs[k + 1] - offs[k])
        self._index = index
        with contextlib.suppress(OSError):
            st = (self.path / CACHE_MANIFEST).stat()
            self._manifest_stat = (st.st_mtime_ns, st.st_ino)

    def refresh(self) -> bool:
        """Re-read the manifest if another writer replaced it; True if it changed."""
        try:
            st = (self.path / CACHE_MANIFEST).stat()
        except OSError:
            return False
        if (st.st_mtime_ns, st.st_ino) == self._manifest_stat:
            return False
        self._manifest = _read_manifest(self.path)
        self._reindex()
        return True

    # reading

    def _entry(self, index: int) -> _Entry:
        try:
            return self._index[index]
        except KeyError:
            raise CacheMissError(
                f"sample {index} is not in the hidden-state cache at {self.path}", param=str(index)
            ) from None

    def _handle(self, name: str) -> Any:
        """An mmap'd safe_open handle for a shard, checksum-verified the first time this process opens it."""
        meta = self.shards[name]
        key = f"{name}:{meta['sha256']}"
        h = self._open.get(key)
        if h is not None:
            self._open.move_to_end(key)
            return h
        path = self.path / name
        if (name, meta["sha256"]) not in self._verified:
            if not path.is_file():
                raise CacheCorruptError(f"shard {name} of cache {self.path} is missing", shard=name)
            actual = sha256_file(path)
            if actual != meta["sha256"]:
                raise CacheCorruptError(
                    f"shard {name} of cache {self.path} is corrupt: sha256 {actual[:12]} != "
                    f"manifest {meta['sha256'][:12]}",
                    shard=name,
                )
            self._verified.add((name, meta["sha256"]))
        try:
            h = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise CacheCorruptError(
                f"shard {name} of cache {self.path} is unreadable: {exc}", shard=name
            ) from None
        self._open[key] = h
        while len(self._open) > self._max_open:
            self._open.popitem(last=False)
        return h

    def read(self, index: int, expected_ids: torch.Tensor | None = None) -> HiddenRecord:
        """Sample `index` as fp32 tensors; `expected_ids` (the dataset's tokens) are checked if given."""
        e = self._entry(index)
        h = self._handle(e.shard)
        lo, hi = e.offset, e.offset + e.length
        try:
            aux = h.get_slice("aux")[lo:hi]
            last = h.get_slice("last")[lo:hi]
            aux_scale = last_scale = None
            if self.dtype == "fp8":
                aux_scale = h.get_slice("aux_scale")[lo:hi]
                last_scale = h.get_slice("last_scale")[lo:hi]
            ids = h.get_slice("input_ids")[lo:hi] if expected_ids is not None else None
        except (SafetensorError, KeyError, ValueError, RuntimeError) as exc:
            raise CacheCorruptError(
                f"sample {index}: shard {e.shard} of cache {self.path} is unreadable: {exc}", shard=e.shard
            ) from None
        if ids is not None and not torch.equal(ids.long(), expected_ids.long().reshape(-1)):
            raise CacheCorruptError(
                f"sample {index}: shard {e.shard} of cache {self.path} holds other token ids than the dataset",
                shard=e.shard,
            )
        return HiddenRecord(decode_rows(aux, aux_scale), decode_rows(last, last_scale))

    # writing

    def write_shard(
        self,
        items: Sequence[tuple[int, HiddenRecord, torch.Tensor]],
        *,
        name: str | None = None,
    ) -> str | None:
        """Write `(index, record, input_ids)` items as one shard and add it to the manifest, atomically.

        With `name`, that shard is rewritten (a repair) with the given samples. Without, samples that
        another writer has meanwhile cached are dropped and the rest go to a new shard. Returns the
        shard's name, or None when nothing was left to write.
        """
        with _locked(self.path):
            self._manifest = _read_manifest(self.path)
            self._reindex()
            if name is None:
                items = [it for it in items if it[0] not in self._index]
                if not items:
                    return None
                used = [int(n[6:11]) for n in self.shards]
                name = _shard_name(max(used, default=-1) + 1)
            else:
                mine = {int(i) for i in self.shards.get(name, {}).get("samples", [])}
                items = [it for it in items if it[0] in mine or it[0] not in self._index]
            _remove_stale_temps(self.path)
            meta = self._write_shard_file(name, items)
            self._manifest["shards"][name] = meta
            if self._manifest["aux_dim"] is None:
                self._manifest["aux_dim"] = int(items[0][1].aux.shape[1])
                self._manifest["last_dim"] = int(items[0][1].last.shape[1])
            atomic_write_json(self.path / CACHE_MANIFEST, self._manifest)
            self._reindex()
            self._open = OrderedDict((k, v) for k, v in self._open.items() if not k.startswith(name + ":"))
            self._verified.add((name, meta["sha256"]))
            return name

    def _write_shard_file(self, name: str, items: Sequence[tuple[int, HiddenRecord, torch.Tensor]]) -> dict:
        aux_dim = self._manifest.get("aux_dim")
        last_dim = self._manifest.get("last_dim")
        offsets = [0]
        for idx, rec, ids in items:
            n = rec.aux.shape[0]
            if rec.last.shape[0] != n or ids.numel() != n:
                raise CacheError(
                    f"sample {idx}: aux has {n} rows, last {rec.last.shape[0]}, input_ids {ids.numel()}"
                )
            if aux_dim is not None and (rec.aux.shape[1] != aux_dim or rec.last.shape[1] != last_dim):
                raise CacheError(
                    f"sample {idx}: hidden sizes {rec.aux.shape[1]}/{rec.last.shape[1]} do not match the "
                    f"cache's {aux_dim}/{last_dim}"
                )
            offsets.append(offsets[-1] + n)
        aux, aux_scale = encode_rows(torch.cat([r.aux for _, r, _ in items]), self.dtype)
        last, last_scale = encode_rows(torch.cat([r.last for _, r, _ in items]), self.dtype)
        tensors = {
            "aux": aux,
            "last": last,
            "input_ids": torch.cat([ids.reshape(-1) for _, _, ids in items]).to(torch.int32),
            "sample_indices": torch.tensor([i for i, _, _ in items], dtype=torch.int64),
            "offsets": torch.tensor(offsets, dtype=torch.int64),
        }
        if aux_scale is not None:
            tensors["aux_scale"] = aux_scale
            tensors["last_scale"] = last_scale
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=self.path)
        os.close(fd)
        try:
            # One metadata key: safetensors keeps metadata in a hash map whose order varies per process,
            # and shards must be byte-identical across runs so a resumed build equals a one-shot one.
            meta_json = json.dumps(
                {"format_version": CACHE_FORMAT_VERSION, "dtype": self.dtype}, sort_keys=True
            )
            save_file(tensors, tmp, metadata={"peagle_cache": meta_json})
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            sha = sha256_file(tmp)
            size = os.path.getsize(tmp)
            os.replace(tmp, self.path / name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return {
            "sha256": sha,
            "bytes": size,
            "samples": [int(i) for i, _, _ in items],
            "offsets": offsets,
        }


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        m = json.loads((path / CACHE_MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CacheError(f"cannot read {path / CACHE_MANIFEST}: {exc}", param=str(path)) from None
    if m.get("format_version") != CACHE_FORMAT_VERSION:
        raise CacheError(
            f"{path / CACHE_MANIFEST}: unsupported format_version {m.get('format_version')!r} "
            f"(this build reads {CACHE_FORMAT_VERSION})",
            param=str(path),
        )
    return m


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path / LOCK, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_stale_temps(path: Path) -> None:
    # Called under the writer lock, so no live writer owns these: they are leftovers of a killed build.
    for tmp in path.glob(".shard-*.tmp-*"):
        with contextlib.suppress(OSError):
            tmp.unlink()
