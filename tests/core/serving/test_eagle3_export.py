"""An EAGLE-3 drafter exports as speculators' `eagle3` type: no mask token, no `mask_hidden`, the same body
tensors as P-EAGLE's; it reloads as it was, validates, and its card and command serve it without
parallel drafting. The validator tells the two types apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.serving.export import export_checkpoint, validate_checkpoint
from tests.core.serving.test_export import VERIFIER_NAME, _break_config, _break_tensors, _small_model


def _eagle3_model() -> PEagleDraftModel:
    peagle = _small_model()
    config = peagle.config.model_copy(update={"method": "eagle3", "ttt_steps": 2})
    model = PEagleDraftModel(config)
    model.load_state_dict({k: v for k, v in peagle.state_dict().items() if k != "mask_hidden"})
    return model


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    return export_checkpoint(
        _eagle3_model(), tmp_path / "eagle3", verifier_name_or_path=VERIFIER_NAME, dtype="fp32"
    )


def test_the_export_is_speculators_eagle3_type_and_reloads_as_it_was(exported: Path) -> None:
    from safetensors import safe_open

    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["speculators_config"]["algorithm"] == "eagle3"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["ttt_steps"] == 2
    # Parallel drafting's settings are P-EAGLE's alone.
    assert not {"mask_token_id", "pard_token", "down_sample_ratio", "max_anchors"} & set(cfg)
    with safe_open(str(exported / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    peagle_names = set(_small_model().state_dict())
    assert names == peagle_names - {"mask_hidden"}
    assert validate_checkpoint(exported) == []

    model, reloaded = _eagle3_model(), PEagleDraftModel.from_pretrained(exported)
    # The mask token is not written: an EAGLE-3 drafter never reads one.
    assert reloaded.config == model.config.model_copy(
        update={"verifier_name_or_path": VERIFIER_NAME, "mask_token_id": 0}
    )
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)

    card = (exported / "README.md").read_text()
    assert card.startswith("# EAGLE-3 drafter") and "- method: `eagle3`" in card
    assert '"method": "eagle3", "num_speculative_tokens": 3}' in card and "parallel_drafting" not in card


def test_the_validator_refuses_what_vllm_would_not_read_as_eagle3(exported: Path) -> None:
    _break_tensors(exported, lambda t: t.__setitem__("mask_hidden", torch.zeros(1, 1, 96)))
    _break_config(exported, lambda c: c["speculators_config"].__setitem__("algorithm", "peagle"))
    problems = validate_checkpoint(exported)
    assert problems == [
        "config.json: speculators_config.algorithm is 'peagle', expected 'eagle3'",
        "model.safetensors: tensor 'mask_hidden' must not be present: an EAGLE-3 drafter drafts without mask "
        "positions (vLLM skips it, and it would not be what was trained)",
    ]
    # A P-EAGLE config over these tensors is a P-EAGLE checkpoint without its mask token.
    _break_config(
        exported, lambda c: c.update(speculators_model_type="peagle", architectures=["PEagleDraftModel"])
    )
    _break_config(exported, lambda c: c["speculators_config"].__setitem__("algorithm", "peagle"))
    assert validate_checkpoint(exported) == ["config.json: missing required field 'mask_token_id'"]
