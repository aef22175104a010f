"""Publishing a drafter: the vLLM-loadable checkpoint directory with its model card, checked before it appears.

The format is `peagle_core.model.speculators`, the static checks `peagle_core.serving.validate`, the serving check
`peagle_core.serving.gate` (docs/architecture.md, Checkpoint contract). `serve_command` is the vLLM
command line the card and the demo print.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from peagle_core.errors import CheckpointError
from peagle_core.model.speculators import CARD_NAME, write_checkpoint
from peagle_core.serving.command import serve_command, speculative_config
from peagle_core.serving.gate import ServingCheck
from peagle_core.serving.validate import validate_checkpoint

if TYPE_CHECKING:
    from peagle_core.model.config import PEagleConfig
    from peagle_core.model.drafter import PEagleDraftModel

__all__ = ["export_checkpoint", "model_card", "serve_command", "speculative_config", "validate_checkpoint"]

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # `ExportSpec.dtype` -> torch


def model_card(
    *,
    verifier: str,
    checkpoint_dir: str | Path,
    k: int,
    data_fingerprint: str | None,
    metrics: Mapping[str, Any] | None,
    model_config: PEagleConfig,
    serving: ServingCheck | None = None,
) -> str:
    """A README that says what this drafter was trained against, whether vLLM served it, and how (at the
    recommended K when vLLM's speed-up was measured, else at `k`)."""
    recommendation = serving.recommendation if serving is not None else None
    method = model_config.method
    if method == "eagle3":
        title, what = "EAGLE-3", "An EAGLE-3 (autoregressive drafting, trained with training-time test)"
        depth = f"training-time-test steps: {model_config.row_depths}"
    else:
        title, what = "P-EAGLE", "A P-EAGLE (parallel-drafting EAGLE-3)"
        depth = f"parallel depths: {model_config.num_depths}"
    lines = [
        f"# {title} drafter",
        "",
        f"{what} speculative decoding drafter for `{verifier}`.",
        "",
        "## Training",
        "",
        f"- verifier: `{verifier}`",
        f"- method: `{method}`",
        f"- training data fingerprint: `{data_fingerprint or 'unknown'}`",
        f"- draft layers: {model_config.num_layers}, {depth}",
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
    lines += ["", *_serving_section(serving)]
    lines += [
        "",
        "## Serve with vLLM (0.28 or later)",
        "",
        "```bash",
        serve_command(
            verifier, checkpoint_dir, recommendation.serve_k(k) if recommendation else k, method=method
        ),
        "```",
        "",
    ]
    return "\n".join(lines)


def _serving_section(check: ServingCheck | None) -> list[str]:
    lines = ["## Checked in vLLM", ""]
    if check is None or check.status != "verified":
        reason = check.reason if check else "no serving check was run"
        return [*lines, f"- servable: **unverified** ({reason})"]
    rates = ", ".join(f"{r:.2f}" for r in check.acceptance_rate_per_position or [])
    return [
        *lines,
        f"- servable: **verified** by {check.served_by}: it loaded this checkpoint and its greedy output with "
        f"the drafter (K={check.k}) equalled its output without it on {check.prompts} prompts",
        f"- vLLM acceptance length at K={check.k}: {check.acceptance_length:.3f} (per position: {rates})",
        *(
            [
                f"- our evaluation on the same prompts: {check.ours_acceptance_length:.3f} (vLLM's floor: "
                f"{check.acceptance_floor:.3f})"
            ]
            if check.ours_acceptance_length is not None and check.acceptance_floor is not None
            else []
        ),
        *(
            [
                f"- vLLM at batch 1: {s.output_tokens_per_s:.1f} tokens/s with the drafter, "
                f"{s.baseline_output_tokens_per_s:.1f} without ({s.speedup:.2f}x)"
            ]
            if (s := check.speedup) is not None and s.speedup is not None
            else []
        ),
        *(
            [f"- measured in vLLM: {recommendation.sentence()}"]
            if (recommendation := check.recommendation) is not None
            else []
        ),
    ]


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
    serving: Callable[[Path], ServingCheck] | None = None,
) -> Path:
    """Write the checkpoint directory with its model card, atomically and only if it passes every check.

    This is the one place an export is checked: against the contract and, given `verifier_config`
    (an HF config or dict), against the verifier it will be served with; CheckpointError lists every
    problem. Then `serving(tmp_dir)` (the vLLM gate, `peagle_core.serving.gate.check_in_vllm`) runs on the finished
    files; its NotServableError also leaves nothing at `out_dir`. Its result is saved as serving.json
    and shown on the model card. `dtype` is the float tensors' dtype (`export.dtype`).
    """
    out_dir = Path(out_dir)
    config = model.config.model_copy(update={"verifier_name_or_path": verifier_name_or_path})
    k = int(speculative_tokens or config.num_depths)

    def readme(check: ServingCheck | None) -> str:
        return model_card(
            verifier=verifier_name_or_path,
            checkpoint_dir=out_dir,
            k=k,
            data_fingerprint=data_fingerprint,
            metrics=metrics,
            model_config=config,
            serving=check,
        )

    def check(tmp: Path) -> None:
        problems = validate_checkpoint(tmp, verifier_config)
        if problems:
            raise CheckpointError(problems, path=str(out_dir))
        result = serving(tmp) if serving is not None else ServingCheck.unverified("no serving check was run")
        result.save(tmp)
        (tmp / CARD_NAME).write_text(readme(result))

    return write_checkpoint(
        out_dir,
        config,
        model.state_dict(),
        speculative_tokens=k,
        readme=readme(None),
        dtype=EXPORT_DTYPES[dtype],
        check=check,
    )
