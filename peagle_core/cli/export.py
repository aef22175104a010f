"""`peagle export ...`: check a drafter checkpoint directory against the vLLM contract."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="Validate exported drafter checkpoints.")


@app.command("validate")
def export_validate(
    directory: Annotated[Path, typer.Argument(help="checkpoint directory (config.json + model.safetensors)")],
    verifier: Annotated[
        str | None,
        typer.Option("--verifier", help="verifier path or hub id whose config the drafter must match"),
    ] = None,
) -> None:
    """Print OK, or one line per problem and exit 1."""
    from peagle_core.serving.export import validate_checkpoint

    verifier_config = None
    if verifier is not None:
        from transformers import AutoConfig

        try:
            verifier_config = AutoConfig.from_pretrained(verifier)
        except (OSError, ValueError) as exc:
            from peagle_core.cli.common import fail

            fail(f"cannot load the verifier config {verifier!r}: {str(exc).splitlines()[0]}")
    problems = validate_checkpoint(directory, verifier_config)
    if not problems:
        typer.echo("OK")
        return
    for problem in problems:
        typer.echo(problem)
    raise typer.Exit(1)
