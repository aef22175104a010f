"""Hidden-state sources (offline cache, online verifier, hybrid of both) and the prefetching BatchLoader.

All three sources answer `fetch(indices) -> list[HiddenRecord]` (fp32, CPU, unaligned); the trainer
picks one with `peagle_core.hidden_states.backends.make_source(spec.hidden_states.mode, ...)` and never
cares which.
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from peagle_core.hidden_states.cache import (
    DEFAULT_SHARD_BYTES,
    CacheCorruptError,
    CacheError,
    CacheFingerprint,
    ComputeFn,
    HiddenStateCache,
    TokenDataset,
)
from peagle_core.hidden_states.codec import HiddenRecord, bytes_per_token, quantize
from peagle_core.hidden_states.compile_guard import outside_compiles

__all__ = [
    "BatchLoader",
    "HiddenRecord",
    "HiddenStateSource",
    "HybridSource",
    "OfflineSource",
    "OnlineSource",
    "VerifierCompute",
]

log = logging.getLogger(__name__)

VerifierFactory = Callable[[], Any]


class VerifierCompute:
    """Computes records with the verifier: one right-padded batch (attention_mask) per call.

    The verifier is loaded on first use, so building this costs nothing when every sample is cached.
    """

    def __init__(self, dataset: TokenDataset, verifier_factory: VerifierFactory, pad_token_id: int = 0):
        self.dataset = dataset
        self._factory = verifier_factory
        self._verifier: Any = None
        self.pad_token_id = pad_token_id
        self.calls = 0

    @property
    def verifier(self) -> Any:
        if self._verifier is None:
            self._verifier = self._factory()
        return self._verifier

    def __call__(self, indices: Sequence[int]) -> list[HiddenRecord]:
        if not indices:
            return []
        seqs = [self.dataset[i][0].reshape(-1) for i in indices]
        width = max(s.numel() for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, : s.numel()] = s
            mask[row, : s.numel()] = 1
        # This runs on the loader's thread while the trainer's may be compiling (compile_guard).
        with outside_compiles():
            aux, last = self.verifier.hidden_states(ids, attention_mask=mask)
        self.calls += 1
        aux, last = aux.float().cpu(), last.float().cpu()
        return [
            HiddenRecord(aux[r, : s.numel()].clone(), last[r, : s.numel()].clone())
            for r, s in enumerate(seqs)
        ]


COUNTERS = ("verifier_calls", "cache_hits", "cache_misses")


class HiddenStateSource(ABC):
    """Where hidden states come from. `fetch` is called from one thread at a time (the loader's)."""

    verifier_calls: int = 0

    @abstractmethod
    def fetch(self, indices: Sequence[int]) -> list[HiddenRecord]:
        """Records for `indices`, in order."""

    def flush(self) -> None:
        """Make anything buffered durable (hybrid write-back); a no-op elsewhere."""
        return None

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> HiddenStateSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        return {"verifier_calls": self.verifier_calls}

    def counters(self) -> dict[str, int]:
        """The running `COUNTERS` under one naming for every mode: a cache miss is a sample the hybrid
        source computed; offline reads count as hits."""
        stats = self.stats()
        return {
            "verifier_calls": int(stats.get("verifier_calls", 0)),
            "cache_hits": int(stats.get("cache_hits", stats.get("cache_reads", 0))),
            "cache_misses": int(stats.get("computed", 0)),
        }


class OfflineSource(HiddenStateSource):
    """Reads everything from a cache; a missing or corrupt sample is a CacheError naming it."""

    def __init__(self, dataset: TokenDataset, cache: HiddenStateCache, *, check_token_ids: bool = True):
        self.dataset = dataset
        self.cache = cache
        self.check_token_ids = check_token_ids
        self.reads = 0

    def fetch(self, indices: Sequence[int]) -> list[HiddenRecord]:
        out = []
        for i in indices:
            ids = self.dataset[i][0] if self.check_token_ids else None
            out.append(self.cache.read(i, expected_ids=ids))
        self.reads += len(out)
        return out

    def stats(self) -> dict[str, int]:
        return {"verifier_calls": 0, "cache_reads": self.reads}


class OnlineSource(HiddenStateSource):
    """Runs the verifier on every fetch (or `compute`, e.g. the vLLM engine's)."""

    def __init__(
        self,
        dataset: TokenDataset,
        verifier_factory: VerifierFactory,
        pad_token_id: int = 0,
        compute: ComputeFn | None = None,
    ):
        self.compute = compute or VerifierCompute(dataset, verifier_factory, pad_token_id)

    @property
    def verifier_calls(self) -> int:  # type: ignore[override]
        return self.compute.calls

    def fetch(self, indices: Sequence[int]) -> list[HiddenRecord]:
        return self.compute(list(indices))


class HybridSource(HiddenStateSource):
    """Cache hits are read; misses (and samples of a corrupt shard) are computed online and written back.

    Misses are computed by the verifier, or by `compute` (with `backend` naming it in a new cache's manifest).

    Computed samples are buffered and committed as one shard once `shard_bytes` are pending (and on
    flush/close), so the cache does not fill with tiny shards. Past `max_cache_bytes` new samples are
    still computed but no longer stored (`uncached_samples` counts them).
    """

    def __init__(
        self,
        dataset: TokenDataset,
        cache_dir: str | Path,
        verifier_factory: VerifierFactory,
        *,
        fingerprint: CacheFingerprint | None = None,
        dtype: str = "bf16",
        max_cache_bytes: int | None = None,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        pad_token_id: int = 0,
        compute: ComputeFn | None = None,
        backend: str = "transformers",
    ):
        self.dataset = dataset
        if compute is not None and fingerprint is None:
            raise CacheError("a hybrid source with its own compute needs the cache fingerprint")
        self.compute = compute or VerifierCompute(dataset, verifier_factory, pad_token_id)
        if fingerprint is None:
            # Without a precomputed fingerprint the verifier must be loaded to check the cache is ours.
            fingerprint = CacheFingerprint.of(self.compute.verifier, dataset)
        where = getattr(dataset, "path", None)
        self.cache = HiddenStateCache.create(
            cache_dir,
            fingerprint,
            dtype=dtype,
            num_dataset_samples=len(dataset),
            dataset_dir=str(Path(where).resolve()) if where is not None else None,
            backend=backend,
        )
        self.max_cache_bytes = max_cache_bytes
        self.shard_bytes = shard_bytes
        self._pending: dict[int, tuple[HiddenRecord, torch.Tensor]] = {}
        self._pending_bytes = 0
        self.cache_hits = 0
        self.computed = 0
        self.repaired_shards = 0
        self.uncached_samples = 0
        self._warned_full = False

    @property
    def verifier_calls(self) -> int:  # type: ignore[override]
        return self.compute.calls

    def fetch(self, indices: Sequence[int]) -> list[HiddenRecord]:
        found: dict[int, HiddenRecord] = {}
        missing: list[int] = []
        corrupt: set[str] = set()
        for i in indices:
            if i in self._pending:
                found[i] = self._pending[i][0]
                continue
            if i not in self.cache:
                self.cache.refresh()  # another rank may have written it meanwhile
            if i not in self.cache:
                missing.append(i)
                continue
            try:
                found[i] = self.cache.read(i, expected_ids=self.dataset[i][0])
                self.cache_hits += 1
            except CacheCorruptError as exc:
                log.warning("%s; recomputing and rewriting it", exc.message)
                corrupt.add(exc.shard)
                missing.append(i)
        if missing:
            # Round computed states through the storage codec so every epoch (and offline mode) trains
            # on the same values, whether they were just computed or read back.
            for i, rec in zip(missing, self.compute(missing), strict=True):
                found[i] = quantize(rec, self.cache.dtype)
            self.computed += len(missing)
        for shard in sorted(corrupt):
            self._repair(shard, found)
        for i in missing:
            if i in self.cache and self.cache.shard_of(i) in corrupt:
                continue  # stored again by the repair
            self._buffer(i, found[i])
        return [found[i] for i in indices]

    def _repair(self, shard: str, known: dict[int, HiddenRecord]) -> None:
        """Recompute every sample of a corrupt shard and rewrite it under the same name, atomically."""
        samples = [int(i) for i in self.cache.shards[shard]["samples"]]
        todo = [i for i in samples if i not in known]
        records = dict(known)
        if todo:
            records.update(
                (i, quantize(r, self.cache.dtype)) for i, r in zip(todo, self.compute(todo), strict=True)
            )
        items = [(i, records[i], self.dataset[i][0]) for i in samples]
        self.cache.write_shard(items, name=shard)
        self.repaired_shards += 1
        log.warning("rewrote corrupt shard %s of %s (%d samples)", shard, self.cache.path, len(samples))

    def _buffer(self, index: int, record: HiddenRecord) -> None:
        size = record.num_tokens * bytes_per_token(
            self.cache.dtype, record.aux.shape[1], record.last.shape[1]
        )
        limit = self.max_cache_bytes
        if limit is not None and self.cache.total_bytes + self._pending_bytes + size > limit:
            self.uncached_samples += 1
            if not self._warned_full:
                log.warning(
                    "hidden-state cache %s reached max_cache_bytes=%d; further samples are computed online only",
                    self.cache.path,
                    limit,
                )
                self._warned_full = True
            return
        self._pending[index] = (record, self.dataset[index][0])
        self._pending_bytes += size
        if self._pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        items = [(i, rec, ids) for i, (rec, ids) in sorted(self._pending.items())]
        self.cache.write_shard(items)
        self._pending.clear()
        self._pending_bytes = 0

    def stats(self) -> dict[str, int]:
        return {
            "verifier_calls": self.verifier_calls,
            "cache_hits": self.cache_hits,
            "computed": self.computed,
            "repaired_shards": self.repaired_shards,
            "uncached_samples": self.uncached_samples,
            "cache_bytes": self.cache.total_bytes,
        }


_END = object()


class BatchLoader:
    """Iterates `PackedBatch`es in the order of `bins`, fetching and collating on a background thread.

    Up to `prefetch` batches are prepared ahead, so cached reads overlap the training step. An error
    in the thread (e.g. a CacheError) is re-raised by the iterator. The source is flushed after the
    last batch, so a hybrid epoch leaves the cache complete.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        source: HiddenStateSource,
        bins: Sequence[Sequence[int]],
        *,
        total_seq_len: int,
        prefetch: int = 2,
        start: int = 0,
    ):
        if prefetch < 1:
            raise ValueError("prefetch must be >= 1")
        self.dataset = dataset
        self.source = source
        self.bins = [list(b) for b in bins]
        self.total_seq_len = total_seq_len
        self.prefetch = prefetch
        self.start = start

    def __len__(self) -> int:
        return max(0, len(self.bins) - self.start)

    def __iter__(self) -> Iterator[Any]:
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            from peagle_core.data.packing import collate

            try:
                for b in self.bins[self.start :]:
                    samples = [self.dataset[i] for i in b]
                    records = self.source.fetch(b)
                    if not put(collate(samples, records, self.total_seq_len, sample_indices=b)):
                        return
                self.source.flush()
                put(_END)
            except BaseException as exc:
                put(exc)

        thread = threading.Thread(target=produce, name="peagle-batch-loader", daemon=True)
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join()
