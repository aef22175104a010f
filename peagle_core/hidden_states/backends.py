"""The hidden-state backends a job chooses from (`hidden_states.engine`): `transformers` (the in-process
verifier) or `vllm` (our KV connector writing shards from a vLLM engine), and the trainer's source.

Callers (the training pipeline, benchmarks, `peagle jobs plan`) build a cache with
`build.build_cache(..., backend, ...)`, the backend from `open_backend(name, ...)`, and get the trainer's
source from `make_source(mode, dataset, backend=name, ...)`, the one source resolver.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from peagle_core.hidden_states.build import (
    ComputeBackend,
    Computed,
    HiddenStateBackend,
    StopCheck,
    stop_if_asked,
)
from peagle_core.hidden_states.cache import (
    CACHE_MANIFEST,
    DEFAULT_SHARD_BYTES,
    CacheError,
    CacheFingerprint,
    ComputeFn,
    HiddenStateCache,
    TokenDataset,
)
from peagle_core.hidden_states.codec import HiddenRecord, bytes_per_token
from peagle_core.hidden_states.loader import (
    HiddenStateSource,
    HybridSource,
    OfflineSource,
    OnlineSource,
    VerifierCompute,
    VerifierFactory,
)
from peagle_core.hidden_states.vllm_extract import VllmHiddenStates, VllmHiddenStatesConfig
from peagle_core.model.precision import vllm_dtype

BACKENDS = ("transformers", "vllm")  # the values of `hidden_states.engine`
VllmFactory = Callable[[], VllmHiddenStates]


# Tokens from which a CPU build compiles vLLM's model (enforce_eager off). Measured on the AMX Xeon, SmolLM2
# in bf16, 103k ShareGPT tokens: 4,910 tokens/s compiled against 3,744 eager, for ~60 s more start-up, so
# compiling pays from about 0.95M tokens (docs/decisions.md, "Hidden states at speed").
CPU_COMPILE_MIN_TOKENS = 1_000_000


def vllm_config_for(
    spec: Any, layer_ids: Sequence[int], *, cuda: bool, tokens: int = 0
) -> VllmHiddenStatesConfig:
    """The vLLM engine a job spec asks for, capturing `layer_ids` (the verifier's three aux layers), for a
    build of `tokens` tokens (a CPU build of at least `CPU_COMPILE_MIN_TOKENS` compiles the model)."""
    return VllmHiddenStatesConfig(
        verifier=spec.verifier.name_or_path,
        layer_ids=tuple(int(i) for i in layer_ids),
        # a prompt of seq_len tokens plus the one token each request generates
        max_model_len=int(spec.dataset.seq_len) + 16,
        dtype=vllm_dtype(spec.verifier.dtype, "cuda" if cuda else "cpu"),
        revision=spec.verifier.revision,
        trust_remote_code=spec.verifier.trust_remote_code,
        tensor_parallel_size=spec.resources.tensor_parallel_size,
        data_parallel_size=spec.resources.data_parallel_size,
        enforce_eager=cuda or tokens < CPU_COMPILE_MIN_TOKENS,
    )


def plan_groups(
    dataset: TokenDataset, indices: Sequence[int], token_bytes: int, shard_bytes: int
) -> list[list[int]]:
    """Consecutive runs of `indices` of about `shard_bytes` stored bytes each (one shard per run).

    The same cut as `ComputeBackend`'s: a run closes once it reaches `shard_bytes`, so a build resumed
    after a crash cuts the remaining samples exactly as the uninterrupted build did.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in indices:
        current.append(i)
        size += dataset.lengths[i] * token_bytes
        if size >= shard_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


class VllmBackend:
    """The `vllm` backend of a cache build: the engine's connector writes each group's shard itself
    (`on_group(n)` runs after each group is committed). A failing vLLM raises HiddenStatesEngineError
    (code `hidden_states_engine_failed`); a rerun resumes from the committed shards."""

    name = "vllm"

    def __init__(self, engine: VllmHiddenStates, *, on_group: Callable[[int], None] | None = None):
        self.engine = engine
        self.on_group = on_group

    def fill(self, cache: HiddenStateCache, dataset: TokenDataset, todo: Sequence[int], *, batch_size: int,
             shard_bytes: int, should_stop: StopCheck = None, on_computed: Computed = None) -> int:  # fmt: skip
        before = set(cache.shards)
        stop_if_asked(should_stop, "hidden-state build stopped before vLLM started")
        self.engine.start()
        hidden = int(self.engine.hidden_size or 0)
        token_bytes = bytes_per_token(cache.dtype, len(cache.fingerprint.layer_ids) * hidden, hidden)
        groups = plan_groups(dataset, todo, token_bytes, shard_bytes)
        committed = iter(groups)  # the engine commits the groups in order

        def on_group(n: int) -> None:  # a group's shard is committed: the place to stop
            if self.on_group is not None:
                self.on_group(n)
            if on_computed is not None:
                on_computed(next(committed))
            stop_if_asked(should_stop, "hidden-state build stopped after a committed group")

        self.engine.fill_groups(
            cache.path, [[(i, dataset[i][0].reshape(-1).tolist()) for i in g] for g in groups], on_group
        )
        cache.refresh()
        return len(set(cache.shards) - before)


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
                backend="vllm",
            )
            todo = [it for it in items if it[0] not in cache]
            self.engine.fill(cache.path, todo)
            cache.refresh()
            return [cache.read(i) for i in indices]
        scratch = Path(tempfile.mkdtemp(prefix="peagle-vllm-hs-"))
        try:
            cache = HiddenStateCache.create(scratch, self.fingerprint, dtype="fp32", backend="vllm")
            self.engine.fill(scratch, items)
            cache.refresh()
            return [cache.read(i) for i in indices]
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()


