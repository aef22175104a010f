"""`peagle data prepare|validate`: tokenize and mask chat JSONL for a verifier, or check its structure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from peagle_core.cli.common import RevisionOption, TrustRemoteCodeOption, VerifierOption

app = typer.Typer(no_args_is_help=True, help="Training data: validate and prepare JSONL datasets.")


@app.command("prepare")
def prepare(
    verifier: VerifierOption,
    data: Annotated[Path, typer.Option("--data", help="JSONL dataset (messages, ShareGPT or tokenized).")],
    out: Annotated[Path, typer.Option("--out", help="Prepared dataset directory to write.")],
    seq_len: Annotated[
        int, typer.Option("--seq-len", min=3, help="Truncate samples to this many tokens.")
    ] = 2048,
    fmt: Annotated[str, typer.Option("--format", help="auto, messages, sharegpt or tokenized.")] = "auto",
    max_samples: Annotated[int | None, typer.Option("--max-samples", min=1)] = None,
    draft_vocab_size: Annotated[
        int | None,
        typer.Option(
            "--draft-vocab-size", min=1, help="Draft vocabulary size (default: the full vocabulary)."
        ),
    ] = None,
    revision: RevisionOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
) -> None:
    """Apply the verifier's chat template, mask assistant tokens, truncate, build the draft vocabulary."""
    from peagle_core.data import prepare_dataset

    ds = prepare_dataset(
        verifier,
        data,
        out,
        seq_len=seq_len,
        fmt=fmt,
        max_samples=max_samples,
        draft_vocab_size=draft_vocab_size,
        revision=revision,
        trust_remote_code=trust_remote_code,
    )
    keys = ("num_samples", "num_tokens", "num_loss_tokens", "draft_vocab_size", "fingerprint")
    typer.echo(json.dumps({"path": str(out), **{k: ds.manifest[k] for k in keys}}))


@app.command("validate")
def validate(
    data: Annotated[Path, typer.Argument(help="JSONL dataset to check.")],
    fmt: Annotated[str, typer.Option("--format", help="auto, messages, sharegpt or tokenized.")] = "auto",
) -> None:
    """Check a JSONL dataset's structure (no tokenizer); exits non-zero naming the first bad line."""
    from peagle_core.data.formats import validate_jsonl
    from peagle_core.errors import DataError

    if not data.is_file():
        raise DataError(f"dataset file {str(data)!r} does not exist", param="data")
    typer.echo(json.dumps(validate_jsonl(data, fmt).to_dict()))
