"""Drafter layer families and checkpoints other tools wrote: the qwen3 format, and what a speculators
checkpoint may carry that this drafter refuses (the vLLM side is tests/integration/test_interop.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from peagle_core.errors import CheckpointError
from peagle_core.model.config import PEagleConfig
from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.serving.export import export_checkpoint, validate_checkpoint
from peagle_core.spec import SpecError, parse_spec

SHAPE = dict(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
    vocab_size=128, draft_vocab_size=128, num_layers=2, num_depths=3, aux_layer_ids=[0, 2, 3], mask_token_id=3,
    verifier_name_or_path="toy/verifier", verifier_architectures=["LlamaForCausalLM"],
)  # fmt: skip


def _export(tmp_path: Path, layer_type: str) -> Path:
    torch.manual_seed(0)
    model = PEagleDraftModel(PEagleConfig(**SHAPE, layer_type=layer_type))
    return export_checkpoint(model, tmp_path / layer_type, verifier_name_or_path="toy/verifier", dtype="fp32")


def test_qwen3_writes_its_model_type_and_per_head_qk_norms(tmp_path: Path) -> None:
    path = _export(tmp_path, "qwen3")
    layer = json.loads((path / "config.json").read_text())["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["architectures"] == ["Qwen3ForCausalLM"]
    loaded = PEagleDraftModel.from_pretrained(path)
    assert loaded.config.layer_type == "qwen3"
    for i in range(2):
        assert loaded.layers[i].self_attn.q_norm.weight.shape == (8,)
        assert loaded.layers[i].self_attn.k_norm.weight.shape == (8,)
    assert validate_checkpoint(path) == []


def _rows(model: PEagleDraftModel) -> torch.Tensor:
    torch.manual_seed(1)
    t = 6
    zeros = torch.zeros(t, dtype=torch.long)
    return model(
        torch.randn(t, 96), torch.randint(0, 128, (t,)), torch.arange(t), zeros, torch.arange(t), zeros
    )


def test_the_qk_norms_are_applied_and_llama_has_none() -> None:
    torch.manual_seed(0)
    llama = PEagleDraftModel(PEagleConfig(**SHAPE))
    qwen3 = PEagleDraftModel(PEagleConfig(**SHAPE, layer_type="qwen3"))
    assert llama.layers[0].self_attn.q_norm is None
    missing = qwen3.load_state_dict(llama.state_dict(), strict=False).missing_keys
    assert sorted(missing) == sorted(f"layers.{i}.self_attn.{n}_norm.weight" for i in range(2) for n in "qk")
    with torch.no_grad():
        same_weights = _rows(qwen3)
        assert not torch.allclose(same_weights, _rows(llama))
        qwen3.layers[1].self_attn.k_norm.weight.mul_(3.0)
        assert not torch.allclose(same_weights, _rows(qwen3))


def test_validate_names_an_unknown_layer_family(tmp_path: Path) -> None:
    path = _export(tmp_path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["transformer_layer_config"]["model_type"] = "mistral"
    (path / "config.json").write_text(json.dumps(cfg))
    assert any("model_type is 'mistral'" in p for p in validate_checkpoint(path))


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda c: c.update(norm_output=True), "norm_output = True is not supported"),
        (lambda c: c.update(norm_before_fc=True), "norm_before_fc = True is not supported"),
        (lambda c: c["transformer_layer_config"].update(attention_bias=True), "attention_bias = True"),
        (lambda c: c.update(target_hidden_size=64), "target_hidden_size 64 differs"),
        (
            lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention"] * 2),
            "sliding-window",
        ),
    ],
)
def test_settings_this_drafter_does_not_implement_are_refused_by_name(tmp_path: Path, edit, reason) -> None:
    path = _export(tmp_path, "qwen3")
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=reason):
        PEagleDraftModel.from_pretrained(path)


def test_spec_fields_layer_type_and_init_from() -> None:
    base = {"verifier": {"name_or_path": "/m"}, "dataset": {"path": "/d.jsonl"}}
    spec = parse_spec(base | {"model": {"layer_type": "qwen3", "init_from": "/ckpt"}})
    assert spec.model.layer_type == "qwen3" and spec.model.init_from == "/ckpt"
    assert parse_spec(base).model.layer_type == "llama"
    with pytest.raises(SpecError) as info:
        parse_spec(base | {"model": {"layer_type": "mistral"}})
    assert info.value.errors[0][0] == "model.layer_type"
    with pytest.raises(SpecError) as info:
        parse_spec(base | {"model": {"init_from": "x" * 5000}})
    assert info.value.errors[0][0] == "model.init_from"


def test_a_layer_config_saved_before_transformers_5_gives_its_rope_parameters(tmp_path: Path) -> None:
    path = _export(tmp_path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    del layer["rope_parameters"]
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    layer |= {"rope_theta": 500000.0, "rope_scaling": scaling}
    (path / "config.json").write_text(json.dumps(cfg))
    rope = PEagleDraftModel.from_pretrained(path).config.rope_parameters
    assert rope == {**scaling, "rope_theta": 500000.0}
