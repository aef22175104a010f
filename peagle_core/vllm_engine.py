"""Real vLLM in a child process: greedy decoding with a verifier and, optionally, a P-EAGLE drafter.

vLLM gets a process of its own so that its threads, seeds, logging and memory never mix with training.
The child imports vLLM once (the slow part) and keeps one engine, for the last configuration asked for;
spec-decode counters are read before and after each batch, so every `VllmRun` counts only its own drafts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from peagle_core.errors import PeagleError

# P-EAGLE parallel drafting needs vLLM's V1 model runner. The engine core runs inside our child rather
# than in a further process of its own (start-up drops from ~20 s to ~5 s on a CPU).
_CHILD_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Defaults the caller's environment may override: a small CPU KV cache (GiB) and quiet logs.
_CHILD_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}

_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_available() -> bool:
    """Whether vLLM is installed here (checked without importing it: the import alone takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def model_len_for(prompts: list[list[int]], max_new_tokens: int, k: int | None = None) -> int:
    """The engine's max_model_len for `prompts`, rounded up to a power of two so that nearby prompt lengths
    (and batches cut from one prompt set) reuse one engine instead of building another."""
    longest = max((len(p) for p in prompts), default=1)
    return max(256, 2 ** math.ceil(math.log2(longest + max_new_tokens + (k or 0) + 1)))


class VllmError(PeagleError):
    """vLLM refused a model or failed while decoding; `phase` is "load" or "generate"."""

    code = "vllm_error"

    def __init__(self, message: str, *, phase: str):
        super().__init__(message)
        self.phase = phase


@dataclass
class VllmRun:
    """One batch of greedy generations and the spec-decode counters it moved (zero without a drafter)."""

    tokens: list[list[int]]
    seconds: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # "stop" (an end-of-sequence or stop token) or "length" (max_new_tokens) per prompt
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def acceptance_length(self) -> float:
        """Tokens per verifier pass: 1 + accepted drafts per draft (vLLM's mean acceptance length)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    def summary(self) -> dict[str, Any]:
        """The counters and derived figures, without the generated tokens."""
        out = {k: v for k, v in asdict(self).items() if k not in ("tokens", "finish_reasons")}
        return out | {
            "acceptance_length": self.acceptance_length,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "num_output_tokens": self.num_output_tokens,
            "output_tokens_per_s": self.num_output_tokens / self.seconds if self.seconds > 0 else 0.0,
        }


@dataclass(frozen=True)
class EngineConfig:
    """What identifies an engine: a request with the same config reuses the running one."""

    verifier: str
    revision: str | None = None
    drafter: str | None = None
    k: int | None = None
    max_model_len: int = 1024
    dtype: str = "float32"
    enforce_eager: bool = True
    gpu_memory_utilization: float | None = None
    trust_remote_code: bool = False


class VllmEngine:
    """Parent-side handle on the vLLM child process; use as a context manager.

    >>> with VllmEngine() as vllm:
    ...     plain = vllm.generate("/models/v", prompts, max_new_tokens=64)
    ...     spec = vllm.generate("/models/v", prompts, max_new_tokens=64, drafter="/ckpt", k=4)
    """

    def __init__(self, *, request_timeout_s: float = 1800.0):
        self.request_timeout_s = request_timeout_s
        self._proc: Any = None
        self._conn: Any = None

    def __enter__(self) -> VllmEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> VllmEngine:
        if self._proc is not None:
            return self
        if not vllm_available():
            raise VllmError("vLLM is not installed here (pip install 'peagle-service[vllm]')", phase="load")
        ctx = mp.get_context("spawn")  # a forked child would inherit torch's threads and CUDA state
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child,), name="peagle-vllm", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        return self

    def close(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is None:
            return
        with contextlib.suppress(BrokenPipeError, OSError):
            conn.send({"op": "exit"})
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        conn.close()

    def generate(
        self,
        verifier: str,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        drafter: str | None = None,
        k: int | None = None,
        dtype: str = "float32",
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        gpu_memory_utilization: float | None = None,
        trust_remote_code: bool = False,
        revision: str | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> VllmRun:
        """Greedy generation of `max_new_tokens` (or up to EOS) per prompt, with K drafted tokens per step
        from `drafter` (a P-EAGLE checkpoint directory) when given. `sampling` adds vLLM SamplingParams
        fields (`sample` uses it; None is greedy). Raises VllmError with vLLM's message."""
        if drafter is not None and not k:
            raise ValueError("a drafter needs k (speculative tokens per step)")
        if max_model_len is None:
            max_model_len = model_len_for(prompts, max_new_tokens, k)
        config = EngineConfig(
            verifier=str(verifier),
            revision=revision,
            drafter=str(drafter) if drafter is not None else None,
            k=int(k) if drafter is not None else None,
            max_model_len=int(max_model_len),
            dtype=dtype,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            trust_remote_code=trust_remote_code,
        )
        reply = self._request(
            {
                "op": "generate",
                "config": asdict(config),
                "prompts": [list(map(int, p)) for p in prompts],
                "max_new_tokens": int(max_new_tokens),
                "sampling": sampling,
            }
        )
        if "error" in reply:
            raise VllmError(reply["error"], phase=reply["phase"])
        return VllmRun(**reply["run"])

    def sample(
        self,
        verifier: str,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        stop_token_ids: list[int] | None = None,
        seed: int = 0,
        dtype: str = "float32",
        max_model_len: int | None = None,
        trust_remote_code: bool = False,
        revision: str | None = None,
    ) -> VllmRun:
        """Generation without a drafter at `temperature` (0: greedy), stopping at EOS or any of
        `stop_token_ids`; `finish_reasons` says per prompt whether it stopped or ran out of tokens."""
        sampling = {
            "temperature": float(temperature),
            "stop_token_ids": list(stop_token_ids or []),
            "seed": seed,
        }
        return self.generate(
            verifier,
            prompts,
            max_new_tokens,
            dtype=dtype,
            max_model_len=max_model_len,
            trust_remote_code=trust_remote_code,
            revision=revision,
            sampling=sampling,
        )

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        self.start()
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError):
            return self._died("load")
        deadline = time.monotonic() + self.request_timeout_s
        while time.monotonic() < deadline:
            if self._conn.poll(1.0):
                try:
                    return self._conn.recv()
                except EOFError:
                    return self._died("generate")
            if not self._proc.is_alive():
                return self._died("load")
        self.close()
        raise VllmError(f"vLLM did not answer within {self.request_timeout_s:.0f} s", phase="generate")

    def _died(self, phase: str) -> dict[str, Any]:
        proc = self._proc
        self.close()
        code = proc.exitcode if proc is not None else None
        raise VllmError(f"the vLLM process exited unexpectedly (exit code {code}); see its log", phase=phase)


