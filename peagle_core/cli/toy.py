"""`peagle toy verifier|dataset`: build the tiny offline verifier and its chat corpus."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="The tiny offline verifier and corpus (tests, demo).")


@app.command("verifier")
def verifier(
    out: Annotated[Path, typer.Option("--out", help="Directory to write the HF model + tokenizer to.")],
    size: Annotated[
        str, typer.Option("--size", help="test (seconds) or default (a few minutes).")
    ] = "default",
    seed: Annotated[int, typer.Option("--seed", min=0)] = 0,
) -> None:
    """Train (or reuse from the cache) the toy Llama verifier and copy it to OUT."""
    from peagle_core.cli.common import fail
    from peagle_core.toy import SIZES, build_toy_verifier

    if size not in SIZES:
        fail(f"--size: expected one of {', '.join(SIZES)}, got {size!r}")
    path = build_toy_verifier(size, seed=seed, out=out)
    info = json.loads((path / "toy_verifier.json").read_text())
    keys = ("size", "seed", "mask_token_id", "heldout_next_token_accuracy", "heldout_perplexity")
    typer.echo(json.dumps({"path": str(path), **{k: info[k] for k in keys}}))


@app.command("dataset")
def dataset(
    out: Annotated[Path, typer.Option("--out", help="JSONL file to write (messages format).")],
    n: Annotated[
        int | None, typer.Option("--n", min=1, help="Number of conversations (default: all).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", min=0)] = 0,
) -> None:
    """Write the toy chat corpus (stdlib docstring Q&A) as JSONL."""
    from peagle_core.toy import write_toy_dataset

    path = write_toy_dataset(out, n=n, seed=seed)
    rows = sum(1 for _ in path.open("rb"))
    typer.echo(json.dumps({"path": str(path), "rows": rows}))
