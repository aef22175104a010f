"""The real demo's last lines: the job's measured speed-ups, the drafter's beside vLLM's ngram."""

from __future__ import annotations

import copy

import pytest

from cli.demo import _report_speedup
from tests.fixtures.eval_reports import UI_EVAL


def _row(method: str, k: int, tokens_per_s: float, speedup: float) -> dict:
    return {"method": method, "k": k, "batch_size": 1, "prompts": 8, "output_tokens_per_s": tokens_per_s,
            "baseline_output_tokens_per_s": 20.0, "speedup": speedup, "lossless": True, "dtype": "bfloat16"}  # fmt: skip


def test_each_measured_speculator_gets_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    report = copy.deepcopy(UI_EVAL)
    report["serving"]["speedups"] = [_row("eagle3", 2, 27.0, 1.35), _row("ngram", 2, 23.9, 1.195)]
    _report_speedup({"metrics": {"eval": report}})
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "vLLM speed-up, drafter at K=2, batch 1, 8 prompts: 27.0 vs 20.0 tok/s plain, 1.35x",
        "vLLM speed-up, ngram at K=2, batch 1, 8 prompts: 23.9 vs 20.0 tok/s plain, 1.20x",
    ]


def test_an_older_report_shows_its_one_row_and_no_report_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    _report_speedup({"metrics": {"eval": UI_EVAL}})  # only `speedup`, the drafter at K (no `method`)
    _report_speedup({"metrics": {}})
    assert capsys.readouterr().out.splitlines() == [
        "vLLM speed-up, drafter at K=2, batch 1, 4 prompts: 20.2 vs 16.5 tok/s plain, 1.23x",
        "vLLM speed-up: not measured (vLLM is not installed where the job ran)",
    ]