def cache_backend(cache_dir: str | Path | None, default: str) -> str:
    """The backend that built the cache at `cache_dir`, or `default` when there is none yet."""
    if cache_dir is None or not (Path(cache_dir) / CACHE_MANIFEST).is_file():
        return default
    return HiddenStateCache.open(cache_dir).backend


def _check_backend(name: str, vllm_factory: VllmFactory | None) -> None:
    if name not in BACKENDS:
        raise CacheError(f"unknown hidden_states.engine {name!r}; use one of {', '.join(BACKENDS)}")
    if name == "vllm" and vllm_factory is None:
        raise CacheError("hidden_states.engine vllm needs a vLLM engine configuration")


@contextlib.contextmanager
def open_backend(
    name: str,
    dataset: TokenDataset,
    *,
    verifier_factory: VerifierFactory | None = None,
    vllm_factory: VllmFactory | None = None,
    pad_token_id: int = 0,
) -> Iterator[HiddenStateBackend]:
    """The backend `name` for a cache build (`build.build_cache`): `transformers` computes with the verifier
    `verifier_factory` loads; `vllm` starts the engine `vllm_factory` makes and stops it on leaving."""
    _check_backend(name, vllm_factory)
    if name == "vllm":
        assert vllm_factory is not None
        with vllm_factory() as engine:
            yield VllmBackend(engine)
        return
    if verifier_factory is None:
        raise CacheError("hidden_states.engine transformers needs the verifier")
    yield ComputeBackend(VerifierCompute(dataset, verifier_factory, pad_token_id=pad_token_id))


def make_source(
    mode: str,
    dataset: TokenDataset,
    *,
    verifier_factory: VerifierFactory,
    backend: str = "transformers",
    vllm_factory: VllmFactory | None = None,
    fingerprint: CacheFingerprint | None = None,
    cache_dir: str | Path | None = None,
    dtype: str = "bf16",
    max_cache_bytes: int | None = None,
    keep_online: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    pad_token_id: int = 0,
) -> HiddenStateSource:
    """The trainer's hidden-state source for `mode` (`JobSpec.hidden_states.mode`: online, offline or
    hybrid), computing with the backend named `backend` (`hidden_states.engine`) — for hybrid, the backend
    that built an existing cache. The transformers backend runs the verifier `verifier_factory` loads.

    With vLLM online, batches are computed ahead by the `BatchLoader`'s bounded prefetch queue and deleted
    once read, unless `keep_online` (then they stay in `cache_dir`); the engine stops when the source closes.

    `fingerprint` (verifier, layer ids, dataset) is what an existing cache is checked against. Offline
    mode never loads the verifier: without a fingerprint it checks the dataset only. Hybrid mode loads
    the verifier to compute the fingerprint when none is given.
    """
    if mode == "hybrid":
        backend = cache_backend(cache_dir, backend)
    compute = None
    if backend == "vllm" and mode != "offline":
        _check_backend(backend, vllm_factory)
        if fingerprint is None:
            raise CacheError("hidden_states.engine vllm needs the cache fingerprint")
        assert vllm_factory is not None
        keep = cache_dir if (mode == "online" and keep_online) else None
        compute = VllmCompute(dataset, fingerprint, vllm_factory, keep_dir=keep, keep_dtype=dtype)
    source = _source(
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
        backend=backend,
    )
    if compute is not None:
        _close_with(source, compute)
    return source


def _source(
    mode: str,
    dataset: TokenDataset,
    *,
    verifier_factory: VerifierFactory,
    cache_dir: str | Path | None,
    dtype: str,
    max_cache_bytes: int | None,
    fingerprint: CacheFingerprint | None,
    shard_bytes: int,
    pad_token_id: int,
    compute: ComputeFn | None,
    backend: str,
) -> HiddenStateSource:
    """The source for `mode`; `compute` (the backend's, None: the in-process verifier) computes online
    passes and hybrid misses."""
    if mode == "online":
        return OnlineSource(dataset, verifier_factory, pad_token_id, compute=compute)
    if cache_dir is None:
        raise CacheError(
            f"hidden_states.mode={mode!r} needs a cache directory", param="hidden_states.cache_uri"
        )
    if mode == "offline":
        cache = HiddenStateCache.open(cache_dir, fingerprint, dataset_fingerprint=dataset.fingerprint)
        return OfflineSource(dataset, cache)
    if mode == "hybrid":
        return HybridSource(
            dataset,
            cache_dir,
            verifier_factory,
            fingerprint=fingerprint,
            dtype=dtype,
            max_cache_bytes=max_cache_bytes,
            shard_bytes=shard_bytes,
            pad_token_id=pad_token_id,
            compute=compute,
            backend=backend,
        )
    raise CacheError(
        f"unknown hidden_states.mode {mode!r}; use online, offline or hybrid", param="hidden_states.mode"
    )


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
