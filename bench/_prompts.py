"""Real material the benches share: MT-Bench first turns in the product's one order, and training data
for `--data` (the recipe's token budget of whole ShareGPT conversations, or another selection)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _common import emit

from peagle_core.recipes.preset import DEFAULT_RECIPE


def mt_bench_prompts(n: int | None = None) -> list[dict[str, str]]:
    """The first `n` MT-Bench first turns as `{"prompt", "category"}`, one category after another
    (`peagle_core.recipes.prompts`: the demo's order too)."""
    from peagle_core.recipes.prompts import eval_prompts

    return eval_prompts("mt-bench", n)


def sharegpt_by_tokens(budget: int | None, seq_len: int, recipe: str = DEFAULT_RECIPE) -> Path:
    """The recipe's whole conversations in order, as written, until `budget` tokens (the recipe's when
    None) within `seq_len`; made once beside the catalogue's files, so every bench's store finds them."""
    from peagle_core.catalogue import datasets_dir
    from peagle_core.recipes.material import training_data as budgeted
    from peagle_core.recipes.preset import load_recipe

    preset = load_recipe(recipe)
    data = budgeted(preset, datasets_dir(), train_tokens=budget, seq_len=seq_len)
    emit(bench="data", source=preset.dataset, seq_len=seq_len, **data.to_dict())
    return data.path


def training_data(source: str, seq_len: int, recipe: str = DEFAULT_RECIPE) -> tuple[Path, bool]:
    """(chat JSONL, whether the verifier regenerates its answers) for `--data`: `recipe` (the recipe's
    own: whole conversations up to its token budget), `sharegpt-tokens:T` (the same up to T tokens),
    `regen:N` (N ShareGPT first turns the verifier answers), `sharegpt:N` (N short first turns as
    written), `sharegpt-all:N` (N whole conversations) or `file:PATH`."""
    from peagle_core.catalogue.datasets import fetch_catalogue_dataset

    kind, _, n = source.partition(":")
    limit = int(float(n)) if n and kind != "file" else None
    if kind in ("recipe", "sharegpt-tokens"):
        return sharegpt_by_tokens(limit, seq_len, recipe), False
    if kind == "regen":
        return fetch_catalogue_dataset("sharegpt", first_turn=True, prompts_only=True, limit=limit)[0], True
    if kind == "sharegpt":
        # Short prompts only: a prompt longer than seq_len leaves nothing to train on.
        full, _ = fetch_catalogue_dataset("sharegpt", first_turn=True)
        out = full.with_name(f"sharegpt-first-turn-short-n{limit}.jsonl")
        # Split on newlines only: the text holds U+2028 and other characters str.splitlines() breaks at.
        lines = [r for r in full.read_text().split("\n") if r.strip()]
        rows = [r for r in lines if len(json.loads(r)["messages"][0]["content"]) <= 500]
        out.write_text("\n".join(rows[:limit]) + "\n")
        return out, False
    if kind == "sharegpt-all":
        return fetch_catalogue_dataset("sharegpt", limit=limit)[0], False
    if kind == "file":
        return Path(n), False  # a chat JSONL already answered by the verifier (e.g. a job's regenerated data)
    raise SystemExit(
        f"--data {source!r}: use recipe, sharegpt-tokens:T, regen:N, sharegpt:N, sharegpt-all:N or file:PATH"
    )


def add_data_arg(p: argparse.ArgumentParser, default: str = "recipe") -> None:
    """`--data`, the `training_data` source."""
    p.add_argument(
        "--data",
        default=default,
        help="training data: recipe (the recipe's token budget of whole conversations), sharegpt-tokens:T, "
        "regen:N (N first turns answered by the verifier), sharegpt:N, sharegpt-all:N or file:PATH",
    )
