"""Building a hidden-state cache from a dataset with a `HiddenStateBackend` (resumable, a shard at a time)
and verifying one shard by shard against its manifest and the dataset's token ids."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from peagle_core.errors import CacheError, StopRequested
from peagle_core.hidden_states.cache import (
    DEFAULT_SHARD_BYTES,
    CacheFingerprint,
    ComputeFn,
    HiddenStateCache,
    TokenDataset,
)
from peagle_core.hidden_states.codec import STORAGE, HiddenRecord, bytes_per_token, decode_rows
from peagle_core.io import sha256_file


@dataclass
class BuildReport:
    """What a build did: samples computed now, samples already cached, shards written."""

    computed: int
    skipped: int
    shards_written: int
    total_samples: int
    total_bytes: int


StopCheck = Callable[[], bool] | None
Computed = Callable[[Sequence[int]], None] | None  # hears the samples each batch or group just computed


def stop_if_asked(should_stop: StopCheck, what: str) -> None:
    """StopRequested(`what`) when `should_stop` says so."""
    if should_stop is not None and should_stop():
        raise StopRequested(what)


class HiddenStateBackend(Protocol):
    """Who computes a cache's hidden states: `name` is what its manifest records (a job's
    `hidden_states.engine`: transformers or vllm); `fill` computes the samples `todo` into `cache`, committing
    a shard per about `shard_bytes`, and returns how many shards it wrote. `should_stop` is asked between
    batches: StopRequested, with the shards committed so far kept; `on_computed` hears each batch's samples
    once computed."""

    name: str

    def fill(self, cache: HiddenStateCache, dataset: TokenDataset, todo: Sequence[int], *, batch_size: int,
             shard_bytes: int, should_stop: StopCheck = None, on_computed: Computed = None) -> int: ...  # fmt: skip


@dataclass
class ComputeBackend:
    """A `HiddenStateBackend` from a `ComputeFn` (the in-process verifier's `VerifierCompute`, or any function
    of sample indices): `compute(indices)` on batches of `batch_size`, buffered into shards in this process."""

    compute: ComputeFn
    name: str = "transformers"

    def fill(self, cache: HiddenStateCache, dataset: TokenDataset, todo: Sequence[int], *, batch_size: int,
             shard_bytes: int, should_stop: StopCheck = None, on_computed: Computed = None) -> int:  # fmt: skip
        dtype, shards = cache.dtype, 0
        buffer: list[tuple[int, HiddenRecord, torch.Tensor]] = []
        buffered = 0
        for start in range(0, len(todo), batch_size):
            if should_stop is not None and should_stop():
                if buffer:  # what was computed is kept: the next attempt resumes after it
                    shards += cache.write_shard(buffer) is not None
                raise StopRequested(f"hidden-state build stopped after {shards} new shard(s)")
            group = todo[start : start + batch_size]
            records = self.compute(group)
            if len(records) != len(group):
                raise CacheError(f"compute returned {len(records)} records for {len(group)} samples")
            for i, rec in zip(group, records, strict=True):
                ids = dataset[i][0]
                buffer.append((i, rec, ids))
                buffered += rec.num_tokens * bytes_per_token(dtype, rec.aux.shape[1], rec.last.shape[1])
            if buffered >= shard_bytes:
                shards += cache.write_shard(buffer) is not None
                buffer, buffered = [], 0
            if on_computed is not None:
                on_computed(group)
        if buffer:
            shards += cache.write_shard(buffer) is not None
        return shards


def build_cache(
    cache_dir: str | Path,
    dataset: TokenDataset,
    backend: HiddenStateBackend,
    fingerprint: CacheFingerprint,
    *,
    dtype: str = "bf16",
    batch_size: int = 8,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    dataset_dir: str | None = None,
    should_stop: StopCheck = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> BuildReport:
    """Fill the cache with every sample of `dataset`, computing missing ones with `backend`
    (`ComputeBackend(compute)` in this process, `peagle_core.hidden_states.backends.VllmBackend` through
    vLLM; `backends.open_backend` picks one by name).

    Resumable: cached samples are skipped and a shard is committed (file renamed, then manifest
    replaced) once about `shard_bytes` are computed, so an interrupted build loses at most one shard's
    work and a second run of a finished build computes nothing. `should_stop` is asked between batches
    (StopRequested, the committed shards kept). `on_progress(done, total)` hears the dataset's tokens with
    hidden states so far (those already cached included) after each batch or group, and once at the start.
    """
    if batch_size < 1:
        raise CacheError("batch_size must be >= 1", param="batch_size")
    cache = HiddenStateCache.create(
        cache_dir,
        fingerprint,
        dtype=dtype,
        num_dataset_samples=len(dataset),
        dataset_dir=dataset_dir,
        backend=backend.name,
    )
    todo = [i for i in range(len(dataset)) if i not in cache]
    on_computed = None
    if on_progress is not None:
        tokens = dataset.lengths
        total = sum(tokens)
        done = total - sum(tokens[i] for i in todo)
        on_progress(done, total)

        def on_computed(indices: Sequence[int]) -> None:
            nonlocal done
            done += sum(tokens[i] for i in indices)
            on_progress(done, total)

    shards = backend.fill(
        cache, dataset, todo, batch_size=batch_size, shard_bytes=shard_bytes, should_stop=should_stop,
        on_computed=on_computed,
    )  # fmt: skip
    return BuildReport(len(todo), len(dataset) - len(todo), shards, len(cache), cache.total_bytes)


def verify_cache(cache_dir: str | Path, dataset: TokenDataset | None = None) -> list[str]:
    """Check every shard (checksum, tensor names/shapes/dtypes, offsets, finite values, token ids).

    Returns one problem per line, each naming its shard (empty when the cache is sound). Token ids are
    compared with `dataset` when given, which must also be the dataset the cache was built for.
    """
    path = Path(cache_dir)
    cache = HiddenStateCache.open(path)
    problems: list[str] = []
    if dataset is not None and dataset.fingerprint != cache.fingerprint.dataset:
        return [
            f"{path}: built for other data (cache: {cache.fingerprint.dataset[:12]}, "
            f"given: {dataset.fingerprint[:12]})"
        ]
    aux_dim, last_dim = cache.manifest.get("aux_dim"), cache.manifest.get("last_dim")
    storage = STORAGE[cache.dtype]
    for name, meta in sorted(cache.shards.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name}: missing")
            continue
        actual = sha256_file(file)
        if actual != meta["sha256"]:
            problems.append(f"{name}: sha256 mismatch (file {actual[:12]}, manifest {meta['sha256'][:12]})")
            continue
        try:
            problems += [
                f"{name}: {p}"
                for p in _check_shard(file, meta, cache.dtype, storage, aux_dim, last_dim, dataset)
            ]
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            problems.append(f"{name}: unreadable ({exc})")
    n = cache.manifest.get("num_dataset_samples")
    if n is not None and dataset is not None and n != len(dataset):
        problems.append(f"{path}: manifest counts {n} dataset samples, the dataset has {len(dataset)}")
    return problems


def _check_shard(
    file: Path,
    meta: dict[str, Any],
    dtype: str,
    storage: torch.dtype,
    aux_dim: int | None,
    last_dim: int | None,
    dataset: TokenDataset | None,
) -> list[str]:
    out: list[str] = []
    offsets = meta["offsets"]
    rows = offsets[-1]
    expect = {
        "aux": ((rows, aux_dim), storage),
        "last": ((rows, last_dim), storage),
        "input_ids": ((rows,), torch.int32),
        "sample_indices": ((len(meta["samples"]),), torch.int64),
        "offsets": ((len(offsets),), torch.int64),
    }
    if dtype == "fp8":
        expect["aux_scale"] = ((rows,), torch.float32)
        expect["last_scale"] = ((rows,), torch.float32)
    with safe_open(str(file), framework="pt") as f:
        keys = set(f.keys())
        if keys != set(expect):
            return [f"tensors {sorted(keys)} != expected {sorted(expect)}"]
        t = {k: f.get_tensor(k) for k in keys}
    for k, (shape, dt) in expect.items():
        if tuple(t[k].shape) != shape or t[k].dtype != dt:
            out.append(f"{k} is {t[k].dtype} {list(t[k].shape)}, expected {dt} {list(shape)}")
    if out:
        return out
    if t["sample_indices"].tolist() != meta["samples"] or t["offsets"].tolist() != offsets:
        out.append("sample indices/offsets differ from the manifest")
    for k in ("aux", "last"):
        scale = t.get(f"{k}_scale")
        if not torch.isfinite(decode_rows(t[k], scale)).all():
            out.append(f"{k} has non-finite values")
    if dataset is not None:
        for k, i in enumerate(meta["samples"]):
            if not 0 <= i < len(dataset):
                out.append(f"sample {i} is outside the dataset (0..{len(dataset) - 1})")
                continue
            ids = dataset[i][0].reshape(-1).long()
            got = t["input_ids"][offsets[k] : offsets[k + 1]].long()
            if not torch.equal(ids, got):
                out.append(f"sample {i}: token ids differ from the dataset")
    return out
