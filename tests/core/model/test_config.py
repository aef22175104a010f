"""The drafter config: defaults from the verifier's HF config, and the job spec's share of it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from transformers import LlamaConfig, Qwen2VLConfig, Qwen3VLConfig

from peagle_core.model.config import DrafterSettings, PEagleConfig, ascending_layer_ids, default_layer_ids
from peagle_core.spec import ModelSpec


def test_default_layer_ids() -> None:
    assert default_layer_ids(32) == [2, 16, 29]
    assert len(set(default_layer_ids(4))) == 3 and max(default_layer_ids(4)) < 4
    with pytest.raises(ValueError):
        default_layer_ids(2)


def test_config_from_verifier() -> None:
    hf = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=12, vocab_size=500, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )  # fmt: skip
    cfg = PEagleConfig.from_verifier(hf, mask_token_id=3, draft_vocab_size=None)
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads) == (64, 16, 2)
    assert cfg.aux_layer_ids == [2, 6, 9] and cfg.draft_vocab_size == 500
    assert cfg.rope_parameters["rope_theta"] == 5e5 and cfg.num_depths == 4 and cfg.norm_before_residual
    with pytest.raises(ValueError, match="mask_token_id"):
        PEagleConfig.from_verifier(hf, mask_token_id=500)


def test_the_job_spec_sets_exactly_the_drafter_settings() -> None:
    spec = ModelSpec(num_layers=2, num_depths=6, down_sample_ratio=0.5, norm_before_residual=False)
    settings = spec.drafter_settings()
    assert settings.keys() == DrafterSettings.model_fields.keys()
    assert settings.keys() <= PEagleConfig.model_fields.keys()
    hf = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=6,
                     vocab_size=300)  # fmt: skip
    cfg = PEagleConfig.from_verifier(hf, **settings, mask_token_id=3)
    assert (cfg.num_layers, cfg.num_depths, cfg.down_sample_ratio) == (2, 6, 0.5)
    assert cfg.norm_before_residual is False and cfg.draft_vocab_size == 300


def test_aux_layer_ids_are_three_distinct_ids_in_ascending_order() -> None:
    assert ascending_layer_ids([13, 2, 8]) == [2, 8, 13]
    for bad in ([1, 2], [1, 1, 2], [-1, 2, 3]):
        with pytest.raises(ValueError):
            ascending_layer_ids(bad)
    hf = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=6,
                     vocab_size=300)  # fmt: skip
    with pytest.raises(ValidationError, match="ascending"):
        PEagleConfig.from_verifier(hf, mask_token_id=3, aux_layer_ids=[4, 1, 2])


@pytest.mark.parametrize(
    "verifier",
    [
        # Qwen3-VL style: M-RoPE keys inside rope_parameters.
        Qwen3VLConfig(text_config={"rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                       "mrope_section": [24, 20, 20], "mrope_interleaved": True}}),
        # Qwen2-VL's legacy form: rope_scaling {"type": "mrope", ...}.
        Qwen2VLConfig.from_dict({"text_config": {"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
                                                 "rope_theta": 5e5}}),
    ],
)  # fmt: skip
def test_the_drafter_rope_is_flat_and_text_only(verifier) -> None:
    cfg = PEagleConfig.from_verifier(verifier, mask_token_id=3)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}
    mrope = {"rope_type": "default", "rope_theta": 1.0, "mrope_section": [1]}
    with pytest.raises(ValidationError, match="M-RoPE"):
        PEagleConfig.model_validate({**cfg.model_dump(), "rope_parameters": mrope})
