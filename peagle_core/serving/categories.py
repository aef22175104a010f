"""Acceptance per prompt category: prompts grouped by category, each group decoded apart, and the groups'
figures pooled back into the whole set's (weighted by drafts, so the pooled figure is the ungrouped one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from peagle_core.figures import Acceptance

if TYPE_CHECKING:
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


def category_acceptance(acceptance: Acceptance) -> Acceptance:
    """One category's entry, alike for our evaluator and vLLM: length, rates, drafts and prompts."""
    return Acceptance(
        acceptance_length=acceptance.acceptance_length,
        acceptance_rate_per_position=acceptance.rates,
        drafts=acceptance.draft_count,
        num_prompts=acceptance.num_prompts,
    )


def pool_eval(parts: Mapping[str, Acceptance], groups: Mapping[str, list[int]]) -> Acceptance:
    """Our evaluator's results per category as one result over all prompts (tokens in prompt order)."""
    results = list(parts.values())
    passes = sum(r.draft_count for r in results)
    k = max(len(r.rates) for r in results)
    tokens: list[list[int]] = [[] for _ in range(sum(len(ix) for ix in groups.values()))]
    for name, r in parts.items():
        for i, t in zip(groups[name], r.tokens, strict=True):
            tokens[i] = t
    return Acceptance(
        acceptance_length=_weighted([r.acceptance_length or 0.0 for r in results], results, passes),
        acceptance_rate_per_position=[
            _weighted([r.rates[j] for r in results], results, passes) for j in range(k)
        ],
        verifier_passes=passes,
        num_prompts=sum(r.num_prompts or 0 for r in results),
        num_generated_tokens=sum(r.num_generated_tokens or 0 for r in results),
        tokens=tokens,
    )


def per_category(parts: Mapping[str, Acceptance]) -> dict[str, Acceptance]:
    """Each category's entry from its evaluation or vLLM run's acceptance."""
    return {name: category_acceptance(a) for name, a in parts.items()}


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


def _weighted(values: list[float], results: list[Acceptance], passes: int) -> float:
    if passes == 0:
        return 0.0
    return sum(v * r.draft_count for v, r in zip(values, results, strict=True)) / passes
