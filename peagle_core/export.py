"""Publishing a drafter: the vLLM-loadable checkpoint directory with its model card, validated before it appears.

The format is `peagle_core.speculators`, the checks `peagle_core.validate` (docs/architecture.md,
Checkpoint contract). `serve_command` is the vLLM command line the card and the demo print.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from peagle_core.errors import CheckpointError
from peagle_core.serve import serve_command
from peagle_core.speculators import write_checkpoint
from peagle_core.validate import validate_checkpoint

if TYPE_CHECKING:
    from peagle_core.config import PEagleConfig
    from peagle_core.model import PEagleDraftModel

__all__ = ["export_checkpoint", "model_card", "serve_command", "validate_checkpoint"]

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # `ExportSpec.dtype` -> torch


def model_card(
    *,
    verifier: str,
    checkpoint_dir: str | Path,
    k: int,
    data_fingerprint: str | None,
    metrics: Mapping[str, Any] | None,
    model_config: PEagleConfig,
) -> str:
    """A README that says what this drafter was trained against and how to serve it."""
    lines = [
        "# P-EAGLE drafter",
        "",
        f"A P-EAGLE (parallel-drafting EAGLE-3) speculative decoding drafter for `{verifier}`.",
        "",
        "## Training",
        "",
        f"- verifier: `{verifier}`",
        f"- training data fingerprint: `{data_fingerprint or 'unknown'}`",
        f"- draft layers: {model_config.num_layers}, parallel depths: {model_config.num_depths}",
        f"- draft vocabulary: {model_config.draft_vocab_size} of {model_config.vocab_size} tokens",
        f"- verifier layers feeding the drafter: {list(model_config.aux_layer_ids)}",
        "",
        "## Metrics",
        "",
    ]
    if metrics:
        lines += [f"- {name}: {value}" for name, value in sorted(metrics.items())]
    else:
        lines.append("- none recorded")
    lines += [
        "",
        "## Serve with vLLM (0.28 or later)",
        "",
        "```bash",
        serve_command(verifier, checkpoint_dir, k),
        "```",
        "",
    ]
    return "\n".join(lines)


def export_checkpoint(
    model: PEagleDraftModel,
    out_dir: str | Path,
    *,
    verifier_name_or_path: str,
    verifier_config: Any = None,
    data_fingerprint: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    speculative_tokens: int | None = None,
    dtype: Literal["bf16", "fp32"] = "bf16",
) -> Path:
    """Write the checkpoint directory with its model card, atomically and only if it validates.

    This is the one place an export is validated: against the contract and, given `verifier_config`
    (an HF config or dict), against the verifier it will be served with. CheckpointError lists every
    problem; nothing appears at `out_dir` then. `dtype` is the float tensors' dtype (`export.dtype`).
    """
    out_dir = Path(out_dir)
    config = model.config.model_copy(update={"verifier_name_or_path": verifier_name_or_path})
    k = int(speculative_tokens or config.num_depths)
    readme = model_card(
        verifier=verifier_name_or_path,
        checkpoint_dir=out_dir,
        k=k,
        data_fingerprint=data_fingerprint,
        metrics=metrics,
        model_config=config,
    )

    def check(tmp: Path) -> None:
        problems = validate_checkpoint(tmp, verifier_config)
        if problems:
            raise CheckpointError(problems, path=str(out_dir))

    return write_checkpoint(
        out_dir,
        config,
        model.state_dict(),
        speculative_tokens=k,
        readme=readme,
        dtype=EXPORT_DTYPES[dtype],
        check=check,
    )
