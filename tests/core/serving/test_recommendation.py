"""The serving recommendation: the K served is the best one at the smallest batch size where a K beats plain
decoding, its sentence and stored form carry that K, and with no K beating plain it recommends none."""

from __future__ import annotations

from typing import Any

from peagle_core.serving.recommendation import ServingRecommendation


def row(method: str, k: int, batch_size: int, speedup: float | None) -> dict[str, Any]:
    """A `paired_speedups` row, reduced to what the choice reads."""
    return {"method": method, "k": k, "batch_size": batch_size, "speedup": speedup}


MEASURED = [
    row("eagle3", 1, 1, 1.21),
    row("eagle3", 2, 1, 1.42),
    row("eagle3", 4, 1, 1.30),
    row("eagle3", 1, 8, 1.15),
    row("eagle3", 2, 8, 1.10),
    row("eagle3", 4, 8, 0.92),
    row("ngram", 1, 1, 1.05),
    row("ngram", 4, 1, 1.19),
    row("ngram", 1, 8, 1.05),
    row("ngram", 4, 8, 0.97),
]


def test_the_best_k_at_batch_1_is_served_and_the_sentence_carries_every_figure() -> None:
    rec = ServingRecommendation.choose(MEASURED)
    assert rec is not None and rec.k == 2
    one, eight = rec.batches
    assert (one.batch_size, one.best_k, one.best_speedup, one.speedup) == (1, 2, 1.42, 1.42)
    # At batch 8 the served K's own figure, beside the K that is best there.
    assert (eight.batch_size, eight.best_k, eight.best_speedup, eight.speedup) == (8, 1, 1.15, 1.10)
    assert (one.ngram_k, one.ngram_speedup, eight.ngram_k, eight.ngram_speedup) == (4, 1.19, 1, 1.05)
    assert rec.sentence() == (
        "serve with num_speculative_tokens=2: 1.42× at batch 1, 1.10× at batch 8 (ngram 1.19× / 1.05×); "
        "K=1 is faster at batch 8 (1.15×)"
    )
    assert rec.serve_k(4) == 2


def test_no_k_beating_plain_recommends_none_and_says_ngrams_figure() -> None:
    slower = [row("eagle3", 1, 1, 0.81), row("eagle3", 2, 1, 0.86), row("ngram", 2, 1, 1.19)]
    rec = ServingRecommendation.choose(slower)
    assert rec is not None and rec.k is None
    assert rec.serve_k(2) == 2  # the command falls back to the caller's K
    sentence = rec.sentence()
    assert sentence.startswith("no num_speculative_tokens beat plain decoding with this drafter")
    assert "best 0.86× at batch 1 (K=2)" in sentence and "serve without it (ngram 1.19×)" in sentence
    assert "num_speculative_tokens=" not in sentence


def test_a_k_beating_plain_only_at_a_larger_batch_is_served() -> None:
    rec = ServingRecommendation.choose([row("eagle3", 1, 1, 0.95), row("eagle3", 1, 8, 1.2)])
    assert rec is not None and rec.k == 1
    assert rec.sentence() == (
        "serve with num_speculative_tokens=1: 0.95× at batch 1, 1.20× at batch 8 (ngram not measured)"
    )


def test_a_drafter_that_loses_to_ngram_says_so() -> None:
    # The real demo's figures (stop 37): the drafter beats plain, ngram beats it.
    rec = ServingRecommendation.choose([row("eagle3", 2, 1, 1.01), row("ngram", 2, 1, 1.14)])
    assert rec is not None and rec.k == 2
    assert rec.sentence() == (
        "serve with num_speculative_tokens=2: 1.01× at batch 1 (ngram 1.14×); "
        "ngram is faster at batch 1 (1.14× against 1.01×)"
    )


def test_it_round_trips_and_old_results_have_none() -> None:
    rec = ServingRecommendation.choose(MEASURED)
    assert rec is not None
    stored = rec.to_dict()
    assert stored["sentence"] == rec.sentence() and stored["k"] == 2
    assert ServingRecommendation.of({"status": "verified", "recommendation": stored}) == rec
    # A serving check recorded before recommendations, or one without a measured speed-up.
    assert ServingRecommendation.of({"status": "verified", "speedup": {"speedup": 1.2}}) is None
    assert ServingRecommendation.of(None) is None
    assert ServingRecommendation.choose([row("eagle3", 2, 1, None)]) is None
