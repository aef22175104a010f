"""Which evaluators and gate a job runs (`evaluation.engine`, `export.vllm_check`), without vLLM itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle_core.serving.export import model_card
from peagle_core.serving.gate import NotServableError, ServingCheck
from peagle_core.serving.judge import EvaluatorUnavailableError, agreement_gap, resolve_evaluators
from peagle_core.spec import parse_spec

BASE = {"verifier": {"name_or_path": "/models/v"}, "dataset": {"path": "/data/x.jsonl"}}


def spec(engine: str = "auto", vllm_check: bool = True):
    return parse_spec({**BASE, "evaluation": {"engine": engine}, "export": {"vllm_check": vllm_check}})


def test_auto_means_both_where_vllm_is_installed_and_ours_elsewhere() -> None:
    on = resolve_evaluators(spec(), available=True)
    assert (on.ours, on.vllm, on.gate) == (True, True, True)
    off = resolve_evaluators(spec(), available=False)
    assert (off.ours, off.vllm, off.gate) == (True, False, False)
    assert off.gate_off_reason == "vLLM is not installed where this job ran"


def test_the_gate_can_be_switched_off_and_says_so() -> None:
    evaluators = resolve_evaluators(spec("peagle", vllm_check=False), available=True)
    assert not evaluators.needs_vllm and evaluators.gate_off_reason == "export.vllm_check is false"


@pytest.mark.parametrize("engine", ["vllm", "both"])
def test_asking_for_vllm_without_it_names_the_field(engine: str) -> None:
    with pytest.raises(EvaluatorUnavailableError) as err:
        resolve_evaluators(spec(engine), available=False)
    assert str(err.value).startswith("evaluation.engine:") and err.value.code == "invalid_spec"


def test_unknown_engine_is_a_spec_error() -> None:
    with pytest.raises(ValueError, match=r"evaluation\.engine"):
        spec("sglang")


def test_serving_check_round_trips_and_the_card_shows_unverified(tmp_path: Path) -> None:
    check = ServingCheck.unverified("vLLM is not installed where this job ran")
    check.save(tmp_path)
    assert ServingCheck.load(tmp_path) == check
    assert ServingCheck.load(tmp_path / "nowhere") is None
    from peagle_core.model.config import PEagleConfig

    config = PEagleConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
        head_dim=32, vocab_size=512, draft_vocab_size=512, aux_layer_ids=[0, 1, 2], mask_token_id=3,
    )  # fmt: skip
    card = model_card(
        verifier="/models/v", checkpoint_dir=tmp_path, k=2, data_fingerprint=None, metrics=None,
        model_config=config, serving=check,
    )  # fmt: skip
    assert "servable: **unverified** (vLLM is not installed where this job ran)" in card


def test_not_servable_has_its_own_error_code() -> None:
    assert NotServableError("vLLM refused").code == "export_not_servable"
    assert agreement_gap(2.0, 2.06) == pytest.approx(0.03)
