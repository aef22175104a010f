"""Verifier hidden states from vLLM: child processes hosting vLLM with our KV connector, and the functions
that build or fill a hidden-state cache with them (`hidden_states.engine: vllm`).

Each child runs one `LLM` with the `extract_hidden_states` method and `PeagleHiddenStatesConnector`, which
writes shards into the cache directory named in each request. The parent plans shard groups (about
`shard_bytes` each), sends one group at a time per child and waits for its answer; a child that dies or
refuses the verifier is a `HiddenStatesEngineError` carrying vLLM's own message, and a rerun resumes
from the shards already in the manifest. Data parallelism is one child per replica.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from peagle_core.errors import PeagleError
from peagle_core.processes import exit_now
from peagle_core.vllm_child import VllmChild, describe_error, enter_child, new_llm, serve

CONNECTOR = "PeagleHiddenStatesConnector"
CONNECTOR_MODULE = "peagle_core.hidden_states.vllm_connector"
# Steps after `generate` returns: the connector stores a request one step after it finishes.
_MAX_DRAIN_STEPS = 64


class HiddenStatesEngineError(PeagleError):
    """vLLM failed to start, refused the verifier or died while computing hidden states."""

    code = "hidden_states_engine_failed"


@dataclass(frozen=True)
class VllmHiddenStatesConfig:
    """What one vLLM hidden-state engine is started with."""

    verifier: str
    layer_ids: tuple[int, ...]  # our three aux layers; the child appends the last layer
    max_model_len: int
    dtype: str = "float32"
    revision: str | None = None
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = True
    max_num_batched_tokens: int | None = None  # vLLM's prefill budget per step (None: vLLM's default)


class VllmHiddenStates:
    """Parent-side handle on `data_parallel_size` vLLM children; use as a context manager.

    >>> with VllmHiddenStates(config) as engine:
    ...     engine.fill(cache_dir, [(index, token_ids), ...])
    """

    def __init__(self, config: VllmHiddenStatesConfig, *, timeout_s: float = 3600.0):
        self.config = config
        self.timeout_s = timeout_s
        self._children: list[_Child] = []
        self.hidden_size: int | None = None
        self.num_layers: int | None = None
        self.start_seconds = 0.0
        self._groups = 0
        self._lock = threading.Lock()

    def __enter__(self) -> VllmHiddenStates:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self._children]

    def start(self) -> VllmHiddenStates:
        if self._children:
            return self
        from peagle_core.vllm_engine import vllm_available

        if not vllm_available():
            raise HiddenStatesEngineError("vLLM is not installed here (pip install 'peagle-service[vllm]')")
        t0 = time.perf_counter()
        tp, dp = self.config.tensor_parallel_size, self.config.data_parallel_size
        try:
            self._children = [_Child(self.config, _devices(rank, tp, dp)) for rank in range(dp)]
            replies = [c.wait(self.timeout_s) for c in self._children]
        except BaseException:
            self.close()
            raise
        self.hidden_size = int(replies[0]["hidden_size"])
        self.num_layers = int(replies[0]["num_layers"])
        self.start_seconds = time.perf_counter() - t0
        return self

    def close(self) -> None:
        children, self._children = self._children, []
        for c in children:
            c.close()

    def fill(self, cache_dir: str | Path, items: Sequence[tuple[int, Sequence[int]]]) -> dict[str, Any]:
        """Compute `(index, token_ids)` samples as one group; their shard is in the cache on return."""
        if not items:
            return {"tokens": 0, "seconds": 0.0}
        self.start()
        with self._lock:
            gid = self._groups
            self._groups += 1
        child = self._children[gid % len(self._children)]
        return child.fill(str(Path(cache_dir).resolve()), gid, items, self.timeout_s)

    def fill_groups(
        self,
        cache_dir: str | Path,
        groups: Sequence[Sequence[tuple[int, Sequence[int]]]],
        on_group: Callable[[int], None] | None = None,
    ) -> None:
        """Compute several groups, one per child at a time; `on_group(n)` after each (from this thread)."""
        self.start()
        if len(self._children) == 1:
            for g in groups:
                self.fill(cache_dir, g)
                if on_group is not None:
                    on_group(len(g))
            return
        pool = ThreadPoolExecutor(max_workers=len(self._children))
        try:
            for g, _ in zip(groups, pool.map(lambda g: self.fill(cache_dir, g), groups), strict=True):
                if on_group is not None:
                    on_group(len(g))
        finally:
            # `on_group` may raise (a stop request): the groups not yet started are dropped, not run.
            pool.shutdown(wait=True, cancel_futures=True)


def _devices(rank: int, tp: int, dp: int) -> str | None:
    """The CUDA devices of data-parallel replica `rank`: the rank-th block of `tp` visible devices."""
    if dp == 1:
        return None  # inherit the caller's CUDA_VISIBLE_DEVICES untouched
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(tp * dp)]
    return ",".join(ids[rank * tp : (rank + 1) * tp])


class _Child(VllmChild):
    """One spawned vLLM process hosting a hidden-state engine."""

    def __init__(self, config: VllmHiddenStatesConfig, devices: str | None):
        super().__init__(
            _child_main,
            (asdict(config), devices),
            "peagle-vllm-hs",
            lambda msg, _: HiddenStatesEngineError(msg),
        )

    def wait(self, timeout_s: float) -> dict[str, Any]:
        reply = super().wait(timeout_s)
        if "error" in reply:
            raise HiddenStatesEngineError(reply["error"])
        return reply

    def fill(
        self, cache: str, gid: int, items: Sequence[tuple[int, Sequence[int]]], timeout_s: float
    ) -> dict[str, Any]:
        payload = [(int(i), list(map(int, t))) for i, t in items]
        return self.request({"op": "fill", "cache": cache, "group": gid, "items": payload}, timeout_s)


# ---------------------------------------------------------------------------------------- the child


def _child_main(conn: Any, config: dict[str, Any], devices: str | None) -> None:
    enter_child(devices)
    try:
        llm, info = _build_engine(
            VllmHiddenStatesConfig(**{**config, "layer_ids": tuple(config["layer_ids"])})
        )
    except Exception as exc:  # vLLM's refusal, reported verbatim
        conn.send({"error": f"vLLM could not start on {config['verifier']}: {describe_error(exc)}"})
        return
    conn.send(info)
    caches: dict[str, Any] = {}

    def answer(message: dict[str, Any]) -> dict[str, Any]:
        try:
            return _fill(llm, caches, message)
        except Exception as exc:
            return {"error": f"vLLM failed computing hidden states: {describe_error(exc)}"}

    serve(conn, answer, stop_on_error=True)
    if config["tensor_parallel_size"] == 1:
        # One process holds the engine and every shard is in the cache once its fill answered: the exit
        # skips vLLM's teardown and the interpreter's (seconds). Tensor-parallel workers get vLLM's own.
        exit_now(0)


def _build_engine(config: VllmHiddenStatesConfig) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(
        config.verifier, revision=config.revision, trust_remote_code=config.trust_remote_code
    ).get_text_config()
    num_layers = int(hf.num_hidden_layers)
    layer_ids = [*config.layer_ids, num_layers]  # the last decoder layer's output, before the final norm
    budget = (
        {}
        if config.max_num_batched_tokens is None
        else {"max_num_batched_tokens": config.max_num_batched_tokens}
    )
    llm = new_llm(
        config,
        **budget,
        tensor_parallel_size=config.tensor_parallel_size,
        distributed_executor_backend="uni" if config.tensor_parallel_size == 1 else "mp",
        # Each sample's states are computed from its own tokens: reused prefix blocks would skip them.
        enable_prefix_caching=False,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
        },
        kv_transfer_config={
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
        },
    )
    # Some refusals (CPU attention's head sizes) only come with the first forward pass: make one now, so
    # that a verifier vLLM cannot run fails the start rather than the first group.
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": [0, 1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
    return llm, {"hidden_size": int(hf.hidden_size), "num_layers": num_layers}


def _fill(llm: Any, caches: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    from peagle_core.hidden_states.cache import HiddenStateCache
    from peagle_core.hidden_states.vllm_connector import PARAMS_KEY

    items = message["items"]
    params = [
        SamplingParams(
            max_tokens=1,  # only the prompt's states are stored
            temperature=0.0,
            extra_args={
                "kv_transfer_params": {
                    PARAMS_KEY: {
                        "cache": message["cache"],
                        "index": i,
                        "group": message["group"],
                        "group_size": len(items),
                    }
                }
            },
        )
        for i, _ in items
    ]
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for _, ids in items], params, use_tqdm=False)
    cache = caches.get(message["cache"])
    if cache is None:
        cache = caches[message["cache"]] = HiddenStateCache.open(message["cache"])
    want = [i for i, _ in items]
    for _ in range(_MAX_DRAIN_STEPS):
        cache.refresh()
        if all(i in cache for i in want):
            break
        llm.llm_engine.step()
    else:
        missing = [i for i in want if i not in cache]
        raise RuntimeError(f"the connector did not store samples {missing[:8]} in {message['cache']}")
    return {"tokens": sum(len(ids) for _, ids in items), "seconds": time.perf_counter() - t0}
