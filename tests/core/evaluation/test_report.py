"""The typed evaluation report reads every stored eval.json and writes it back unchanged, byte for byte."""

from __future__ import annotations

import copy
import json
from typing import Any

from peagle_core.figures import Acceptance, KResult, k_key
from peagle_core.serving.gate import ServingCheck
from peagle_core.serving.recommendation import ServingRecommendation
from peagle_core.serving.report import EvaluationReport
from peagle_core.serving.speedup import Speedup
from tests.fixtures.eval_reports import UI_EVAL, figures

# tests/service/ui/test_ui.py's smaller one: ours and vLLM's acceptance length alone.
UI_EVAL_SMALL = {
    "step": 1,
    "results": {"k=2": {"k": 2, "acceptance_length": 2.125, "vllm": {"acceptance_length": 2.0625}}},
}


def _full_serving() -> dict[str, Any]:
    """A whole `ServingCheck.to_dict()`, its nulls included, with speed-ups and a recommendation."""
    rows = [
        Speedup(**{"method": m, "batch_size": 1, "k": k, "prompts": 4, "rounds": 3, "paired": "per group",
         "output_tokens_per_s": 20.0 * (s or 1), "baseline_output_tokens_per_s": 20.0, "speedup": s,
         "speedup_per_round": [s], "acceptance_length": 1.5, "lossless": True})
        for m, k, s in (("eagle3", 2, 1.3), ("eagle3", 1, 1.1), ("ngram", 2, None))
    ]  # fmt: skip
    recommendation = ServingRecommendation.choose(rows)
    assert recommendation is not None
    check = ServingCheck(
        status="verified", served_by="vllm 0.32.0", k=2, prompts=4, output_tokens=64, acceptance_length=1.8,
        acceptance_rate_per_position=[0.6, 0.2], drafts=40, ours_acceptance_length=1.9, acceptance_floor=1.4,
        speedup=rows[0], speedups=rows, recommendation=recommendation,
        categories={"writing": Acceptance.from_dict(figures(2.0, [0.7, 0.3], 3))},
    )  # fmt: skip
    return check.to_dict()


def _stored(d: Any) -> str:
    return json.dumps(d)  # insertion order: what a store that keeps it (SQLite, the CLI's lines) writes


def test_stored_reports_come_back_byte_for_byte() -> None:
    full = {
        "step": 8,
        "results": {
            k_key(k): {
                "k": k, "acceptance_length": 1.5 + k / 10, "acceptance_rate_per_position": [0.5] * k,
                "verifier_passes": 30, "num_prompts": 2, "num_generated_tokens": 16,
                "vllm": {"engine": "vllm 0.32.0", "acceptance_length": 1.5, "acceptance_rate_per_position": [0.5] * k,
                         "num_prompts": 2, "num_generated_tokens": 16, "drafts": 30, "matches_greedy": True},
            }
            for k in (1, 3)
        },
        "serving": _full_serving(),
    }  # fmt: skip
    unverified = {"serving": ServingCheck.unverified("export.vllm_check is false").to_dict()}
    for stored in (UI_EVAL, UI_EVAL_SMALL, full, unverified, {}):
        before = copy.deepcopy(stored)
        report = EvaluationReport.from_dict(stored)
        assert report.to_dict() == before and _stored(report.to_dict()) == _stored(before)
        assert EvaluationReport.from_dict(report.to_dict()) == report
        assert stored == before  # reading it changed nothing


def test_the_report_types_what_readers_read() -> None:
    report = EvaluationReport.from_dict(UI_EVAL)
    at_2 = report.at(2)
    assert at_2 is not None and report.ours(2) is at_2.ours and report.at(4) is None
    assert at_2.ours is not None and at_2.ours.acceptance_length == 1.875 and at_2.ours.verifier_passes == 80
    assert at_2.ours.categories is not None and at_2.ours.categories["writing"].num_prompts == 3
    assert at_2.vllm is not None and at_2.vllm.rates == [0.6625, 0.15]
    assert report.serving is not None and report.serving.k == 2
    assert report.serving.acceptance.acceptance_length == 1.8125
    assert report.serving.speedup == Speedup(
        batch_size=1, k=2, prompts=4, output_tokens_per_s=20.25, baseline_output_tokens_per_s=16.5,
        speedup=1.2272, lossless=True,
    )  # fmt: skip
    full = EvaluationReport.from_dict({"serving": _full_serving()}).serving
    assert full is not None and full.speedups is not None and len(full.speedups) == 3
    assert full.speedups[2].speedup is None and full.speedups[2].extra["speedup"] is None  # stored null
    assert full.recommendation == ServingRecommendation.of(_full_serving())
    assert full.categories is not None and full.categories["writing"].num_prompts == 3


def test_unknown_and_odd_values_survive_a_round_trip() -> None:
    stored = {
        "step": 3,
        "results": {
            "k=2": {"k": 2, "acceptance_length": None, "acceptance_rate_per_position": [0.5, "x"], "new": 1},
            "k=9": {"k": 4},  # its name is not its K's
            "junk": 7,
        },
        "serving": {"status": "verified", "k": "two", "speedup": None, "speedups": [1, 2]},
        "added_later": {"nested": [1]},
    }
    report = EvaluationReport.from_dict(stored)
    assert report.to_dict() == stored and _stored(report.to_dict()) == _stored(stored)
    ours = report.ours(2)
    assert ours is not None and ours.acceptance_length is None and ours.acceptance_rate_per_position is None
    assert set(report.unread) == {"k=9", "junk"} and report.extra == {"added_later": {"nested": [1]}}
    assert report.serving is not None and report.serving.k is None and report.serving.speedup is None
    assert EvaluationReport.from_dict(None) == EvaluationReport() and EvaluationReport().to_dict() == {}


