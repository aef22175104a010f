"""`peagle train` and `peagle eval`: train a drafter from a spec file, or measure one's acceptance length."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from peagle_core.cli.common import fail
from peagle_core.torch_builds import require_matching_companions


def train_command(
    spec_file: Annotated[Path, typer.Argument(help="job spec (YAML or JSON)")],
    out: Annotated[
        Path | None, typer.Option("--out", help="output directory (default: ./runs/<spec name>)")
    ] = None,
    no_resume: Annotated[
        bool, typer.Option("--no-resume", help="start over even if checkpoints exist")
    ] = False,
) -> None:
    """Train a P-EAGLE drafter; checkpoints go to OUT/checkpoints, the vLLM export to OUT/export, and the
    reusable stage outputs (regenerated and prepared data, hidden-state cache) under OUT by stage key."""
    require_matching_companions()
    from peagle_core.cli.progress import RunProgress
    from peagle_core.pipeline.stages import Callbacks, run_pipeline
    from peagle_core.spec import load_spec

    spec = load_spec(spec_file)
    out_dir = out or Path("runs") / (spec.name or spec_file.stem)
    with RunProgress() as progress:  # on stderr: stdout is the result's one JSON line
        callbacks = Callbacks(reporter=progress.reporter())
        result = run_pipeline(spec, out_dir, callbacks=callbacks, resume=not no_resume)
    typer.echo(json.dumps({"status": result.status, "step": result.step,
                           "export_dir": str(result.export_dir) if result.export_dir else None,
                           "metrics": result.metrics,
                           "servable": result.serving.status if result.serving else None}))  # fmt: skip


def eval_command(
    drafter: Annotated[Path, typer.Option("--drafter", help="exported drafter directory")],
    verifier: Annotated[str, typer.Option("--verifier", help="verifier path or hub id")],
    data: Annotated[
        Path, typer.Option("--data", help="chat JSONL (prompts are each conversation's first turns)")
    ],
    k: Annotated[list[int], typer.Option("-k", help="speculative tokens per step (repeat for several)")],
    prompts: Annotated[int, typer.Option("--prompts", min=1, help="how many prompts")] = 16,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 64,
    seq_len: Annotated[
        int, typer.Option("--seq-len", min=16, help="truncate conversations to this many tokens")
    ] = 2048,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            help="peagle (our decoder), vllm (vLLM's spec-decode counters), both, or auto "
            "(both where vLLM is installed)",
        ),
    ] = "auto",
) -> None:
    """Greedy speculative decoding with drafter + verifier; prints one JSON line per K.

    With vLLM the drafter is also served by vLLM on the same prompts: its acceptance length comes from
    vLLM's own counters, and its greedy output must equal vLLM's without the drafter."""
    require_matching_companions()
    from peagle_core.evaluation.acceptance import evaluate
    from peagle_core.figures import KResult
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.model.drafter import PEagleDraftModel
    from peagle_core.serving.judge import VllmJudge, agreement_gap, engine_options

    engine = _pick_engine(engine)
    v = Verifier.load(verifier)
    model = PEagleDraftModel.from_pretrained(drafter).to(v.device)
    items = _eval_prompts(verifier, data, seq_len, prompts)
    rows = {kk: KResult(kk) for kk in k}
    if engine in ("peagle", "both"):
        for kk in k:
            rows[kk].ours = evaluate(model, v, items, kk, max_new_tokens, v.tokenizer.eos_token_id)
    gaps: dict[int, float] = {}
    if engine in ("vllm", "both"):
        prompts_ids = [p.tolist() for p in items]
        with VllmJudge(verifier, prompts_ids, max_new_tokens, options=engine_options(v.device)) as judge:
            for kk, fig in judge.evaluate_dir(drafter, k).items():
                rows[kk].vllm = fig
                ours = rows[kk].ours
                if ours is not None and ours.acceptance_length is not None:
                    gaps[kk] = agreement_gap(ours.acceptance_length, fig.acceptance_length or 0.0)
    for kk, row in rows.items():
        typer.echo(json.dumps(row.to_dict() | ({"gap": gaps[kk]} if kk in gaps else {})))


def _pick_engine(engine: str) -> str:
    """`--engine` checked, and `auto` made concrete."""
    from peagle_core.vllm_engine import vllm_available

    if engine not in ("auto", "peagle", "vllm", "both"):
        fail("--engine: choose one of auto, peagle, vllm, both")
    if engine == "auto":
        return "both" if vllm_available() else "peagle"
    if engine != "peagle" and not vllm_available():
        fail(f"--engine {engine}: vLLM is not installed here (pip install 'peagle-service[vllm]')")
    return engine


def _eval_prompts(verifier: str, data: Path, seq_len: int, prompts: int) -> list[Any]:
    """Up to `prompts` held-out prompts of `data`: a prepared dataset directory, or a chat JSONL prepared
    here into a temporary directory."""
    import tempfile

    from peagle_core.data import PreparedDataset, prepare_dataset
    from peagle_core.evaluation.acceptance import held_out_prompts

    with tempfile.TemporaryDirectory(prefix="peagle-eval-") as tmp:
        if data.is_dir():
            ds = PreparedDataset.open(data)
        else:
            prepare_dataset(verifier, data, Path(tmp) / "data", seq_len=seq_len, max_samples=prompts * 4)
            ds = PreparedDataset.open(Path(tmp) / "data")
        return held_out_prompts(ds, range(len(ds)), limit=prompts)


def register(app: typer.Typer) -> None:
    """Add the `train` and `eval` commands to `app`."""
    app.command("train")(train_command)
    app.command("eval")(eval_command)
