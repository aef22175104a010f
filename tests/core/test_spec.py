"""The job spec names every bad field and maps YAML/JSON files 1:1."""

from __future__ import annotations

import json

import pytest

from peagle_core.spec import JobSpec, SpecError, load_spec, parse_spec

BASE = {"verifier": {"name_or_path": "/models/v"}, "dataset": {"path": "/data/chat.jsonl", "seq_len": 512}}


def test_defaults_follow_the_parameter_table() -> None:
    spec = parse_spec(BASE)
    assert (spec.model.num_layers, spec.model.num_depths) == (4, 4)
    assert (spec.model.down_sample_ratio, spec.model.down_sample_ratio_min) == (0.7, 0.2)
    assert spec.model.norm_before_residual is True
    assert spec.model.init_lm_head_from_verifier is True
    off = parse_spec({**BASE, "model": {"init_lm_head_from_verifier": False}})
    assert off.model.init_lm_head_from_verifier is False
    assert spec.training.lr == 6e-4
    assert spec.speculative_tokens == [4]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"training": {"lr": -1}}, "training.lr"),
        ({"model": {"down_sample_ratio": 0}}, "model.down_sample_ratio"),
        ({"model": {"down_sample_ratio_min": 1.5}}, "model.down_sample_ratio_min"),
        ({"hidden_states": {"mode": "sometimes"}}, "hidden_states.mode"),
        ({"verifier": {"name_or_path": "v", "layer_ids": [1, 1, 2]}}, "verifier.layer_ids"),
        ({"training": {"epochs": 0}}, "training.epochs"),
        ({"training": {"bogus": 1}}, "training.bogus"),
        ({"resources": {"queue": "no spaces"}}, "resources.queue"),
        ({"export": {"dtype": "fp16"}}, "export.dtype"),
        # Every list and number a client sends has an upper bound.
        ({"evaluation": {"prompts": ["p"] * 1001}}, "evaluation.prompts"),
        ({"evaluation": {"prompts": ["p" * 40000]}}, "evaluation.prompts"),
        ({"evaluation": {"prompts": 10**6}}, "evaluation.prompts"),
        ({"evaluation": {"speculative_tokens": [1] * 33}}, "evaluation.speculative_tokens"),
        ({"evaluation": {"speculative_tokens": [10**9]}}, "evaluation.speculative_tokens.0"),
        ({"training": {"seed": 2**63}}, "training.seed"),
        ({"verifier": {"name_or_path": "v", "layer_ids": [1, 2, 10**9]}}, "verifier.layer_ids.2"),
        ({"dataset": {"path": "d", "max_samples": 10**12}}, "dataset.max_samples"),
        ({"dataset": {"path": "d", "seq_len": 10**7}}, "dataset.seq_len"),
        ({"model": {"max_anchors": 10**9}}, "model.max_anchors"),
        ({"model": {"num_layers": 65}}, "model.num_layers"),
        ({"model": {"num_depths": 33}}, "model.num_depths"),
        ({"model": {"draft_vocab_size": 10**9}}, "model.draft_vocab_size"),
        ({"training": {"checkpoint_every_steps": 10**12}}, "training.checkpoint_every_steps"),
        ({"training": {"max_steps": 10**12}}, "training.max_steps"),
        ({"training": {"lr": 2.0}}, "training.lr"),
        ({"hidden_states": {"max_cache_bytes": 1 << 60}}, "hidden_states.max_cache_bytes"),
    ],
)
def test_bad_fields_are_named(patch: dict, param: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({**BASE, **patch})
    assert param in [p for p, _ in info.value.errors]
    assert param in str(info.value)


@pytest.mark.parametrize(
    "prompts",
    [
        [{"prompt": "p", "category": ""}],
        [{"prompt": "p", "category": "c" * 65}],
        [{"prompt": "p" * 40000, "category": "c"}],
        [{"prompt": "", "category": "c"}],
        [{"prompt": "p", "topic": "c"}],
        [{"category": "c"}],
    ],
)
def test_categorised_prompts_are_bounded_and_named(prompts: list) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({**BASE, "evaluation": {"prompts": prompts}})
    assert all(p.startswith("evaluation.prompts") for p, _ in info.value.errors)


def test_prompts_may_carry_a_category_and_round_trip() -> None:
    raw = ["plain", {"prompt": "Write a poem.", "category": "writing"}, {"prompt": "No category."}]
    spec = parse_spec({**BASE, "evaluation": {"prompts": raw}})
    dumped = spec.model_dump(mode="json", exclude_none=True)["evaluation"]["prompts"]
    assert dumped == raw and parse_spec(spec.model_dump(mode="json")) == spec


def test_cross_field_rules() -> None:
    with pytest.raises(SpecError, match="speculative_tokens"):
        parse_spec({**BASE, "evaluation": {"speculative_tokens": [8]}})
    with pytest.raises(SpecError, match="total_seq_len"):
        parse_spec({**BASE, "training": {"total_seq_len": 256}})
    with pytest.raises(SpecError, match=r"evaluation\.measure_speedup.*export\.vllm_check"):
        parse_spec({**BASE, "evaluation": {"measure_speedup": True}, "export": {"vllm_check": False}})
    with pytest.raises(SpecError, match="exactly one"):
        parse_spec({**BASE, "dataset": {"path": "a", "id": "b"}})


def test_speculative_tokens_are_deduplicated_and_bounded_by_num_depths() -> None:
    spec = parse_spec({**BASE, "evaluation": {"speculative_tokens": [3, 1, 3, 1, 2]}})
    assert spec.evaluation.speculative_tokens == [1, 2, 3]
    with pytest.raises(SpecError, match="num_depths"):
        parse_spec({**BASE, "model": {"num_depths": 2}, "evaluation": {"speculative_tokens": [1, 3]}})
    assert parse_spec({**BASE, "training": {"seed": 2**63 - 1}}).training.seed == 2**63 - 1


def test_yaml_and_json_files_map_one_to_one(tmp_path) -> None:
    y = tmp_path / "spec.yaml"
    y.write_text("verifier:\n  name_or_path: /m\ndataset:\n  path: /d.jsonl\nmodel:\n  num_depths: 6\n")
    j = tmp_path / "spec.json"
    j.write_text(
        json.dumps(
            {"verifier": {"name_or_path": "/m"}, "dataset": {"path": "/d.jsonl"}, "model": {"num_depths": 6}}
        )
    )
    assert load_spec(y) == load_spec(j)
    assert JobSpec.model_validate(load_spec(y).model_dump()) == load_spec(y)


def test_file_errors_name_the_line(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("verifier:\n  name_or_path: [unclosed\n")
    with pytest.raises(SpecError, match="line"):
        load_spec(bad)


def test_layer_ids_resolve_ascending_and_export_defaults_to_bf16() -> None:
    spec = parse_spec({**BASE, "verifier": {"name_or_path": "v", "layer_ids": [13, 2, 8]}})
    assert spec.verifier.layer_ids == [2, 8, 13]
    assert spec.export.dtype == "bf16"
    assert parse_spec({**BASE, "export": {"dtype": "fp32"}}).export.dtype == "fp32"


def test_yaml_infinity_is_refused_naming_the_field(tmp_path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("verifier: {name_or_path: v}\ndataset: {path: d.jsonl}\ntraining: {grad_clip: .inf}\n")
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert err.value.param == "training.grad_clip"
    assert "finite" in err.value.message


def test_hidden_states_engine_and_vllm_parallelism() -> None:
    spec = parse_spec(BASE)
    assert spec.hidden_states.engine == "transformers" and spec.hidden_states.keep_online is False
    assert (spec.resources.tensor_parallel_size, spec.resources.data_parallel_size) == (1, 1)
    big = parse_spec({**BASE, "hidden_states": {"engine": "vllm"},
                      "resources": {"gpus": 8, "tensor_parallel_size": 4, "data_parallel_size": 2}})  # fmt: skip
    assert (big.resources.tensor_parallel_size, big.resources.data_parallel_size) == (4, 2)
    for patch, param in (
        ({"hidden_states": {"engine": "sglang"}}, "hidden_states.engine"),
        ({"resources": {"tensor_parallel_size": 65}}, "resources.tensor_parallel_size"),
        ({"resources": {"data_parallel_size": 0}}, "resources.data_parallel_size"),
    ):
        with pytest.raises(SpecError) as err:
            parse_spec({**BASE, **patch})
        assert err.value.param == param
    with pytest.raises(SpecError, match=r"apply to hidden_states\.engine: vllm"):
        parse_spec({**BASE, "resources": {"gpus": 4, "tensor_parallel_size": 4}})
    with pytest.raises(SpecError, match=r"\(8\) exceeds gpus \(4\)"):
        parse_spec({**BASE, "hidden_states": {"engine": "vllm"},
                    "resources": {"gpus": 4, "tensor_parallel_size": 4, "data_parallel_size": 2}})  # fmt: skip


@pytest.mark.parametrize(
    ("model", "param", "says"),
    [
        ({"ttt_steps": 3}, "model.ttt_steps", "applies to method eagle3 only"),
        ({"method": "eagle3", "ttt_steps": 0}, "model.ttt_steps", "greater than or equal to 1"),
        ({"method": "eagle3", "ttt_steps": 33}, "model.ttt_steps", "less than or equal to 32"),
        ({"method": "eagle3", "down_sample_ratio": 0.5}, "model.down_sample_ratio", "method peagle only"),
        ({"method": "eagle3", "max_anchors": 64}, "model.max_anchors", "method peagle only"),
        ({"method": "medusa"}, "model.method", "'peagle' or 'eagle3'"),
    ],
)
def test_method_fields_belong_to_their_method(model: dict, param: str, says: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({**BASE, "model": model})
    assert [p for p, _ in info.value.errors] == [param]
    assert says in str(info.value)


def test_eagle3_defaults_and_round_trip() -> None:
    assert parse_spec(BASE).model.method == "peagle"
    spec = parse_spec({**BASE, "model": {"method": "eagle3", "num_depths": 3}})
    assert (spec.model.ttt_steps, spec.model.row_depths) == (None, 3)  # unrolled as far as it drafts
    # The resolved spec (COD defaults included) validates again, as the worker re-reads it.
    assert parse_spec(spec.model_dump(mode="json")) == spec
    more = parse_spec({**BASE, "model": {"method": "eagle3", "ttt_steps": 5}})
    assert more.model.row_depths == 5
    with pytest.raises(SpecError, match=r"give 5 weights \(model.ttt_steps\)"):
        parse_spec(
            {**BASE, "model": {"method": "eagle3", "ttt_steps": 5}, "training": {"depth_weights": [1, 1]}}
        )
