"""The exact `vllm serve` command for a published drafter (no torch: the dashboard shows it too)."""

from __future__ import annotations

import json
from pathlib import Path


def serve_command(verifier: str, checkpoint_dir: str | Path, k: int) -> str:
    """The exact command that serves this drafter with vLLM (P-EAGLE needs the V1 model runner)."""
    spec = json.dumps(
        {
            "model": str(checkpoint_dir),
            "method": "eagle3",
            "num_speculative_tokens": k,
            "parallel_drafting": True,
        }
    )
    return f"VLLM_USE_V2_MODEL_RUNNER=0 vllm serve {verifier} --speculative-config '{spec}'"
