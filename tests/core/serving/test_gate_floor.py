"""The gate's acceptance floor (vLLM's acceptance length against ours on the same prompts) and the pooling
of per-category figures, without vLLM itself."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from peagle_core.figures import Acceptance
from peagle_core.serving.categories import category_groups, pool_eval
from peagle_core.serving.gate import SERVING_FILE, ServingCheck, acceptance_floor
from peagle_core.serving.speedup import Speedup


def acceptance_of(counts: list[int], k: int) -> Acceptance:
    """The figures of drafts that accepted `counts` tokens each (as both evaluators report them)."""
    n = len(counts)
    rates = [sum(c > j for c in counts) / n for j in range(k)]
    return Acceptance(1 + sum(counts) / n, rates, drafts=n)


def test_variance_comes_from_the_per_position_rates() -> None:
    counts = [0, 1, 3, 3, 2, 0, 1, 1]
    a = acceptance_of(counts, 3)
    mean = sum(counts) / len(counts)
    assert a.variance() == pytest.approx(sum((c - mean) ** 2 for c in counts) / len(counts))


def test_a_collapse_fails_and_equal_figures_pass() -> None:
    # The toy's agreement run (vllm-cpu notes): AL 2.124 over 113 drafts at K=4, in both engines.
    rng = random.Random(0)
    counts = [min(4, int(rng.expovariate(0.9))) for _ in range(113)]
    ours = acceptance_of(counts, 4)
    floor = acceptance_floor(ours, ours)
    assert floor is not None and 1.0 < floor < ours.acceptance_length
    collapsed = acceptance_of([0] * 150 + [1] * 3, 4)  # a wrong d2t: almost nothing accepted
    assert collapsed.acceptance_length < acceptance_floor(ours, collapsed)
    # A drafter 10% weaker in vLLM (numerics) is still within the floor.
    weaker = acceptance_of([c if i % 10 else max(0, c - 1) for i, c in enumerate(counts)], 4)
    assert weaker.acceptance_length >= acceptance_floor(ours, weaker)


def test_a_handful_of_drafts_cannot_fail_on_noise() -> None:
    # Two prompts of eight tokens: the floor drops to (or below) 1, so no figure vLLM shows fails there.
    ours = acceptance_of([3, 2, 0, 3, 1], 3)
    theirs = acceptance_of([0, 0, 1, 0, 0, 0, 0], 3)
    assert acceptance_floor(ours, theirs) <= theirs.acceptance_length
    assert acceptance_floor(Acceptance(2.0, [0.5, 0.3, 0.2], drafts=0), theirs) is None


def test_categories_pool_back_into_the_ungrouped_figures() -> None:
    assert category_groups([None, None]) == {}
    groups = category_groups(["math", None, "code", "math"])
    assert groups == {"math": [0, 3], "uncategorised": [1], "code": [2]}
    steps = {"math": [3, 0, 1], "uncategorised": [2], "code": [0, 0, 1, 3]}

    def result(counts: list[int], tokens: list[list[int]]) -> Acceptance:
        a = acceptance_of(counts, 3)
        return Acceptance(a.acceptance_length, a.rates, len(counts), None, len(tokens), 9, tokens=tokens)

    parts = {
        "math": result(steps["math"], [[0], [3]]),
        "uncategorised": result(steps["uncategorised"], [[1]]),
        "code": result(steps["code"], [[2]]),
    }
    pooled = pool_eval(parts, groups)
    whole = acceptance_of([c for counts in steps.values() for c in counts], 3)
    assert pooled.acceptance_length == pytest.approx(whole.acceptance_length)
    assert pooled.acceptance_rate_per_position == pytest.approx(whole.rates)
    assert pooled.verifier_passes == 8 and pooled.num_prompts == 4
    assert pooled.tokens == [[0], [1], [2], [3]]  # back in prompt order


def test_the_check_records_both_figures_and_the_speedup_and_reads_back(tmp_path) -> None:
    import json

    from peagle_core.serving.export import _serving_section

    check = ServingCheck(
        status="verified", served_by="vllm 0.32.0", k=4, prompts=80, acceptance_length=2.05,
        acceptance_rate_per_position=[0.6, 0.3, 0.1, 0.05], drafts=2500, ours_acceptance_length=2.1,
        acceptance_floor=1.83, categories={"writing": Acceptance(acceptance_length=2.4)},
        speedup=Speedup(output_tokens_per_s=30.0, baseline_output_tokens_per_s=16.0, speedup=1.875),
    )  # fmt: skip
    check.save(tmp_path)
    assert ServingCheck.load(tmp_path) == check
    card = "\n".join(_serving_section(check))
    assert "our evaluation on the same prompts: 2.100 (vLLM's floor: 1.830)" in card
    assert "30.0 tokens/s with the drafter, 16.0 without (1.88x)" in card
    # A serving.json written by a newer version (a field this one does not know) still reads, and keeps it.
    (tmp_path / SERVING_FILE).write_text(json.dumps({**check.to_dict(), "later_field": 1}))
    later = ServingCheck.load(tmp_path)
    assert later is not None and later.extra == {"later_field": 1} and replace(later, extra={}) == check
    assert later.to_dict() == {**check.to_dict(), "later_field": 1}
