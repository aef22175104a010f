"""Building and filling hidden-state caches with the engine a job chose (`hidden_states.engine`):
`transformers` (the in-process verifier) or `vllm` (our KV connector writing shards from vLLM).

Callers (the training pipeline, benchmarks, `peagle jobs plan`) use `build_hidden_state_cache` for an
offline build and `make_engine_source` for the trainer's source; both take the engine by name.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from peagle_core.hidden_states.build import BuildReport, build_cache
from peagle_core.hidden_states.cache import (
    DEFAULT_SHARD_BYTES,
    MANIFEST,
    CacheError,
    CacheFingerprint,
    HiddenStateCache,
    TokenDataset,
)
from peagle_core.hidden_states.codec import HiddenRecord, bytes_per_token
from peagle_core.hidden_states.loader import HiddenStateSource, VerifierCompute, VerifierFactory, make_source
from peagle_core.hidden_states.vllm_extract import (
    ENGINES,
    VllmHiddenStates,
    VllmHiddenStatesConfig,
    vllm_dtype,
)

VllmFactory = Callable[[], VllmHiddenStates]


def vllm_config_for(spec: Any, layer_ids: Sequence[int], *, cuda: bool) -> VllmHiddenStatesConfig:
    """The vLLM engine a job spec asks for, capturing `layer_ids` (the verifier's three aux layers)."""
    return VllmHiddenStatesConfig(
        verifier=spec.verifier.name_or_path,
        layer_ids=tuple(int(i) for i in layer_ids),
        # a prompt of seq_len tokens plus the one token each request generates
        max_model_len=int(spec.dataset.seq_len) + 16,
        dtype=vllm_dtype(spec.verifier.dtype, cuda),
        revision=spec.verifier.revision,
        trust_remote_code=spec.verifier.trust_remote_code,
        tensor_parallel_size=spec.resources.tensor_parallel_size,
        data_parallel_size=spec.resources.data_parallel_size,
    )


def plan_groups(
    dataset: TokenDataset, indices: Sequence[int], token_bytes: int, shard_bytes: int
) -> list[list[int]]:
    """Consecutive runs of `indices` of about `shard_bytes` stored bytes each (one shard per run).

    The same cut as `build_cache`'s: a run closes once it reaches `shard_bytes`, so a build resumed
    after a crash cuts the remaining samples exactly as the uninterrupted build did.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in indices:
        current.append(i)
        size += dataset[i][0].numel() * token_bytes
        if size >= shard_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def build_cache_vllm(
    cache_dir: str | Path,
    dataset: TokenDataset,
    fingerprint: CacheFingerprint,
    engine: VllmHiddenStates,
    *,
    dtype: str = "bf16",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    dataset_dir: str | None = None,
    on_group: Callable[[int], None] | None = None,
) -> BuildReport:
    """Fill the cache with every sample of `dataset` through vLLM; resumable like `build_cache`.

    The connector writes each group's shard itself; `on_group(n)` runs after each group is committed.
    Raises HiddenStatesEngineError (code `hidden_states_engine_failed`) when vLLM fails.
    """
    cache = HiddenStateCache.create(
        cache_dir,
        fingerprint,
        dtype=dtype,
        num_dataset_samples=len(dataset),
        dataset_dir=dataset_dir,
        engine="vllm",
    )
    todo = [i for i in range(len(dataset)) if i not in cache]
    before = set(cache.shards)
    engine.start()
    hidden = int(engine.hidden_size or 0)
    token_bytes = bytes_per_token(dtype, len(fingerprint.layer_ids) * hidden, hidden)
    groups = plan_groups(dataset, todo, token_bytes, shard_bytes)
    engine.fill_groups(
        cache.path, [[(i, dataset[i][0].reshape(-1).tolist()) for i in g] for g in groups], on_group
    )
    cache.refresh()
    return BuildReport(
        len(todo), len(dataset) - len(todo), len(set(cache.shards) - before), len(cache), cache.total_bytes
    )


class VllmCompute:
    """A `ComputeFn` through vLLM: each call's samples become one fp32 shard in a scratch cache, are read
    back and the scratch is deleted (`keep_dir`: written into that cache instead, and kept).

    The engine is started on first use, so building this costs nothing when every sample is cached.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        fingerprint: CacheFingerprint,
        engine_factory: VllmFactory,
        *,
        keep_dir: str | Path | None = None,
        keep_dtype: str = "bf16",
    ):
        self.dataset = dataset
        self.fingerprint = fingerprint
        self._factory = engine_factory
        self._engine: VllmHiddenStates | None = None
        self.keep_dir = Path(keep_dir) if keep_dir is not None else None
        self.keep_dtype = keep_dtype
        self.calls = 0

    @property
    def engine(self) -> VllmHiddenStates:
        if self._engine is None:
            self._engine = self._factory().start()
        return self._engine

    def __call__(self, indices: Sequence[int]) -> list[HiddenRecord]:
        if not indices:
            return []
        items = [(int(i), self.dataset[i][0].reshape(-1).tolist()) for i in indices]
        self.calls += 1
        if self.keep_dir is not None:
            cache = HiddenStateCache.create(
                self.keep_dir,
                self.fingerprint,
                dtype=self.keep_dtype,
                num_dataset_samples=len(self.dataset),
                engine="vllm",
            )
            todo = [it for it in items if it[0] not in cache]
            self.engine.fill(cache.path, todo)
            cache.refresh()
            return [cache.read(i) for i in indices]
        scratch = Path(tempfile.mkdtemp(prefix="peagle-vllm-hs-"))
        try:
            cache = HiddenStateCache.create(scratch, self.fingerprint, dtype="fp32", engine="vllm")
            self.engine.fill(scratch, items)
            cache.refresh()
            return [cache.read(i) for i in indices]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()


