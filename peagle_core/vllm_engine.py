"""Real vLLM in a child process: greedy decoding with a verifier and, optionally, a P-EAGLE drafter.

vLLM gets a process of its own so that its threads, seeds, logging and memory never mix with training.
The child imports vLLM once (the slow part) and keeps one engine, for the last configuration asked for;
spec-decode counters are read before and after each batch, so every `VllmRun` counts only its own drafts.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from peagle_core.errors import PeagleError
from peagle_core.figures import Acceptance
from peagle_core.processes import exit_now
from peagle_core.vllm_child import VllmChild, describe_error, enter_child, new_llm, serve

_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"

# vLLM's training-free speculator: it proposes the K tokens that followed the last 2-4 prompt-or-output
# tokens where they occurred before (prompt lookup). The yardstick a trained drafter has to beat.
NGRAM_LOOKUP = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
SpeculativeMethod = Literal["eagle3", "ngram"]


def vllm_available() -> bool:
    """Whether vLLM is installed here (checked without importing it: the import alone takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def model_len_for(prompts: list[list[int]], max_new_tokens: int, k: int | None = None) -> int:
    """The engine's max_model_len for `prompts`, rounded up to a power of two so that nearby prompt lengths
    (and batches cut from one prompt set) reuse one engine instead of building another."""
    return model_len_within(max((len(p) for p in prompts), default=1), max_new_tokens, k)


def model_len_within(longest_prompt: int, max_new_tokens: int, k: int | None = None) -> int:
    """`model_len_for` from the longest prompt's length alone: a caller that knows its bound (regeneration's
    `seq_len`) keeps one engine for every batch, where per-batch lengths would rebuild it between them."""
    return max(256, 2 ** math.ceil(math.log2(longest_prompt + max_new_tokens + (k or 0) + 1)))


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
    engine_builds: int = 0  # engines the child has built so far (a new configuration builds another)

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

    def acceptance(self) -> Acceptance:
        """vLLM's acceptance over this run's drafts, as every evaluator reports it."""
        return Acceptance(
            acceptance_length=self.acceptance_length,
            acceptance_rate_per_position=self.acceptance_rate_per_position,
            drafts=self.num_drafts,
            num_prompts=len(self.tokens),
            num_generated_tokens=self.num_output_tokens,
        )

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
    # the speculator: "eagle3" with `drafter`, "ngram" without; None: plain
    method: SpeculativeMethod | None = None
    k: int | None = None
    max_model_len: int = 1024
    dtype: str = "float32"
    enforce_eager: bool = True
    gpu_memory_utilization: float | None = None
    trust_remote_code: bool = False


class VllmProcess:
    """Parent-side handle on the vLLM child process; use as a context manager.

    >>> with VllmProcess() as vllm:
    ...     plain = vllm.generate("/models/v", prompts, max_new_tokens=64)
    ...     spec = vllm.generate("/models/v", prompts, max_new_tokens=64, drafter="/ckpt", k=4)
    """

    def __init__(self, *, request_timeout_s: float = 1800.0):
        self.request_timeout_s = request_timeout_s
        self._child: VllmChild | None = None

    def __enter__(self) -> VllmProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> VllmProcess:
        if self._child is not None:
            return self
        if not vllm_available():
            raise VllmError("vLLM is not installed here (pip install 'peagle-service[vllm]')", phase="load")
        self._child = VllmChild(
            _child_main, (), "peagle-vllm", lambda msg, phase: VllmError(msg, phase=phase)
        )
        return self

    def close(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.close()

    def generate(
        self,
        verifier: str,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        drafter: str | None = None,
        k: int | None = None,
        method: SpeculativeMethod = "eagle3",
        dtype: str = "float32",
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        gpu_memory_utilization: float | None = None,
        trust_remote_code: bool = False,
        revision: str | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> VllmRun:
        """Greedy generation of `max_new_tokens` (or up to EOS) per prompt, with K drafted tokens per step
        from `drafter` (a P-EAGLE checkpoint directory) when given, or from vLLM's `ngram` prompt lookup
        with `method="ngram"` (no drafter). `sampling` adds vLLM SamplingParams fields (`sample` uses it;
        None is greedy). Raises VllmError with vLLM's message."""
        speculates = drafter is not None or method == "ngram"
        if speculates and not k:
            raise ValueError("speculative decoding needs k (speculative tokens per step)")
        if max_model_len is None:
            max_model_len = model_len_for(prompts, max_new_tokens, k)
        config = EngineConfig(
            verifier=str(verifier),
            revision=revision,
            drafter=str(drafter) if drafter is not None and method == "eagle3" else None,
            method=method if speculates else None,
            k=int(k) if speculates and k else None,
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
        child = self.start()._child
        assert child is not None
        try:
            return child.request(message, self.request_timeout_s)
        except VllmError:
            self._child = None  # that child is gone; the next request starts another
            raise


# ---------------------------------------------------------------------------------------- the child


def _child_main(conn: Any) -> None:
    enter_child()
    state: dict[str, Any] = {"config": None, "llm": None, "builds": 0}
    try:
        serve(conn, lambda message: _serve_generate(state, message))
    except BaseException:
        _drop_engine(state)
        raise
    # The engine runs in this process (the "uni" executor, no engine-core process), so nothing outlives
    # it: the exit skips vLLM's teardown and the interpreter's, ~4 s of every close (measured on a CPU).
    exit_now(0)


def _serve_generate(state: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
    config = EngineConfig(**message["config"])
    if state["config"] != config:
        _drop_engine(state)
        try:
            state["llm"] = _build_engine(config)
        except Exception as exc:  # vLLM's own refusal, reported to the caller verbatim
            return {"error": describe_error(exc), "phase": "load"}
        state["config"] = config
        state["builds"] += 1
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
        return {"error": describe_error(exc), "phase": "generate"}
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
            "engine_builds": state["builds"],
        }
    }


def _build_engine(config: EngineConfig) -> Any:
    kwargs: dict[str, Any] = {}
    if config.method == "ngram":
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": config.k, **NGRAM_LOOKUP}
    elif config.drafter is not None:
        # A P-EAGLE checkpoint drafts in parallel; speculators' eagle3 type (model.method eagle3) does not.
        cfg = Path(config.drafter) / "config.json"
        eagle3 = cfg.is_file() and json.loads(cfg.read_text()).get("speculators_model_type") == "eagle3"
        kwargs["speculative_config"] = {
            "model": config.drafter,
            "method": "eagle3",
            "num_speculative_tokens": config.k,
            **({} if eagle3 else {"parallel_drafting": True}),
        }
    return new_llm(
        config,
        disable_log_stats=False,  # the spec-decode counters live in the stats
        distributed_executor_backend="uni",
        **kwargs,
    )


def _drop_engine(state: dict[str, Any]) -> None:
    llm, state["llm"], state["config"] = state["llm"], None, None
    if llm is None:
        return
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        # It unfreezes the heap, then collects the engine's cycles: another collection first is a wasted
        # pass over the whole heap.
        cleanup_dist_env_and_memory()


def _counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {name: 0 for name in _COUNTERS.values()} | {_PER_POSITION: []}
    for metric in llm.get_metrics():
        if metric.name in _COUNTERS:
            out[_COUNTERS[metric.name]] = int(metric.value)
        elif metric.name == _PER_POSITION:
            out[_PER_POSITION] = [int(v) for v in metric.values]
    return out
