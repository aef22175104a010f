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
def data_validate(
    data: Annotated[Path, typer.Argument(help="JSONL dataset to check.")],
    fmt: Annotated[str, typer.Option("--format", help="auto, messages, sharegpt or tokenized.")] = "auto",
    regenerate: Annotated[
        bool,
        typer.Option("--regenerate", help="The job regenerates answers: prompts-only rows are valid."),
    ] = False,
) -> None:
    """Check a JSONL dataset's structure (no tokenizer); exits non-zero naming the first bad line."""
    from peagle_core.data.formats import require_dataset_file, validate_jsonl

    require_dataset_file(data)
    typer.echo(json.dumps(validate_jsonl(data, fmt, prompts_only_ok=regenerate).to_dict()))


@app.command("regenerate")
def regenerate(
    verifier: VerifierOption,
    data: Annotated[Path, typer.Option("--data", help="Chat JSONL (messages or ShareGPT).")],
    out: Annotated[Path, typer.Option("--out", help="JSONL to write (same format) + OUT.provenance.json.")],
    engine: Annotated[str, typer.Option("--engine", help="transformers (default) or vllm.")] = "transformers",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, max=32768)] = 512,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, max=2.0)] = 0.0,
    turns: Annotated[
        str, typer.Option("--turns", help="all (every answer) or first (the first; later turns as written).")
    ] = "all",
    seq_len: Annotated[
        int, typer.Option("--seq-len", min=3, help="A turn whose prompt fills seq_len is skipped.")
    ] = 2048,
    fmt: Annotated[str, typer.Option("--format", help="auto, messages or sharegpt.")] = "auto",
    max_samples: Annotated[int | None, typer.Option("--max-samples", min=1)] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size", min=1, max=4096, help="Conversations per batch [16 transformers, 64 vllm]."
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Sampling seed (temperature > 0).")] = 0,
    revision: RevisionOption = None,
    trust_remote_code: TrustRemoteCodeOption = False,
) -> None:
    """Rewrite the assistant turns with the verifier, turn by turn; resumes an interrupted run."""
    from peagle_core.cli.common import fail
    from peagle_core.regeneration.rewrite import RegenParams, rewrite_dataset

    if engine not in ("transformers", "vllm"):
        fail(f"--engine must be transformers or vllm, not {engine!r}")
    if turns not in ("all", "first"):
        fail(f"--turns must be all or first, not {turns!r}")
    params = RegenParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        engine=engine,  # type: ignore[arg-type]
        turns=turns,  # type: ignore[arg-type]
        seq_len=seq_len,
        fmt=fmt,
        max_samples=max_samples,
        seed=seed,
    )

    def progress(r) -> None:
        typer.echo(f"{r.conversations}/{r.total} conversations, {r.tokens_per_s:.0f} tokens/s", err=True)

    report = rewrite_dataset(
        verifier,
        data,
        out,
        params,
        revision=revision,
        trust_remote_code=trust_remote_code,
        batch_size=batch_size,
        on_progress=progress,
    )
    typer.echo(json.dumps({"path": str(out), **report.to_dict()}))
