"""`peagle data prepare|validate`: tokenize and mask chat JSONL for a verifier, or check its structure."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, help="Training data: validate and prepare JSONL datasets.")


@app.command("prepare")
def prepare(
    verifier: str = typer.Option(..., "--verifier", help="Verifier: local HF directory or hub id."),
    data: Path = typer.Option(..., "--data", help="JSONL dataset (messages, ShareGPT or tokenized)."),
    out: Path = typer.Option(..., "--out", help="Prepared dataset directory to write."),
    seq_len: int = typer.Option(2048, "--seq-len", min=3, help="Truncate samples to this many tokens."),
    fmt: str = typer.Option("auto", "--format", help="auto, messages, sharegpt or tokenized."),
    max_samples: int | None = typer.Option(None, "--max-samples", min=1),
    draft_vocab_size: int | None = typer.Option(
        None, "--draft-vocab-size", min=1, help="Draft vocabulary size (default: the full vocabulary)."
    ),
    revision: str | None = typer.Option(None, "--revision", help="Hub revision of the verifier."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code"),
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
    data: Path = typer.Argument(..., help="JSONL dataset to check."),
    fmt: str = typer.Option("auto", "--format", help="auto, messages, sharegpt or tokenized."),
) -> None:
    """Check a JSONL dataset's structure (no tokenizer); exits non-zero naming the first bad line."""
    from peagle_core.data.formats import validate_jsonl
    from peagle_core.errors import DataError

    if not data.is_file():
        raise DataError(f"dataset file {str(data)!r} does not exist", param="data")
    typer.echo(json.dumps(validate_jsonl(data, fmt).to_dict()))
