"""Acceptance per prompt category: prompts grouped by category, each group decoded apart, and the groups'
figures pooled back into the whole set's (weighted by drafts, so the pooled figure is the ungrouped one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peagle_core.evaluation.acceptance import EvalResult
    from peagle_core.vllm_engine import VllmRun

UNCATEGORISED = "uncategorised"  # prompts without a category, beside others that have one


def category_groups(categories: Sequence[str | None] | None) -> dict[str, list[int]]:
    """Prompt indices per category in first-seen order; {} when no prompt has a category."""
    if not categories or all(c is None for c in categories):
        return {}
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        groups.setdefault(c or UNCATEGORISED, []).append(i)
    return groups


def figures(acceptance_length: float, rates: list[float], drafts: int, prompts: int) -> dict[str, Any]:
    """One category's entry, alike for our evaluator and vLLM."""
    return {
        "acceptance_length": acceptance_length,
        "acceptance_rate_per_position": rates,
        "drafts": drafts,
        "num_prompts": prompts,
    }


def pool_eval(parts: Mapping[str, EvalResult], groups: Mapping[str, list[int]]) -> EvalResult:
    """Our evaluator's results per category as one result over all prompts (tokens in prompt order)."""
    from peagle_core.evaluation.acceptance import EvalResult

    results = list(parts.values())
    passes = sum(r.verifier_passes for r in results)
    k = results[0].k
    tokens: list[list[int]] = [[] for _ in range(sum(len(ix) for ix in groups.values()))]
    for name, r in parts.items():
        for i, t in zip(groups[name], r.tokens, strict=True):
            tokens[i] = t
    return EvalResult(
        k=k,
        acceptance_length=_weighted([r.acceptance_length for r in results], results, passes),
        acceptance_rate_per_position=[
            _weighted([r.acceptance_rate_per_position[j] for r in results], results, passes) for j in range(k)
        ],
        verifier_passes=passes,
        num_prompts=sum(r.num_prompts for r in results),
        num_generated_tokens=sum(r.num_generated_tokens for r in results),
        tokens=tokens,
    )


def eval_categories_figures(parts: Mapping[str, EvalResult]) -> dict[str, dict[str, Any]]:
    return {
        name: figures(r.acceptance_length, r.acceptance_rate_per_position, r.verifier_passes, r.num_prompts)
        for name, r in parts.items()
    }


def pool_runs(parts: Mapping[str, VllmRun], groups: Mapping[str, list[int]]) -> VllmRun:
    """vLLM's runs per category as one run over all prompts: counters summed, tokens in prompt order."""
    from peagle_core.vllm_engine import VllmRun

    n = sum(len(ix) for ix in groups.values())
    tokens: list[list[int]] = [[] for _ in range(n)]
    reasons = [""] * n
    for name, run in parts.items():
        for j, i in enumerate(groups[name]):
            tokens[i] = run.tokens[j]
            if j < len(run.finish_reasons):
                reasons[i] = run.finish_reasons[j]
    runs = list(parts.values())
    width = max(len(r.accepted_per_position) for r in runs)
    return VllmRun(
        tokens=tokens,
        seconds=sum(r.seconds for r in runs),
        num_drafts=sum(r.num_drafts for r in runs),
        num_draft_tokens=sum(r.num_draft_tokens for r in runs),
        num_accepted_tokens=sum(r.num_accepted_tokens for r in runs),
        accepted_per_position=[
            sum(r.accepted_per_position[j] for r in runs if j < len(r.accepted_per_position))
            for j in range(width)
        ],
        finish_reasons=reasons,
    )


def run_categories(parts: Mapping[str, VllmRun]) -> dict[str, dict[str, Any]]:
    return {
        name: figures(r.acceptance_length, r.acceptance_rate_per_position, r.num_drafts, len(r.tokens))
        for name, r in parts.items()
    }


def _weighted(values: list[float], results: list[EvalResult], passes: int) -> float:
    if passes == 0:
        return 0.0
    return sum(v * r.verifier_passes for v, r in zip(values, results, strict=True)) / passes
