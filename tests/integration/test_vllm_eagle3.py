"""An EAGLE-3 drafter (`model.method: eagle3`) in real vLLM 0.32, on the session's one engine: it loads as
speculators' eagle3 type without parallel drafting, keeps vLLM's greedy output at every K, its acceptance
length equals our autoregressive evaluator's within 3%, and it passes the publish gate like P-EAGLE's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from peagle_core.serving.gate import ServingCheck, check_in_vllm
from tests.fixtures.vllm import SERVING_NEW_TOKENS

SHAPE = "eagle3-draft-vocab-1-layer"
K = 3


@pytest.fixture(scope="module")
def ours_eagle3(exported_drafters, toy_verifier, serving_prompts):
    """Our evaluator on the serving prompts at K=3, with the published weights as vLLM reads them."""
    from peagle_core.evaluation.acceptance import evaluate
    from peagle_core.model.drafter import PEagleDraftModel

    drafter = PEagleDraftModel.from_pretrained(exported_drafters[SHAPE])
    assert drafter.config.method == "eagle3"
    prompts = [torch.tensor(p) for p in serving_prompts]
    return evaluate(
        drafter, toy_verifier, prompts, K, SERVING_NEW_TOKENS, toy_verifier.tokenizer.eos_token_id
    )


def test_the_export_is_the_eagle3_type(exported_drafters) -> None:
    cfg = json.loads((exported_drafters[SHAPE] / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert "mask_token_id" not in cfg and "pard_token" not in cfg


def test_vllm_acceptance_length_equals_ours_for_eagle3(
    vllm_engine, exported_drafters, toy_verifier_dir, serving_prompts, plain_greedy, ours_eagle3
) -> None:
    from peagle_core.serving.judge import GAP_TOLERANCE, agreement_gap

    theirs = vllm_engine.generate(
        str(toy_verifier_dir), serving_prompts, SERVING_NEW_TOKENS, drafter=str(exported_drafters[SHAPE]), k=K
    )
    assert theirs.tokens == plain_greedy == ours_eagle3.tokens  # lossless, both
    assert (
        theirs.num_draft_tokens == K * theirs.num_drafts
    )  # K drafts per step: vLLM drafted autoregressively
    assert ours_eagle3.acceptance_length > 1.1  # a drafter that gets drafts accepted...
    assert ours_eagle3.acceptance_rate_per_position[1] > 0  # ...beyond the first
    assert agreement_gap(ours_eagle3.acceptance_length, theirs.acceptance_length) <= GAP_TOLERANCE
    for a, b in zip(
        ours_eagle3.acceptance_rate_per_position, theirs.acceptance_rate_per_position, strict=True
    ):
        assert abs(a - b) <= 0.05


def test_an_eagle3_export_passes_the_publish_gate(
    vllm_engine,
    exported_drafters,
    toy_verifier_dir,
    serving_prompts,
    plain_greedy,
    ours_eagle3,
    tmp_path: Path,
) -> None:
    from peagle_core.model.drafter import PEagleDraftModel
    from peagle_core.serving.export import export_checkpoint

    model = PEagleDraftModel.from_pretrained(exported_drafters[SHAPE])
    ours = ours_eagle3

    def gate(tmp: Path) -> ServingCheck:
        return check_in_vllm(
            vllm_engine, verifier=str(toy_verifier_dir), checkpoint_dir=tmp, prompts=serving_prompts, k=K,
            max_new_tokens=SERVING_NEW_TOKENS, reference=plain_greedy, ours=ours,
        )  # fmt: skip

    out = export_checkpoint(
        model, tmp_path / "ok", verifier_name_or_path=str(toy_verifier_dir), dtype="fp32", serving=gate
    )
    check = ServingCheck.load(out)
    assert check is not None and check.status == "verified" and check.k == K
    assert check.acceptance_floor is not None and check.acceptance_length >= check.acceptance_floor
    card = (out / "README.md").read_text()
    assert "# EAGLE-3 drafter" in card and "servable: **verified** by vllm 0.32.0" in card
    assert "parallel_drafting" not in card
