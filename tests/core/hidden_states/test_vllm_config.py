"""The vLLM hidden-state engine a job asks for: eager for small CPU builds, compiled for large ones."""

from __future__ import annotations

from pathlib import Path

from peagle_core.hidden_states.backends import CPU_COMPILE_MIN_TOKENS, vllm_config_for
from tests.core.helpers import make_spec


def test_a_large_cpu_build_compiles_and_a_small_one_stays_eager(tmp_path: Path) -> None:
    spec = make_spec(tmp_path / "verifier", tmp_path / "data.jsonl")
    small = vllm_config_for(spec, (1, 2, 3), cuda=False, tokens=CPU_COMPILE_MIN_TOKENS - 1)
    large = vllm_config_for(spec, (1, 2, 3), cuda=False, tokens=CPU_COMPILE_MIN_TOKENS)
    assert small.enforce_eager and not large.enforce_eager
    # CUDA keeps eager mode until compiled extraction is measured on a GPU
    assert vllm_config_for(spec, (1, 2, 3), cuda=True, tokens=10 * CPU_COMPILE_MIN_TOKENS).enforce_eager
    assert large.max_model_len == spec.dataset.seq_len + 16
