"""The CPU recipe is one shipped preset: it is a valid job spec, and the real demo and the real-model benches
build their jobs from it, departing only where they say so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from peagle_core.recipes.preset import (
    DEFAULT_RECIPE,
    RECIPES_DIR,
    RecipeError,
    load_recipe,
    parse_recipe,
    recipe_names,
)
from peagle_core.recipes.prompts import round_robin
from peagle_core.spec import parse_spec

BENCH = Path(__file__).resolve().parents[2] / "bench"
PROMPTS = [{"prompt": "Write a haiku.", "category": "writing"}]


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested spec as {dotted path: leaf value}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.fixture
def bench_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/ is a folder of scripts that import their helpers by name, as `python bench/x.py` does."""
    monkeypatch.syspath_prepend(str(BENCH))


def test_the_preset_is_a_valid_job_spec_with_the_measured_winner() -> None:
    recipe = load_recipe(DEFAULT_RECIPE)
    assert DEFAULT_RECIPE in recipe_names() and recipe.label == "smollm2-cpu@1"
    spec = parse_spec(recipe.job_spec("/models/smollm2", dataset_path="/data/sharegpt.jsonl"))
    # docs/decisions.md, "The CPU recipe": K=2 trained, Muon, one pass over whole conversations, vocabulary
    # 8,192, one layer, COD 0.7 / 0.2, bf16 where fast, offline hidden states from vLLM.
    assert (spec.model.num_depths, spec.model.num_layers, spec.model.draft_vocab_size) == (2, 1, 8192)
    assert (spec.model.down_sample_ratio, spec.model.down_sample_ratio_min) == (0.7, 0.2)
    assert (spec.training.optimizer, spec.training.epochs, spec.training.precision) == ("muon", 1, "auto")
    assert (spec.hidden_states.mode, spec.hidden_states.engine) == ("offline", "vllm")
    assert not spec.dataset.regenerate and spec.name == "smollm2-cpu@1"
    assert recipe.train_tokens == 3_000_000 and recipe.verifier == "smollm2-135m-instruct"
    assert recipe.headline_command == "python bench/real_model.py"


def test_a_bad_recipe_names_its_field_and_an_unknown_one_the_shipped_ones() -> None:
    raw = yaml.safe_load((RECIPES_DIR / f"{DEFAULT_RECIPE}.yaml").read_text())
    raw["data"]["train_tokens"] = "lots"
    with pytest.raises(RecipeError, match=r"`data\.train_tokens`"):
        parse_recipe(raw)
    with pytest.raises(RecipeError, match="smollm2-cpu"):
        load_recipe("no-such-recipe")


def test_the_real_demo_is_the_preset_with_its_documented_budget() -> None:
    from cli.demo_real import REAL_BUDGETS, RECIPE, real_spec

    recipe = load_recipe(RECIPE)
    budget = REAL_BUDGETS["default"]
    demo = real_spec("/models/smollm2", "ds_0123456789abcdef0123", PROMPTS, "default", vllm=True)
    preset = recipe.job_spec("/models/smollm2", dataset_id="ds_0123456789abcdef0123", eval_prompts=PROMPTS)
    parse_spec(demo)
    differs = {k for k, v in flat(demo).items() if flat(preset).get(k) != v} - {"name"}
    # Only its budget departs from the recipe: fewer tokens (not a spec field), the speed-up at batch 1 in
    # fewer rounds.
    assert differs == set(budget.overrides) == {"evaluation.speedup_batch_sizes", "evaluation.speedup_rounds"}
    assert budget.train_tokens < recipe.train_tokens


def test_the_real_model_bench_trains_the_preset(bench_modules: None) -> None:
    import real_model

    args = real_model.parser().parse_args([])
    spec = real_model.job_spec(
        args, Path("/models/smollm2"), Path("/data/d.jsonl"), PROMPTS, regenerate=False
    )
    preset = load_recipe(args.recipe).job_spec(
        "/models/smollm2", dataset_path="/data/d.jsonl", eval_prompts=PROMPTS
    )
    differs = {k for k, v in flat(spec).items() if flat(preset).get(k) != v} - {"name"}
    assert differs == set(real_model.BENCH_OVERRIDES) == {"evaluation.measure_speedup"}
    parse_spec(spec)
    # A flag departs from the recipe by name, and only where given.
    args = real_model.parser().parse_args(
        ["--optimizer", "adamw", "--num-depths", "4", "--freeze-lm-head", "1"]
    )
    spec = flat(real_model.job_spec(args, Path("/m"), Path("/d.jsonl"), PROMPTS, regenerate=False))
    assert (spec["training.optimizer"], spec["model.num_depths"], spec["model.freeze_lm_head"]) == (
        "adamw",
        4,
        True,
    )
    assert spec["training.lr"] == load_recipe().value("training.lr")


def test_the_sweep_and_the_scaling_run_start_from_the_preset(bench_modules: None) -> None:
    import _recipe
    import recipe_sweep

    base = _recipe.argparse.Namespace(
        recipe=DEFAULT_RECIPE, regen_tokens=96, **dict.fromkeys(_recipe.RECIPE_FLAGS)
    )
    name, variant = recipe_sweep.parse_variant("k4:num_depths=4,steps=200,in_vocab_only=1", base)
    assert name == "k4" and _recipe.overrides(variant) == {
        "model.num_depths": 4, "training.max_steps": 200, "training.in_vocab_targets_only": True,
    }  # fmt: skip
    assert _recipe.recipe_value(variant, "training.optimizer") == "muon"
    with pytest.raises(SystemExit, match="not one of"):
        recipe_sweep.parse_variant("wide:hidden=4096", base)


def test_mt_bench_prompts_come_one_category_after_another() -> None:
    rows = [
        ("w1", "writing"),
        ("w2", "writing"),
        ("m1", "math"),
        ("c1", None),
        ("m2", "math"),
        ("w3", "writing"),
    ]
    assert [p["prompt"] for p in round_robin(rows)] == ["w1", "m1", "c1", "w2", "m2", "w3"]
    assert round_robin(rows)[2] == {"prompt": "c1", "category": "all"}


def test_peagle_recipes_lists_the_preset_and_prints_its_spec() -> None:
    from peagle_core.cli import build_app

    runner = CliRunner()
    listed = runner.invoke(build_app(), ["recipes"])
    assert listed.exit_code == 0, listed.output
    assert [json.loads(line)["name"] for line in listed.output.splitlines()] == recipe_names()
    shown = runner.invoke(build_app(), ["recipes", DEFAULT_RECIPE, "--spec"])
    assert shown.exit_code == 0, shown.output
    assert parse_spec(yaml.safe_load(shown.output)).training.optimizer == "muon"
    missing = runner.invoke(build_app(), ["recipes", "nope"])
    assert missing.exit_code != 0 and "smollm2-cpu" in missing.output