def cache_engine(cache_dir: str | Path | None, default: str) -> str:
    """The engine that built the cache at `cache_dir`, or `default` when there is none yet."""
    if cache_dir is None or not (Path(cache_dir) / MANIFEST).is_file():
        return default
    return HiddenStateCache.open(cache_dir).engine


def build_hidden_state_cache(
    engine: str,
    cache_dir: str | Path,
    dataset: TokenDataset,
    fingerprint: CacheFingerprint,
    *,
    dtype: str = "bf16",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    dataset_dir: str | None = None,
    verifier_factory: VerifierFactory | None = None,
    vllm_factory: VllmFactory | None = None,
    pad_token_id: int = 0,
    batch_size: int = 8,
) -> BuildReport:
    """Build (or resume) the offline cache with `engine`; `verifier_factory` or `vllm_factory` supplies it."""
    if engine not in ENGINES:
        raise CacheError(f"unknown hidden_states.engine {engine!r}; use one of {', '.join(ENGINES)}")
    if engine == "vllm":
        if vllm_factory is None:
            raise CacheError("hidden_states.engine vllm needs a vLLM engine configuration")
        with vllm_factory() as vllm:
            return build_cache_vllm(
                cache_dir,
                dataset,
                fingerprint,
                vllm,
                dtype=dtype,
                shard_bytes=shard_bytes,
                dataset_dir=dataset_dir,
            )
    if verifier_factory is None:
        raise CacheError("hidden_states.engine transformers needs the verifier")
    compute = VerifierCompute(dataset, verifier_factory, pad_token_id=pad_token_id)
    return build_cache(
        cache_dir,
        dataset,
        compute,
        fingerprint,
        dtype=dtype,
        batch_size=batch_size,
        shard_bytes=shard_bytes,
        dataset_dir=dataset_dir,
    )


def make_engine_source(
    mode: str,
    engine: str,
    dataset: TokenDataset,
    *,
    fingerprint: CacheFingerprint,
    verifier_factory: VerifierFactory,
    vllm_factory: VllmFactory | None = None,
    cache_dir: str | Path | None = None,
    dtype: str = "bf16",
    max_cache_bytes: int | None = None,
    keep_online: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    pad_token_id: int = 0,
) -> HiddenStateSource:
    """The trainer's source for `mode`, computing with `engine` — for hybrid, the engine that built an
    existing cache. With vLLM online, batches are computed ahead by the `BatchLoader`'s bounded prefetch
    queue and deleted once read, unless `keep_online` (then they stay in `cache_dir`)."""
    if mode == "hybrid":
        engine = cache_engine(cache_dir, engine)
    compute = None
    if engine == "vllm" and mode != "offline":
        if vllm_factory is None:
            raise CacheError("hidden_states.engine vllm needs a vLLM engine configuration")
        keep = cache_dir if (mode == "online" and keep_online) else None
        compute = VllmCompute(dataset, fingerprint, vllm_factory, keep_dir=keep, keep_dtype=dtype)
    source = make_source(
        mode,
        dataset,
        verifier_factory=verifier_factory,
        cache_dir=cache_dir,
        dtype=dtype,
        max_cache_bytes=max_cache_bytes,
        fingerprint=fingerprint,
        shard_bytes=shard_bytes,
        pad_token_id=pad_token_id,
        compute=compute,
        engine=engine,
    )
    if compute is not None:
        _close_with(source, compute)
    return source


def _close_with(source: HiddenStateSource, compute: VllmCompute) -> None:
    """Stop the vLLM engine when the source is closed."""
    close = source.close

    def closing() -> None:
        try:
            close()
        finally:
            with contextlib.suppress(Exception):
                compute.close()

    source.close = closing  # type: ignore[method-assign]
