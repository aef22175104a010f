"""Our evaluator drafts autoregressively for an EAGLE-3 drafter: the KV-cached engine (one pass per draft,
the drafts' K/V dropped after each round) decides every step as the full-recompute reference does, and
both give plain greedy decoding's output."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle_core.evaluation.acceptance import evaluate
from peagle_core.evaluation.speculate import speculative_decode_batch
from tests.core.evaluation.test_speculate import greedy, prompts  # noqa: F401 (module fixtures)

K = 3


@pytest.fixture(scope="module")
def eagle3_drafter(tmp_path_factory, toy_verifier_dir: Path, toy_dataset_path: Path):
    """An EAGLE-3 drafter trained briefly with training-time test (it gets drafts accepted)."""
    from peagle_core.pipeline.stages import run_pipeline
    from peagle_core.spec import parse_spec

    spec = parse_spec(
        {
            "verifier": {"name_or_path": str(toy_verifier_dir)},
            "dataset": {"path": str(toy_dataset_path), "seq_len": 128, "val_fraction": 0.1},
            "hidden_states": {"mode": "online"},
            "model": {"method": "eagle3", "num_layers": 1, "num_depths": K, "draft_vocab_size": 256},
            # 3 epochs left later drafts unaccepted for 4 of 6 seeds; 6 accept them for every seed tried (0-5)
            "training": {"total_seq_len": 256, "lr": 3e-3, "warmup_ratio": 0.1, "seed": 3, "epochs": 6},
            "evaluation": {"prompts": 0},
            "export": {"vllm_check": False},
        }
    )
    result = run_pipeline(spec, tmp_path_factory.mktemp("eagle3_job"), resume=False)
    assert result.status == "completed"
    model = result.model.eval()
    assert model.mask_hidden is None and model.config.method == "eagle3"
    return model


@pytest.mark.parametrize("k", range(1, K + 1))
def test_cached_autoregressive_drafting_equals_the_reference_and_greedy(
    toy_verifier,
    eagle3_drafter,
    prompts,  # noqa: F811
    greedy,  # noqa: F811
    k: int,
) -> None:
    eos = toy_verifier.tokenizer.eos_token_id
    reference = evaluate(eagle3_drafter, toy_verifier, prompts, k, 40, eos, reference=True)
    cached = evaluate(eagle3_drafter, toy_verifier, prompts, k, 40, eos, batch_size=3)
    assert reference.tokens == greedy  # lossless
    assert cached.tokens == reference.tokens
    assert cached.to_dict() == reference.to_dict()  # AL, per-position rates, verifier passes
    assert reference.acceptance_length > 1.0
    if k > 1:  # later drafts are accepted too: each reads the one before it
        assert reference.acceptance_rate_per_position[1] > 0


def test_the_drafter_cache_changes_nothing(toy_verifier, eagle3_drafter, prompts) -> None:  # noqa: F811
    args = (eagle3_drafter, toy_verifier, prompts, K, 40, toy_verifier.tokenizer.eos_token_id)
    assert speculative_decode_batch(*args, drafter_cache=True) == speculative_decode_batch(
        *args, drafter_cache=False
    )