def test_a_report_built_in_code_round_trips() -> None:
    report = EvaluationReport(
        step=4,
        results={
            1: KResult(1, ours=Acceptance(1.4, [0.4], verifier_passes=10, num_prompts=2)),
            3: KResult(3, vllm=Acceptance(2.0, [0.6, 0.3, 0.1], drafts=12, served_by="vllm 0.32.0")),
        },
    ).with_serving(ServingCheck.from_dict(_full_serving()))
    assert EvaluationReport.from_dict(report.to_dict()) == report
    assert report.to_dict()["serving"] == _full_serving()
    assert report.to_dict()["results"]["k=3"] == {
        "k": 3,
        "vllm": {"acceptance_length": 2.0, "acceptance_rate_per_position": [0.6, 0.3, 0.1], "drafts": 12,
                 "engine": "vllm 0.32.0"},
    }  # fmt: skip


# A job's eval.json and serving.json as this service stored them before the figure types were merged
# (checkpoint metrics of an EAGLE-3-era job): the keys, nulls and order the old classes wrote.
OLD_STORED_SERVING = {
    "status": "verified", "reason": None, "engine": "vllm 0.32.0", "k": 2, "prompts": 4, "output_tokens": 64,
    "acceptance_length": 1.8, "acceptance_rate_per_position": [0.6, 0.2], "drafts": 40,
    "ours_acceptance_length": 1.9, "acceptance_floor": 1.4,
    "speedup": {"method": "eagle3", "batch_size": 1, "k": 2, "prompts": 4, "rounds": 3, "paired": "per group",
                "output_tokens_per_s": 26.0, "baseline_output_tokens_per_s": 20.0, "speedup": 1.3,
                "speedup_per_round": [1.3], "acceptance_length": 1.5, "lossless": True, "dtype": "bfloat16"},
    "speedups": [
        {"method": "eagle3", "batch_size": 1, "k": 2, "prompts": 4, "rounds": 3, "paired": "per group",
         "output_tokens_per_s": 26.0, "baseline_output_tokens_per_s": 20.0, "speedup": 1.3,
         "speedup_per_round": [1.3], "acceptance_length": 1.5, "lossless": True, "dtype": "bfloat16"},
        {"method": "ngram", "batch_size": 1, "k": 2, "prompts": 4, "rounds": 3, "paired": "per group",
         "output_tokens_per_s": 0.0, "baseline_output_tokens_per_s": 0.0, "speedup": None,
         "speedup_per_round": [], "acceptance_length": 1.0, "lossless": True, "dtype": "bfloat16"},
    ],
    # Recorded before EAGLE-3: no method (P-EAGLE's), an older sentence.
    "recommendation": {"k": 2, "batches": [{"batch_size": 1, "best_k": 2, "best_speedup": 1.3, "ngram_k": None,
                                            "ngram_speedup": None, "speedup": 1.3}], "sentence": "serve with K=2"},
    "categories": {"writing": {"acceptance_length": 2.0, "acceptance_rate_per_position": [0.7, 0.3],
                               "drafts": 40, "num_prompts": 3}},
}  # fmt: skip


def test_an_old_stored_report_still_loads_into_the_one_types() -> None:
    stored = {"step": 5, "results": UI_EVAL["results"], "serving": OLD_STORED_SERVING}
    report = EvaluationReport.from_dict(copy.deepcopy(stored))
    serving = report.serving
    assert serving is not None and serving.served_by == "vllm 0.32.0" and serving.k == 2
    assert (
        serving.speedup is not None and serving.speedup.speedup == 1.3 and serving.speedup.dtype == "bfloat16"
    )
    assert serving.speedups is not None and [r.method for r in serving.speedups] == ["eagle3", "ngram"]
    assert serving.speedups[1].speedup is None
    rec = serving.recommendation
    assert rec is not None and rec.method == "peagle" and rec.k == 2 and rec.batches[0].best_speedup == 1.3
    assert serving.acceptance.categories is not None
    assert serving.acceptance.categories["writing"].draft_count == 40
    # Everything but the recommendation (rewritten in today's form) comes back as stored.
    back = report.to_dict()
    assert {k: v for k, v in back["serving"].items() if k != "recommendation"} == {
        k: v for k, v in OLD_STORED_SERVING.items() if k != "recommendation"
    }
    assert back["results"] == stored["results"]


def test_a_new_verdict_writes_what_serving_json_always_held() -> None:
    # The keys, order and empty values `dataclasses.asdict` of the old ServingCheck wrote.
    assert ServingCheck.unverified("export.vllm_check is false").to_dict() == {
        "status": "unverified", "reason": "export.vllm_check is false", "engine": None, "k": None,
        "prompts": 0, "output_tokens": 0, "acceptance_length": None, "acceptance_rate_per_position": [],
        "drafts": 0, "ours_acceptance_length": None, "acceptance_floor": None, "speedup": None,
        "speedups": [], "recommendation": None, "categories": {},
    }  # fmt: skip