# ---------------------------------------------------------------------------------------- the child


def _child_main(conn: Any) -> None:
    for key, value in _CHILD_ENV.items():
        os.environ[key] = value
    for key, value in _CHILD_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    state: dict[str, Any] = {"config": None, "llm": None}
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            if message["op"] == "exit":
                return
            conn.send(_serve_generate(state, message))
    finally:
        _drop_engine(state)


def _serve_generate(state: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
    config = EngineConfig(**message["config"])
    if state["config"] != config:
        _drop_engine(state)
        try:
            state["llm"] = _build_engine(config)
        except Exception as exc:  # vLLM's own refusal, reported to the caller verbatim
            return {"error": _describe(exc), "phase": "load"}
        state["config"] = config
    llm = state["llm"]
    try:
        from vllm import SamplingParams

        before = _counters(llm)
        start = time.perf_counter()
        sampling = message.get("sampling") or {}
        params = SamplingParams(
            temperature=sampling.get("temperature", 0.0),
            max_tokens=message["max_new_tokens"],
            stop_token_ids=sampling.get("stop_token_ids") or None,
            seed=sampling.get("seed"),
        )
        outputs = llm.generate([{"prompt_token_ids": p} for p in message["prompts"]], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = _counters(llm)
    except Exception as exc:
        _drop_engine(state)
        return {"error": _describe(exc), "phase": "generate"}
    moved = {name: after[name] - before.get(name, 0) for name in _COUNTERS.values()}
    per_pos = [a - b for a, b in zip(after[_PER_POSITION], before.get(_PER_POSITION) or [], strict=False)]
    per_pos += after[_PER_POSITION][len(per_pos) :]
    return {
        "run": {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "seconds": seconds,
            **moved,
            "accepted_per_position": per_pos,
            "finish_reasons": [str(o.outputs[0].finish_reason) for o in outputs],
        }
    }


def _build_engine(config: EngineConfig) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if config.drafter is not None:
        kwargs["speculative_config"] = {
            "model": config.drafter,
            "method": "eagle3",
            "num_speculative_tokens": config.k,
            "parallel_drafting": True,
        }
    if config.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
    return LLM(
        model=config.verifier,
        revision=config.revision,
        dtype=config.dtype,
        enforce_eager=config.enforce_eager,
        max_model_len=config.max_model_len,
        trust_remote_code=config.trust_remote_code,
        disable_log_stats=False,  # the spec-decode counters live in the stats
        distributed_executor_backend="uni",
        seed=0,
        **kwargs,
    )


def _drop_engine(state: dict[str, Any]) -> None:
    llm, state["llm"], state["config"] = state["llm"], None, None
    if llm is None:
        return
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def _counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {name: 0 for name in _COUNTERS.values()} | {_PER_POSITION: []}
    for metric in llm.get_metrics():
        if metric.name in _COUNTERS:
            out[_COUNTERS[metric.name]] = int(metric.value)
        elif metric.name == _PER_POSITION:
            out[_PER_POSITION] = [int(v) for v in metric.values]
    return out


def _describe(exc: BaseException) -> str:
    """vLLM's own message; the root cause's too when vLLM wrapped it in a generic one."""
    text = f"{type(exc).__name__}: {exc}"
    root = exc
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    if root is not exc:
        text += f" (caused by {type(root).__name__}: {root})"
    return text
