"""The vLLM checkpoint export: config.json, bit-exact round trip, and the validator's reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from peagle_core.errors import CheckpointError
from peagle_core.serving.export import export_checkpoint, validate_checkpoint

VERIFIER_NAME = "toy/verifier"


def _small_model(vocab: int = 512, draft_vocab: int = 64):
    from peagle_core.model.config import PEagleConfig
    from peagle_core.model.drafter import PEagleDraftModel

    torch.manual_seed(0)
    config = PEagleConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        num_layers=2,
        num_depths=3,
        down_sample_ratio=0.7,
        down_sample_ratio_min=0.2,
        max_anchors=None,
        aux_layer_ids=[0, 2, 3],
        mask_token_id=3,
        norm_before_residual=True,
        verifier_name_or_path=VERIFIER_NAME,
        verifier_architectures=["LlamaForCausalLM"],
    )
    model = PEagleDraftModel(config)
    if draft_vocab < vocab:  # a non-trivial map: every 7th verifier token, so d2t offsets differ per entry
        t2d = torch.zeros(vocab, dtype=torch.bool)
        targets = torch.arange(draft_vocab) * 7
        t2d[targets] = True
        model.set_vocab_map(t2d, targets - torch.arange(draft_vocab))
    with torch.no_grad():  # make every tensor distinct from its init so the round trip proves something
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    """An fp32 export, so a reload compares bit for bit (and edits below stay one dtype)."""
    return export_checkpoint(
        _small_model(),
        tmp_path / "ckpt",
        verifier_name_or_path=VERIFIER_NAME,
        data_fingerprint="abc123",
        metrics={"eval/acceptance_length@3": 2.5},
        dtype="fp32",
    )


def test_config_follows_the_contract(exported: Path) -> None:
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle"
    assert cfg["architectures"] == ["PEagleDraftModel"]
    assert cfg["mask_token_id"] == cfg["pard_token"] == 3
    assert cfg["draft_vocab_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert cfg["norm_before_residual"] is True
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama"
    assert layer["num_hidden_layers"] == 2 and layer["vocab_size"] == 512 and layer["head_dim"] == 8
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "peagle"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3}]
    assert sc["default_proposal_method"] == "greedy"
    assert sc["verifier"] == {"name_or_path": VERIFIER_NAME, "architectures": ["LlamaForCausalLM"]}
    assert "speculators_version" in cfg
    readme = (exported / "README.md").read_text()
    assert "abc123" in readme and "2.5" in readme
    assert (
        f"VLLM_USE_V2_MODEL_RUNNER=0 vllm serve {VERIFIER_NAME} --speculative-config "
        f'\'{{"model": "{exported}", "method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": true}}\''
    ) in readme


def test_tensor_names_are_unprefixed_and_verifier_head_is_left_out(exported: Path) -> None:
    names = set(load_file(str(exported / "model.safetensors")))
    assert {
        "fc.weight",
        "mask_hidden",
        "d2t",
        "t2d",
        "embed_tokens.weight",
        "lm_head.weight",
        "norm.weight",
    } <= names
    assert "layers.0.hidden_norm.weight" in names and "layers.1.self_attn.q_proj.weight" in names
    assert "layers.1.hidden_norm.weight" not in names
    assert not any(n.startswith(("model.", "verifier")) for n in names)
    assert validate_checkpoint(exported) == []


def test_round_trip_is_bit_exact(exported: Path) -> None:
    from peagle_core.model.drafter import PEagleDraftModel

    loaded = PEagleDraftModel.from_pretrained(exported)
    saved = load_file(str(exported / "model.safetensors"))
    state = loaded.state_dict()
    for name, tensor in saved.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name
    original = _small_model()
    for name, tensor in saved.items():
        assert torch.equal(original.state_dict()[name], tensor), name


def _break_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _break_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_rejects_a_missing_tensor(exported: Path) -> None:
    _break_tensors(exported, lambda t: t.pop("layers.1.mlp.down_proj.weight"))
    assert validate_checkpoint(exported) == [
        "model.safetensors: missing tensor 'layers.1.mlp.down_proj.weight'"
    ]


def test_rejects_a_wrong_shape(exported: Path) -> None:
    _break_tensors(exported, lambda t: t.__setitem__("fc.weight", torch.zeros(32, 64)))
    assert validate_checkpoint(exported) == [
        "model.safetensors: tensor 'fc.weight' has shape [32, 64], expected [32, 96]"
    ]


def test_rejects_a_wrong_dtype(exported: Path) -> None:
    _break_tensors(exported, lambda t: t.__setitem__("d2t", t["d2t"].to(torch.int32)))
    assert validate_checkpoint(exported) == [
        "model.safetensors: tensor 'd2t' has dtype int32, expected int64"
    ]


def test_rejects_a_wrong_mask_hidden_shape(exported: Path) -> None:
    _break_tensors(exported, lambda t: t.__setitem__("mask_hidden", torch.zeros(1, 96)))
    assert validate_checkpoint(exported) == [
        "model.safetensors: tensor 'mask_hidden' has shape [1, 96], expected [1, 1, 96]"
    ]


def test_rejects_a_missing_mask_token_id(exported: Path) -> None:
    _break_config(exported, lambda c: c.pop("mask_token_id"))
    assert validate_checkpoint(exported) == ["config.json: missing required field 'mask_token_id'"]


def test_accepts_a_checkpoint_without_pard_token(exported: Path) -> None:
    # speculators' own checkpoints carry only mask_token_id, which is what vLLM's parallel drafting reads
    _break_config(exported, lambda c: c.pop("pard_token"))
    assert validate_checkpoint(exported) == []


def test_rejects_a_mask_token_outside_the_vocabulary(exported: Path) -> None:
    def edit(c: dict) -> None:
        c["mask_token_id"] = c["pard_token"] = 512

    _break_config(exported, edit)
    assert validate_checkpoint(exported) == [
        "config.json: mask_token_id 512 is outside the vocabulary [0, 512)"
    ]


def test_rejects_d2t_out_of_range(exported: Path) -> None:
    def edit(t: dict) -> None:
        t["d2t"][5] = 10_000

    _break_tensors(exported, edit)
    problems = validate_checkpoint(exported)
    assert problems == [
        "d2t: entry 5 maps to token 10005, outside the vocabulary [0, 512) (1 of 64 entries out of range)"
    ]


def test_rejects_d2t_disagreeing_with_t2d(exported: Path) -> None:
    def edit(t: dict) -> None:
        t["t2d"][7] = False  # draft id 1 maps to token 7 ...
        t["t2d"][8] = True  # ... but t2d marks 8 instead

    _break_tensors(exported, edit)
    assert validate_checkpoint(exported) == [
        "d2t/t2d: the tokens i + d2t[i] are not exactly the positions t2d marks"
    ]


def test_rejects_t2d_with_the_wrong_count(exported: Path) -> None:
    _break_tensors(exported, lambda t: t["t2d"].__setitem__(1, True))
    assert validate_checkpoint(exported) == ["t2d: marks 65 tokens, expected exactly draft_vocab_size=64"]


def test_rejects_nested_rope_parameters_and_missing_layer_fields(exported: Path) -> None:
    def edit(c: dict) -> None:
        c["transformer_layer_config"]["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": 1.0}
        }
        del c["transformer_layer_config"]["head_dim"]

    _break_config(exported, edit)
    problems = validate_checkpoint(exported)
    assert "config.json: transformer_layer_config is missing 'head_dim'" in problems
    assert any("rope_parameters must be a flat object" in p for p in problems)


def test_checks_against_the_verifier_config(exported: Path) -> None:
    verifier = {
        "hidden_size": 48,
        "vocab_size": 512,
        "num_hidden_layers": 3,
        "architectures": ["LlamaForCausalLM"],
    }
    problems = validate_checkpoint(exported, verifier)
    assert problems == [
        "config.json: transformer_layer_config.hidden_size is 32, the verifier's is 48",
        "config.json: eagle_aux_hidden_state_layer_ids [3] do not exist in the 3-layer verifier",
    ]
    ok = {"hidden_size": 32, "vocab_size": 512, "num_hidden_layers": 4, "architectures": ["LlamaForCausalLM"]}
    assert validate_checkpoint(exported, ok) == []


def test_corrupt_and_missing_files(tmp_path: Path, exported: Path) -> None:
    (exported / "model.safetensors").write_bytes(b"not a safetensors file")
    [problem] = validate_checkpoint(exported)
    assert problem.startswith("model.safetensors: cannot be read")
    assert validate_checkpoint(tmp_path / "nowhere") == [f"{tmp_path / 'nowhere'}: not a directory"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert validate_checkpoint(empty) == ["config.json: missing", "model.safetensors: missing"]


def test_loading_a_broken_checkpoint_names_the_problem(exported: Path) -> None:
    from peagle_core.model.drafter import PEagleDraftModel

    _break_config(exported, lambda c: c.pop("mask_token_id"))
    with pytest.raises(CheckpointError, match="mask_token_id"):
        PEagleDraftModel.from_pretrained(exported)


def test_cli_validate(exported: Path) -> None:
    from peagle_core.cli import build_app

    runner = CliRunner()
    ok = runner.invoke(build_app(), ["export", "validate", str(exported)])
    assert ok.exit_code == 0 and ok.output.strip() == "OK"
    _break_tensors(exported, lambda t: t.pop("mask_hidden"))
    _break_config(exported, lambda c: c.pop("mask_token_id"))
    bad = runner.invoke(build_app(), ["export", "validate", str(exported)])
    assert bad.exit_code == 1
    assert bad.output.splitlines() == [
        "config.json: missing required field 'mask_token_id'",
        "model.safetensors: missing tensor 'mask_hidden'",
    ]


def test_every_config_field_has_one_place_in_config_json() -> None:
    from peagle_core.model.config import PEagleConfig
    from peagle_core.model.speculators import CONFIG_FIELDS, config_from_json, config_json

    assert CONFIG_FIELDS.keys() == PEagleConfig.model_fields.keys()
    paths = [f.path for f in CONFIG_FIELDS.values()]
    assert len(set(paths)) == len(paths)
    config = _small_model().config.model_copy(update={"max_anchors": 7, "down_sample_ratio": 0.5})
    assert config_from_json(json.loads(json.dumps(config_json(config)))) == config


def test_a_failing_export_publishes_nothing(tmp_path: Path) -> None:
    other_verifier = {"hidden_size": 48, "vocab_size": 512, "num_hidden_layers": 4}
    with pytest.raises(CheckpointError, match="hidden_size is 32, the verifier's is 48"):
        export_checkpoint(
            _small_model(),
            tmp_path / "ckpt",
            verifier_name_or_path=VERIFIER_NAME,
            verifier_config=other_verifier,
        )
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- what vLLM's loader needs


def _export(tmp_path: Path, name: str = "ckpt", **kwargs) -> Path:
    vocab = kwargs.pop("vocab", 512)
    model = _small_model(vocab=vocab, draft_vocab=kwargs.pop("draft_vocab", vocab))
    return export_checkpoint(model, tmp_path / name, verifier_name_or_path=VERIFIER_NAME, **kwargs)


def test_the_default_export_is_bf16_and_loads_back(tmp_path: Path) -> None:
    from peagle_core.model.drafter import PEagleDraftModel

    path = _export(tmp_path, draft_vocab=64)
    saved = load_file(str(path / "model.safetensors"))
    assert {t.dtype for t in saved.values() if t.is_floating_point()} == {torch.bfloat16}
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool
    assert validate_checkpoint(path) == []
    original = _small_model(draft_vocab=64).state_dict()
    loaded = PEagleDraftModel.from_pretrained(path).state_dict()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor.to(loaded[name].dtype)), name
        assert torch.equal(tensor, original[name].to(tensor.dtype)), name


def test_a_full_vocabulary_export_has_no_vocab_map(tmp_path: Path) -> None:
    from peagle_core.model.drafter import PEagleDraftModel

    model = _small_model(vocab=512, draft_vocab=512)
    assert not {"d2t", "t2d"} & set(model.state_dict())
    path = export_checkpoint(model, tmp_path / "ckpt", verifier_name_or_path=VERIFIER_NAME)
    names = set(load_file(str(path / "model.safetensors")))
    assert "mask_hidden" in names and not {"d2t", "t2d"} & names
    assert validate_checkpoint(path) == []
    loaded = PEagleDraftModel.from_pretrained(path)
    assert torch.equal(loaded.d2t, torch.zeros(512, dtype=torch.long))
    assert bool(loaded.t2d.all())
    assert torch.equal(loaded.verifier_ids(), torch.arange(512))


def test_rejects_a_vocab_map_with_the_full_vocabulary(tmp_path: Path) -> None:
    path = _export(tmp_path)

    def edit(t: dict) -> None:
        t["d2t"] = torch.zeros(512, dtype=torch.long)
        t["t2d"] = torch.ones(512, dtype=torch.bool)

    _break_tensors(path, edit)
    reason = "the draft vocabulary is the full vocabulary (512), for which vLLM has no vocabulary map and refuses one"
    assert validate_checkpoint(path) == [
        f"model.safetensors: tensor 'd2t' must not be present: {reason}",
        f"model.safetensors: tensor 't2d' must not be present: {reason}",
    ]


def test_rejects_multimodal_rope_settings(exported: Path) -> None:
    def edit(c: dict) -> None:
        c["transformer_layer_config"]["rope_parameters"].update(
            mrope_section=[2, 1, 1], mrope_interleaved=True
        )

    _break_config(exported, edit)
    assert validate_checkpoint(exported) == [
        "config.json: transformer_layer_config.rope_parameters has multimodal rotary settings "
        "['mrope_section', 'mrope_interleaved']: vLLM refuses parallel drafting for an M-RoPE drafter, "
        "and on text it is plain RoPE"
    ]


def test_rejects_unsorted_aux_layer_ids(exported: Path) -> None:
    _break_config(exported, lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [3, 0, 2]))
    assert validate_checkpoint(exported) == [
        "config.json: eagle_aux_hidden_state_layer_ids [3, 0, 2] must be distinct and ascending: "
        "vLLM gathers the verifier's aux hidden states in layer order"
    ]


def test_rejects_a_dtype_mix(tmp_path: Path) -> None:
    path = _export(tmp_path, draft_vocab=64)
    _break_tensors(path, lambda t: t.__setitem__("norm.weight", t["norm.weight"].float()))
    assert validate_checkpoint(path) == [
        "model.safetensors: float tensors mix dtypes ['bfloat16', 'float32']; a checkpoint holds one "
        "(bf16, or fp32 when export.dtype asks for it)"
    ]


def test_cli_validate_gives_a_reason_for_each_vllm_rule(tmp_path: Path) -> None:
    from peagle_core.cli import build_app

    path = _export(tmp_path)

    def edit_tensors(t: dict) -> None:
        t["d2t"] = torch.zeros(512, dtype=torch.long)
        t["fc.weight"] = t["fc.weight"].float()

    def edit_config(c: dict) -> None:
        c["transformer_layer_config"]["rope_parameters"]["mrope_section"] = [2, 1, 1]
        c["eagle_aux_hidden_state_layer_ids"] = [2, 0, 3]

    _break_tensors(path, edit_tensors)
    _break_config(path, edit_config)
    result = CliRunner().invoke(build_app(), ["export", "validate", str(path)])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert len(lines) == 4
    assert "rope_parameters has multimodal rotary settings ['mrope_section']" in lines[0]
    assert "eagle_aux_hidden_state_layer_ids [2, 0, 3] must be distinct and ascending" in lines[1]
    assert lines[2].startswith("model.safetensors: tensor 'd2t' must not be present")
    assert lines[3].startswith("model.safetensors: float tensors mix dtypes ['bfloat16', 'float32']")


def test_the_model_card_serves_at_the_recommended_k(tmp_path: Path) -> None:
    from peagle_core.serving.gate import ServingCheck
    from peagle_core.serving.recommendation import ServingRecommendation
    from peagle_core.serving.speedup import Speedup

    rows = [
        Speedup(method="eagle3", k=1, batch_size=1, speedup=1.3),
        Speedup(method="eagle3", k=3, batch_size=1, speedup=1.1),
        Speedup(method="ngram", k=3, batch_size=1, speedup=1.05),
    ]
    rec = ServingRecommendation.choose(rows)
    assert rec is not None and rec.k == 1

    def verified(tmp: Path) -> ServingCheck:
        return ServingCheck(
            status="verified", served_by="vllm 0", k=3, prompts=2, acceptance_length=1.5,
            acceptance_rate_per_position=[0.5, 0.0, 0.0], speedups=rows, recommendation=rec,
        )  # fmt: skip

    out = export_checkpoint(
        _small_model(), tmp_path / "ckpt", verifier_name_or_path=VERIFIER_NAME, speculative_tokens=3,
        serving=verified,
    )  # fmt: skip
    card = (out / "README.md").read_text()
    assert f"- measured in vLLM: {rec.sentence()}" in card
    assert '"num_speculative_tokens": 1' in card and '"num_speculative_tokens": 3' not in card
    assert ServingCheck.load(out).recommendation == rec
