"""`peagle cache build|verify`: fill a hidden-state cache from a verifier and prepared data, or check one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from peagle_core.cli.common import RevisionOption, TrustRemoteCodeOption, VerifierOption
from peagle_core.errors import CacheError
from peagle_core.model.config import ascending_layer_ids

app = typer.Typer(no_args_is_help=True, help="Hidden-state cache: build (resumable) and verify.")


def _parse_layer_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        raise CacheError(
            f"--layer-ids: expected comma-separated integers, got {text!r}", param="--layer-ids"
        ) from None
    try:
        return ascending_layer_ids(ids)
    except ValueError as exc:
        raise CacheError(f"--layer-ids: {exc}", param="--layer-ids") from None


@app.command("build")
def build(
    verifier: VerifierOption,
    data: Annotated[Path, typer.Option("--data", help="Prepared dataset directory (`peagle data prepare`).")],
    out: Annotated[Path, typer.Option("--out", help="Cache directory (created, or resumed if it exists).")],
    dtype: Annotated[
        str, typer.Option("--dtype", help="Storage dtype: bf16, fp8 (e4m3 + row scale) or fp32.")
    ] = "bf16",
    layer_ids: Annotated[
        str | None, typer.Option("--layer-ids", help="Three verifier layers, e.g. 2,8,13 (sorted).")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Samples per verifier call.")] = 8,
    shard_mb: Annotated[float, typer.Option("--shard-mb", min=0.0, help="Target shard size in MiB.")] = 128.0,
    revision: RevisionOption = None,
    device: Annotated[
        str | None, typer.Option("--device", help="cuda / cpu (default: cuda if available).")
    ] = None,
    verifier_dtype: Annotated[
        str, typer.Option("--verifier-dtype", help="auto, float32, bfloat16, float16.")
    ] = "auto",
    trust_remote_code: TrustRemoteCodeOption = False,
) -> None:
    """Run the verifier over every sample of PREPARED and store its hidden states in OUT."""
    from tqdm import tqdm

    from peagle_core.data.prepare import PreparedDataset
    from peagle_core.hidden_states.build import ComputeBackend, build_cache
    from peagle_core.hidden_states.cache import CacheFingerprint
    from peagle_core.hidden_states.codec import DTYPES
    from peagle_core.hidden_states.loader import VerifierCompute
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.io import human_bytes

    if dtype not in DTYPES:
        raise CacheError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}", param="--dtype")
    ids = _parse_layer_ids(layer_ids)
    dataset = PreparedDataset.open(data)
    v = Verifier.load(
        verifier,
        revision=revision,
        dtype=verifier_dtype,
        device=device,
        layer_ids=ids,
        trust_remote_code=trust_remote_code,
    )
    pad = v.tokenizer.pad_token_id if v.tokenizer.pad_token_id is not None else 0
    bar: Any = None

    def on_progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:  # a resumed build's bar starts at its cached share; the rate counts computed tokens
            bar = tqdm(total=total, initial=done, desc="hidden states", unit="token", unit_scale=True,
                       dynamic_ncols=True)  # fmt: skip
        bar.update(done - bar.n)

    try:
        report = build_cache(
            out,
            dataset,
            ComputeBackend(VerifierCompute(dataset, lambda: v, pad_token_id=pad)),
            CacheFingerprint.of(v, dataset),
            dtype=dtype,
            batch_size=batch_size,
            shard_bytes=max(1, int(shard_mb * (1 << 20))),
            dataset_dir=str(Path(data).resolve()),
            on_progress=on_progress,
        )
    finally:
        if bar is not None:
            bar.close()
    typer.echo(
        f"{out}: {report.total_samples} samples, {human_bytes(report.total_bytes)} "
        f"({report.computed} computed, {report.skipped} already cached, {report.shards_written} shards written)"
    )


@app.command("verify")
def verify(
    cache_dir: Annotated[Path, typer.Argument(help="Cache directory.")],
    data: Annotated[
        Path | None,
        typer.Option(
            "--data", help="Prepared dataset to compare token ids with (default: the one it was built from)."
        ),
    ] = None,
) -> None:
    """Check checksums, tensor shapes, token ids and finite values; exit 1 naming each bad shard."""
    from peagle_core.data.prepare import PreparedDataset
    from peagle_core.hidden_states.build import verify_cache
    from peagle_core.hidden_states.cache import CacheCorruptError, HiddenStateCache

    cache = HiddenStateCache.open(cache_dir)
    data_dir = data or cache.manifest.get("dataset_dir")
    if data_dir is None or not Path(data_dir).is_dir():
        raise CacheError(
            f"cannot compare token ids: prepared dataset {data_dir or '(unknown)'} not found; pass --data DIR",
            param="--data",
        )
    problems = verify_cache(cache_dir, PreparedDataset.open(data_dir))
    if problems:
        for p in problems:
            typer.secho(f"{cache_dir}: {p}", err=True, fg=typer.colors.RED)
        # An error rather than fail(): run_app maps PeagleError to exit status 1.
        raise CacheCorruptError(f"{len(problems)} problem(s) in {cache_dir}", shard=problems[0].split(":")[0])
    typer.echo(f"{cache_dir}: ok ({len(cache.shards)} shards, {len(cache)} samples)")
