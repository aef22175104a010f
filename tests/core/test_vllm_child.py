"""The vLLM child's log filter: vLLM's per-tensor notice that a weight is cast to the engine's dtype is dropped,
its other warnings are kept, and the notice is still the one vLLM's loader logs."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from peagle_core.vllm_child import drop_cast_notices

CAST = "Attempted to load weight %s with dtype %s into parameter with dtype %s"


def _record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(
        "vllm.model_executor.models.utils", logging.WARNING, __file__, 1, msg, args, None
    )


def test_cast_notices_are_dropped_and_other_warnings_kept() -> None:
    assert not drop_cast_notices(
        _record(CAST, "layers.0.mlp.up_proj.weight", "torch.float32", "torch.bfloat16")
    )
    assert drop_cast_notices(
        _record("Attempted to load nested weight %r into a single parameter %r", "a", "b")
    )
    assert drop_cast_notices(_record("KV cache is too small"))


def test_the_notice_is_the_one_vllms_loader_logs() -> None:
    # located, not imported: importing vLLM would load it into this test process
    package = Path(importlib.util.find_spec("vllm").origin).parent
    source = (package / "model_executor" / "models" / "utils.py").read_text()
    assert '"Attempted to load weight %s with dtype %s into "' in source
    assert "logger = init_logger(__name__)" in source  # the logger the filter is put on
