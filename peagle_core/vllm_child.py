"""A vLLM child process: spawned with vLLM's environment, asked one message at a time over a pipe with a
deadline, and the child's loop answering them. `vllm_engine` (generation) and `hidden_states.vllm_extract`
(hidden states) each run their own engine in one.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

# P-EAGLE parallel drafting needs vLLM's V1 model runner. The engine core runs inside our child rather
# than in a further process of its own: start-up drops from ~20 s to ~5 s on a CPU, and the child can
# step the engine itself (the hidden-state connector stores a request one step after it finishes).
_CHILD_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # Torch's huge pages, which `peagle_core` turns on for training, stay off in vLLM: with them its compiled
    # engine started ~10 s slower and extracted no faster (SmolLM2 bf16, docs/decisions.md).
    "THP_MEM_ALLOC_ENABLE": "0",
}
# Defaults the caller's environment may override: a small CPU KV cache (GiB) and quiet logs.
_CHILD_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}

# Builds the caller's error from a message and the phase it happened in ("load" or "generate").
ErrorFactory = Callable[[str, str], Exception]


class VllmChild:
    """Parent-side handle on one spawned child running `target(conn, *args)`."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], name: str, error: ErrorFactory):
        ctx = mp.get_context("spawn")  # a forked child would inherit torch's threads and CUDA state
        parent, child = ctx.Pipe()
        self._error = error
        self.proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send `message` and wait for the answer; a dead or silent child is the caller's error."""
        try:
            self.conn.send(message)
        except (BrokenPipeError, OSError):
            self._died("load")
        return self.wait(timeout_s)

    def wait(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.conn.poll(1.0):
                try:
                    return self.conn.recv()
                except (EOFError, OSError):  # the child's end closed: it died
                    self._died("generate")
            if not self.proc.is_alive():
                self._died("load")
        self.close()
        raise self._error(f"vLLM did not answer within {timeout_s:.0f} s", "generate")

    def _died(self, phase: str) -> None:
        self.proc.join(timeout=5)
        code = self.proc.exitcode
        self.close()
        raise self._error(f"the vLLM process exited unexpectedly (exit code {code}); see its log", phase)

    def close(self) -> None:
        if self.conn.closed:
            return
        with contextlib.suppress(BrokenPipeError, OSError):
            self.conn.send({"op": "exit"})
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


# ---------------------------------------------------------------------------------------- the child


def enter_child(devices: str | None = None) -> None:
    """Set vLLM's environment in a freshly spawned child, before it imports vLLM."""
    os.environ.update(_CHILD_ENV)
    for key, value in _CHILD_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices


class EngineArgs(Protocol):
    """The engine arguments both children's configurations carry."""

    verifier: str
    revision: str | None
    dtype: str
    enforce_eager: bool
    max_model_len: int
    trust_remote_code: bool
    gpu_memory_utilization: float | None


def drop_cast_notices(record: logging.LogRecord) -> bool:
    """False for vLLM's warning that a checkpoint tensor is cast to the engine's dtype: it comes once per
    tensor (120 lines for SmolLM2's fp32 files in a bf16 engine), and the cast is what `dtype` asked for."""
    return not str(record.msg).startswith("Attempted to load weight %s with dtype")


def new_llm(config: EngineArgs, **extra: Any) -> Any:
    """vLLM's `LLM` for `config`'s verifier (seeded; vLLM's own memory share unless one is given), plus
    the caller's `extra` engine arguments."""
    from vllm import LLM

    logging.getLogger("vllm.model_executor.models.utils").addFilter(drop_cast_notices)

    # Building an engine runs full garbage collections (after the weights load, and before vLLM freezes its
    # own heap), each a pass over every object the imports made: ~0.45 s apiece on a CPU (measured). Those
    # objects live as long as the process; frozen, the passes skip them. vLLM's engine teardown unfreezes
    # the heap before it collects, so nothing that becomes garbage later is kept.
    gc.freeze()
    if config.gpu_memory_utilization is not None:
        extra["gpu_memory_utilization"] = config.gpu_memory_utilization
    return LLM(
        model=config.verifier,
        revision=config.revision,
        dtype=config.dtype,
        enforce_eager=config.enforce_eager,
        max_model_len=config.max_model_len,
        trust_remote_code=config.trust_remote_code,
        seed=0,
        **extra,
    )


def serve(
    conn: Any, answer: Callable[[dict[str, Any]], dict[str, Any]], *, stop_on_error: bool = False
) -> None:
    """Answer each message until the parent sends `exit` or goes away; after an answer carrying an
    `error`, stop if `stop_on_error` (an engine that cannot be trusted any more)."""
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message["op"] == "exit":
            return
        reply = answer(message)
        conn.send(reply)
        if stop_on_error and "error" in reply:
            return


def describe_error(exc: BaseException) -> str:
    """vLLM's own message; the root cause's too when vLLM wrapped it in a generic one."""
    text = f"{type(exc).__name__}: {exc}"
    root = exc
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    if root is not exc:
        text += f" (caused by {type(root).__name__}: {root})"
    return text
