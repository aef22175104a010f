"""`peagle recipes`: the training recipes shipped with the package, one JSON line each (or one recipe's job
spec with `--spec`)."""

from __future__ import annotations

import json
from typing import Annotated

import typer


def recipes(
    name: Annotated[str | None, typer.Argument(help="One recipe (default: list them all).")] = None,
    spec: Annotated[
        bool,
        typer.Option("--spec", help="Print the recipe's job spec as YAML (fill in verifier and dataset)."),
    ] = False,
) -> None:
    """The shipped training recipes: name, version, what they train, the command behind their figure."""
    import yaml

    from peagle_core.cli.common import fail
    from peagle_core.recipes.preset import RecipeError, load_recipe, recipe_names

    try:
        chosen = [load_recipe(n) for n in ([name] if name else recipe_names())]
    except RecipeError as exc:
        fail(exc.message)
    for r in chosen:
        if spec:
            typer.echo(yaml.safe_dump(r.job_spec("VERIFIER_DIR", dataset_path="DATA.jsonl"), sort_keys=False))
            continue
        typer.echo(json.dumps({
            "name": r.name, "version": r.version, "verifier": r.verifier, "dataset": r.dataset,
            "train_tokens": r.train_tokens, "description": r.description,
            "headline_command": r.headline_command, "headline_figure": r.headline_figure,
        }))  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command("recipes")(recipes)
