"""What the real-model benches (real_model.py, recipe_sweep.py, scaling.py) share: the product's recipe
preset (`peagle_core.recipes`) as their job spec, and the flags that depart from it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from peagle_core.recipes.preset import DEFAULT_RECIPE, load_recipe

# Each recipe flag (its argparse dest) and the spec field it sets; a flag left out keeps the recipe's value.
RECIPE_FLAGS: dict[str, tuple[str, type]] = {
    "seq_len": ("dataset.seq_len", int),
    "verifier_dtype": ("verifier.dtype", str),
    "hs_engine": ("hidden_states.engine", str),
    "num_layers": ("model.num_layers", int),
    "num_depths": ("model.num_depths", int),
    "draft_vocab": ("model.draft_vocab_size", int),
    "cod_ratio": ("model.down_sample_ratio", float),
    "cod_min": ("model.down_sample_ratio_min", float),
    "freeze_lm_head": ("model.freeze_lm_head", bool),
    "lr": ("training.lr", float),
    "warmup_ratio": ("training.warmup_ratio", float),
    "min_lr_ratio": ("training.min_lr_ratio", float),
    "epochs": ("training.epochs", int),
    "steps": ("training.max_steps", int),
    "total_seq_len": ("training.total_seq_len", int),
    "precision": ("training.precision", str),
    "optimizer": ("training.optimizer", str),
    "depth_weights": ("training.depth_weights", str),
    "tv_weight": ("training.tv_weight", float),
    "in_vocab_only": ("training.in_vocab_targets_only", bool),
}


def add_recipe_args(p: argparse.ArgumentParser) -> None:
    """`--recipe` and one flag per `RECIPE_FLAGS` entry, each defaulting to the recipe's value."""
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help="a shipped recipe (`peagle recipes`)")
    p.add_argument("--regen-tokens", type=int, default=192, help="answer length with --data regen:N")
    for dest, (path, kind) in RECIPE_FLAGS.items():
        flag = "--" + dest.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, type=int, choices=[0, 1], help=f"{path} (default: the recipe's)")
        else:
            p.add_argument(flag, type=kind, help=f"{path} (default: the recipe's)")


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The spec fields the flags set, by dotted path (nothing for a flag left at the recipe's value)."""
    out: dict[str, Any] = {}
    for dest, (path, kind) in RECIPE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        out[path] = (
            bool(value) if kind is bool else depth_weights(value) if dest == "depth_weights" else value
        )
    return out


def depth_weights(text: str) -> str | list[float]:
    """`training.depth_weights` from a flag: count, equal, or weights joined by '/'."""
    return text if text in ("count", "equal") else [float(w) for w in text.split("/")]


def recipe_spec(
    args: argparse.Namespace,
    verifier: Path,
    data: Path,
    eval_prompts: list[Any],
    *,
    regenerate: bool,
    name: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The job spec a bench trains with: the recipe's, then the flags', then the bench's own `extra`."""
    recipe = load_recipe(args.recipe)
    changes = {**overrides(args), **(extra or {})}
    if regenerate:
        changes["dataset.regenerate"] = {"engine": "vllm", "max_new_tokens": args.regen_tokens}
    return recipe.job_spec(
        str(verifier), dataset_path=str(data), eval_prompts=eval_prompts, name=name, overrides=changes
    )


def recipe_value(args: argparse.Namespace, path: str) -> Any:
    """A spec value as a bench runs it: the flag's where given, else the recipe's."""
    return overrides(args).get(path, load_recipe(args.recipe).value(path))
