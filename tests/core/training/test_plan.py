"""Planning: counts, cache bytes and steps match the real preparation; stage-time estimates are the
calibrated rates applied to them; stored rates give the same plan without calibrating. How close the
estimates come to measured stage times is `bench/plan_accuracy.py`'s (a timing, never a test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle_core.spec import parse_spec
from peagle_core.training.plan import plan_job

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


def test_plan_counts_and_estimates_follow_the_measured_rates(spec_and_data, tmp_path: Path) -> None:
    """Counts are exact; the stage times are the calibrated rates applied to them, so they scale with the
    rates and nothing here depends on how busy the machine is (bench/plan_accuracy.py compares the
    estimates with measured stage times)."""
    import dataclasses

    from peagle_core.data.prepare import PreparedDataset

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
    estimated = plan["stages_s"]
    assert all(estimated[s] > 0 for s in ("regenerate", "train", "eval"))
    assert estimated["hidden_states"] == 0.0  # online: computed inside the training steps

    again, _ = plan_job(spec, data, tmp_path / "plan2", rates=rates)
    assert again["estimates_from"] == "stored" and again["stages_s"] == estimated
    # A device twice as fast at everything: every stage takes half as long.
    fast = dataclasses.replace(
        rates,
        verifier_load_s=rates.verifier_load_s / 2,
        hs_tokens_per_s=rates.hs_tokens_per_s * 2,
        train_setup_s=rates.train_setup_s / 2,
        train_step_s=rates.train_step_s / 2,
        eval_s_per_pass=rates.eval_s_per_pass / 2,
        vllm_eval_s=rates.vllm_eval_s / 2,
        regen_s_per_batch=rates.regen_s_per_batch / 2 if rates.regen_s_per_batch else None,
        regen_tokens_per_s=rates.regen_tokens_per_s * 2 if rates.regen_tokens_per_s else None,
    )
    halved, _ = plan_job(spec, data, tmp_path / "plan3", rates=fast)
    for stage in ("regenerate", "train", "eval"):
        assert halved["stages_s"][stage] == pytest.approx(estimated[stage] / 2, abs=0.1), stage


def test_the_vllm_engine_stage_uses_the_vllm_rates(spec_and_data, tmp_path: Path) -> None:
    from peagle_core.training.plan import Rates

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
