"""`peagle demo --model` on a CPU without bf16 matrix instructions: it says up front that the recipe runs in
fp32 and how long its budget takes at the rates measured there; on a fast-bf16 CPU or a GPU it says nothing.
A negative `--timeout-s` is refused up front."""

from __future__ import annotations

import re

import pytest

from cli.demo_real import AVX2_HIDDEN_STATES_TOKENS_S, AVX2_TRAIN_TOKENS_S, REAL_BUDGETS, slow_cpu_notice

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})


def test_an_avx2_cpu_hears_the_fp32_budget_in_minutes() -> None:
    notice = slow_cpu_notice("default", flags=AVX2, cuda=False)
    assert notice is not None and "fp32" in notice
    tokens = REAL_BUDGETS["default"].train_tokens
    expected = (tokens / AVX2_HIDDEN_STATES_TOKENS_S + tokens / AVX2_TRAIN_TOKENS_S) / 60
    minutes = re.search(r"take about (\d+) min", notice)
    assert minutes is not None and int(minutes.group(1)) == round(expected)
    assert expected > 20  # the README's bf16 figure would mislead here


@pytest.mark.parametrize(
    "flags", [AVX2 | {"avx512f", "avx512_bf16"}, AVX2 | {"avx512f", "amx_bf16", "amx_tile"}]
)
def test_a_fast_bf16_cpu_hears_nothing(flags: frozenset[str]) -> None:
    assert slow_cpu_notice("default", flags=flags, cuda=False) is None


def test_a_gpu_or_a_smoke_budget_hears_nothing() -> None:
    assert slow_cpu_notice("default", flags=AVX2, cuda=True) is None
    assert slow_cpu_notice("test", flags=AVX2, cuda=False) is None


def test_a_negative_timeout_is_refused_before_anything_starts(tmp_path) -> None:
    import subprocess

    from cli.embedded import PEAGLE

    data_dir = tmp_path / "data"
    run = subprocess.run(
        [*PEAGLE, "demo", "--timeout-s", "-1", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--timeout-s" in run.stderr and "Traceback" not in run.stderr
    assert not data_dir.exists()  # refused before the demo made or started anything
