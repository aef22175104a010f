"""Planning: counts, cache bytes and steps match the real preparation; calibrated stage-time estimates are
within 2x of the measured stages on the toy setup; stored rates give the same plan without calibrating."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from peagle_core.plan import plan_job
from peagle_core.regenerate import params_for_spec, regenerate
from peagle_core.spec import parse_spec

STEPS = 80


@pytest.fixture
def spec_and_data(toy_verifier_dir: Path, tmp_path: Path):
    from peagle_core.toy import write_toy_dataset

    data = write_toy_dataset(tmp_path / "chat.jsonl", n=96, seed=2)
    spec = parse_spec(
        {
            "verifier": {"name_or_path": str(toy_verifier_dir)},
            "dataset": {
                "path": str(data),
                "seq_len": 128,
                "val_fraction": 0.25,
                "regenerate": {"max_new_tokens": 24},
            },
            "hidden_states": {"mode": "online", "max_cache_bytes": 10**6},
            "model": {"num_layers": 1, "num_depths": 2, "draft_vocab_size": 256},
            "training": {
                "epochs": 100,
                "max_steps": STEPS,
                "total_seq_len": 256,
                "checkpoint_every_steps": 1000,
            },
            # vLLM's evaluation is timed the same way; left out here, it would add an engine start to both sides
            "evaluation": {"prompts": 24, "max_new_tokens": 48, "engine": "peagle"},
            "export": {"vllm_check": False},
        }
    )
    return spec, data


def test_plan_estimates_are_within_2x_of_the_measured_stages(spec_and_data, tmp_path: Path) -> None:
    from peagle_core.data.prepare import PreparedDataset, prepare_for_spec
    from peagle_core.train import train

    spec, data = spec_and_data
    plan, rates = plan_job(spec, data, tmp_path / "plan", free_bytes=10**12)
    assert plan["estimates_from"] == "calibration" and plan["optimizer_steps"] == STEPS
    source = PreparedDataset.open(tmp_path / "plan" / "prepared")
    assert plan["counts"]["samples"] == len(source) == 96
    assert plan["counts"]["tokens"] == source.manifest["num_tokens"]
    by_dtype = plan["cache"]["by_dtype"]
    assert by_dtype["fp32"]["bytes"] > by_dtype["bf16"]["bytes"] > by_dtype["fp8"]["bytes"] > 0
    assert by_dtype["fp32"]["fits_free_space"] is True
    assert by_dtype["fp32"]["fits_max_cache_bytes"] == (by_dtype["fp32"]["bytes"] <= 10**6)

    # the stages measured as the worker runs them: regeneration, then training and its final evaluation
    t0 = time.perf_counter()
    regen_out = tmp_path / "regen.jsonl"
    regenerate(spec.verifier.name_or_path, data, regen_out, params_for_spec(spec))
    measured = {"regenerate": time.perf_counter() - t0}
    prepared = prepare_for_spec(spec, regen_out, tmp_path / "prepared").path
    marks: dict[str, float] = {}

    def on_event(kind: str, _message: str, _data: dict | None = None) -> None:
        now = time.perf_counter()
        if kind == "eval":
            marks.setdefault("eval", now)
        elif "eval" in marks:
            marks.setdefault("eval_end", now)

    t0 = time.perf_counter()
    result = train(spec, tmp_path / "run", resume=False, dataset_dir=prepared, on_event=on_event)
    assert result.step == STEPS
    measured["train"] = marks["eval"] - t0
    measured["eval"] = marks["eval_end"] - marks["eval"]
    estimated = plan["stages_s"]
    for stage, seconds in measured.items():
        assert seconds / 2 <= estimated[stage] <= 2 * seconds, (stage, estimated, measured)
    assert estimated["hidden_states"] == 0.0  # online: computed inside the training steps

    again, _ = plan_job(spec, data, tmp_path / "plan2", rates=rates)
    assert again["estimates_from"] == "stored" and again["stages_s"] == estimated


def test_the_vllm_engine_stage_uses_the_vllm_rates(spec_and_data, tmp_path: Path) -> None:
    from peagle_core.plan import Rates

    spec, data = spec_and_data
    spec = parse_spec(
        {
            **spec.model_dump(mode="json"),
            "hidden_states": {"mode": "offline", "engine": "vllm"},
            "resources": {"gpus": 2, "data_parallel_size": 2},
        }
    )
    rates = Rates(device="test", measured_at="now", verifier_load_s=3.0, hs_tokens_per_s=1000.0,
                  train_setup_s=1.0, train_step_s=0.5, train_tokens_per_step=256.0, eval_s_per_pass=0.01,
                  eval_tokens_per_prompt=10.0, vllm_hs_start_s=20.0, vllm_hs_tokens_per_s=4000.0)  # fmt: skip
    plan, _ = plan_job(spec, data, tmp_path / "plan", rates=rates)
    tokens = plan["counts"]["tokens"]
    assert plan["hidden_states_engine"] == "vllm"
    # the engine's start, then the tokens at two replicas' rate
    assert plan["stages_s"]["hidden_states"] == round(20.0 + tokens / 8000.0, 1)
    plain, _ = plan_job(parse_spec({**spec.model_dump(mode="json"), "hidden_states": {"mode": "offline"},
                                    "resources": {}}), data, tmp_path / "plain", rates=rates)  # fmt: skip
    assert plain["stages_s"]["hidden_states"] == round(3.0 + tokens / 1000.0, 1)


def test_a_prompts_only_dataset_is_refused_by_name_before_any_work(tmp_path: Path) -> None:
    from peagle_core.errors import DataError

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                    '{"messages": [{"role": "user", "content": "only a prompt"}]}\n')  # fmt: skip
    spec = parse_spec(
        {
            "verifier": {"name_or_path": str(tmp_path / "not-loaded")},
            "dataset": {"path": str(data), "regenerate": True},
        }
    )
    with pytest.raises(DataError, match=r"line 2: no assistant turn.*cannot be planned") as exc:
        plan_job(spec, data, tmp_path / "work")
    assert exc.value.param == "dataset.regenerate"
