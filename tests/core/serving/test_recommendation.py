"""The serving recommendation: the K served is the best one at the smallest batch size where a K beats plain
decoding, its sentence and stored form carry that K, and with no K beating plain it recommends none."""

from __future__ import annotations

from dataclasses import replace

from peagle_core.serving.recommendation import ServingRecommendation
from peagle_core.serving.speedup import Speedup


def row(method: str, k: int, batch_size: int, speedup: float | None) -> Speedup:
    """A `paired_speedups` row, reduced to what the choice reads."""
    return Speedup(method=method, k=k, batch_size=batch_size, speedup=speedup)


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
        "serve the P-EAGLE drafter with num_speculative_tokens=2: 1.42× at batch 1, 1.10× at batch 8 "
        "(ngram 1.19× / 1.05×); "
        "K=1 is faster at batch 8 (1.15×)"
    )
    assert rec.serve_k(4) == 2


def test_no_k_beating_plain_recommends_none_and_says_ngrams_figure() -> None:
    slower = [row("eagle3", 1, 1, 0.81), row("eagle3", 2, 1, 0.86), row("ngram", 2, 1, 1.19)]
    rec = ServingRecommendation.choose(slower)
    assert rec is not None and rec.k is None
    assert rec.serve_k(2) == 2  # the command falls back to the caller's K
    sentence = rec.sentence()
    assert sentence.startswith("no num_speculative_tokens beat plain decoding with this P-EAGLE drafter")
    assert "best 0.86× at batch 1 (K=2)" in sentence and "serve without it (ngram 1.19×)" in sentence
    assert "num_speculative_tokens=" not in sentence


def test_a_k_beating_plain_only_at_a_larger_batch_is_served() -> None:
    rec = ServingRecommendation.choose([row("eagle3", 1, 1, 0.95), row("eagle3", 1, 8, 1.2)])
    assert rec is not None and rec.k == 1
    assert rec.sentence() == (
        "serve the P-EAGLE drafter with num_speculative_tokens=1: 0.95× at batch 1, 1.20× at batch 8 "
        "(ngram not measured)"
    )


def test_a_drafter_that_loses_to_ngram_says_so() -> None:
    # The real demo's figures (stop 37): the drafter beats plain, ngram beats it.
    rec = ServingRecommendation.choose([row("eagle3", 2, 1, 1.01), row("ngram", 2, 1, 1.14)])
    assert rec is not None and rec.k == 2
    assert rec.sentence() == (
        "serve the P-EAGLE drafter with num_speculative_tokens=2: 1.01× at batch 1 (ngram 1.14×); "
        "ngram is faster at batch 1 (1.14× against 1.01×)"
    )


def test_it_round_trips_and_old_results_have_none() -> None:
    rec = ServingRecommendation.choose(MEASURED)
    assert rec is not None
    stored = rec.to_dict()
    assert stored["sentence"] == rec.sentence() and stored["k"] == 2 and stored["method"] == "peagle"
    assert ServingRecommendation.of({"status": "verified", "recommendation": stored}) == rec
    # A serving check recorded before recommendations, or one without a measured speed-up.
    assert ServingRecommendation.of({"status": "verified", "speedup": {"speedup": 1.2}}) is None
    assert ServingRecommendation.of(None) is None
    assert ServingRecommendation.choose([row("eagle3", 2, 1, None)]) is None
    # Stored before there were two methods: P-EAGLE's.
    del stored["method"]
    assert ServingRecommendation.parse(stored) == rec


def test_an_eagle3_drafters_recommendation_names_its_method_and_its_serve_command_has_no_parallel_drafting() -> (
    None
):
    from peagle_core.serving.command import serve_command

    rec = ServingRecommendation.choose(MEASURED, method="eagle3")
    assert rec is not None and rec.method == "eagle3" and rec.k == 2
    assert rec.sentence().startswith(
        "serve the EAGLE-3 drafter with num_speculative_tokens=2: 1.42× at batch 1"
    )
    assert ServingRecommendation.parse(rec.to_dict()) == rec
    assert '"parallel_drafting"' not in serve_command("v", "/ckpt", 2, method="eagle3")
    assert '"parallel_drafting": true' in serve_command("v", "/ckpt", 2)


def test_the_method_choice_compares_both_methods_at_the_smallest_batch_size() -> None:
    from peagle_core.serving.method_choice import choose_method

    peagle = ServingRecommendation.choose(MEASURED, method="peagle")
    faster = [replace(r, speedup=r.speedup + 0.1) if r.method == "eagle3" else r for r in MEASURED]
    eagle3 = ServingRecommendation.choose(faster, method="eagle3")
    assert peagle is not None and eagle3 is not None
    choice = choose_method({"peagle": peagle, "eagle3": eagle3})
    assert choice is not None
    assert (choice.method, choice.k, choice.batch_size, choice.peagle_holds) == ("eagle3", 2, 1, False)
    assert choice.sentence() == (
        "serve EAGLE-3 with num_speculative_tokens=2: at batch 1 P-EAGLE 1.42× (K=2), EAGLE-3 1.52× (K=2); "
        "P-EAGLE ≥ EAGLE-3 does not hold here"
    )
    same = choose_method(
        {"peagle": peagle, "eagle3": ServingRecommendation.choose(MEASURED, method="eagle3")}
    )
    assert same is not None and (same.method, same.peagle_holds) == ("peagle", True)
    slow = [row("eagle3", 1, 1, 0.9)]
    none = choose_method({m: ServingRecommendation.choose(slow, method=m) for m in ("peagle", "eagle3")})
    assert none is not None and none.method is None and none.sentence().startswith("serve without a drafter")
