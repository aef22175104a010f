"""Our trainer against the reference trainer (speculators 0.9) on the same data and hidden states, served by vLLM.

Both sides train the same drafter (1 layer, K=2, the same draft vocabulary and map) from the same offline
hidden-state cache, in the same batches (our packing of whole conversations):

- **ours**: the CPU recipe preset through the job's pipeline (`peagle_core.recipes`), one pass;
- **reference**: speculators 0.9's own parts, unmodified: `PEagleDraftModel.from_training_args` (its layer
  config from `create_transformer_layer_config`, its mask token, its initialisation from the verifier:
  embeddings trainable, lm_head and verifier norm frozen), its forward (COD sampling with `max_anchors`
  512, KL against the verifier's logits as a plain mean), its `build_optimizers` with its schema's defaults
  (Muon on 2-D weights + AdamW) and its linear schedule with 1% warm-up, bf16 autocast and clip 1.0 as its
  trainer's step does. Its trainer itself moves the model to `cuda:LOCAL_RANK` and cannot run on a CPU, so a
  ten-line loop of ours drives those parts; the batches come from our loader.

Two budgets: **equal tokens** (`--tokens`, one pass each) and **equal wall-clock** (ours' training time at
equal tokens, or `--minutes`; each side gets the steps its own measured step rate fits in that time).

Every drafter is exported by our exporter (the reference's weights load into our drafter by name, strict)
and measured the same way by the product's judge: vLLM's acceptance length per position on MT-Bench first
turns (fp32, lossless against plain greedy), our evaluator's beside it, and the paired batch-1 bf16
speed-ups against plain and against vLLM's ngram. A second seed of ours gives the seed-to-seed noise.
One JSON line per drafter, then the table.

    python bench/vs_reference.py --tokens 1e6 --eval-prompts 80
    python bench/vs_reference.py --dry-run      # toy verifier, a few steps, our evaluator only (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch
from _common import emit
from _drafter_measure import Measure, table

from peagle_core.recipes.preset import DEFAULT_RECIPE

K = 2


# ------------------------------------------------------------------------------------------------ ours


def our_spec(args: argparse.Namespace, verifier: Path, data: Path, steps: int, seed: int) -> dict[str, Any]:
    """The recipe preset at this comparison's budget: K=2 (the preset's), `steps` steps of one pass, no
    in-job evaluation (the bench measures every drafter the same way afterwards)."""
    from peagle_core.recipes.preset import load_recipe

    overrides: dict[str, Any] = {
        "training.max_steps": steps,
        "training.epochs": 1000,  # the step budget ends the run
        "training.seed": seed,
        "training.total_seq_len": args.total_seq_len,
        "training.checkpoint_every_steps": max(steps, 1),
        "model.num_depths": K,
        "export.vllm_check": False,
    }
    if args.dry_run:  # the toy verifier: its whole vocabulary, short rows, hidden states in-process
        overrides |= {"hidden_states.engine": "transformers", "model.draft_vocab_size": None,
                      "dataset.seq_len": 256}  # fmt: skip
    raw = load_recipe(args.recipe).job_spec(str(verifier), dataset_path=str(data), overrides=overrides)
    raw["evaluation"] = {"prompts": 0}
    return raw


def train_ours(args: argparse.Namespace, raw: dict[str, Any], name: str) -> tuple[Path, float, Any]:
    """Train through the job's pipeline in a shared store; (export dir, training seconds, the pipeline)."""
    from peagle_core.events import CallbackReporter
    from peagle_core.pipeline.stages import Callbacks, LocalStore, Pipeline
    from peagle_core.spec import parse_spec

    spec = parse_spec(raw)
    steps: list[tuple[float, int]] = []

    def on_metrics(m: dict[str, Any]) -> None:
        step = int(m.get("step", 0))
        if step > 0 and (not steps or step > steps[-1][1]):
            steps.append((time.monotonic(), step))

    store = LocalStore(args.work / "store")
    callbacks = Callbacks(CallbackReporter(metrics=on_metrics))
    pipeline = Pipeline.of(spec, args.work / name, store=store, callbacks=callbacks)
    result = pipeline.run(resume=True)
    if result.export_dir is None:
        raise SystemExit(f"{name}: the pipeline ended without an export ({result.status})")
    # The first step's report comes after its compute: charge it at the run's mean step time.
    seconds = (steps[-1][0] - steps[0][0]) * len(steps) / max(len(steps) - 1, 1) if steps else 0.0
    return Path(result.export_dir), seconds, pipeline


# ------------------------------------------------------------------------------------------- reference


def reference_model(
    verifier: Path, num_layers: int, layer_ids: list[int], t2d: torch.Tensor, d2t: torch.Tensor, *, cuda: bool
) -> Any:
    """speculators' P-EAGLE drafter as its CLI builds it by default, on our draft vocabulary and the cache's
    auxiliary layers."""
    from speculators.models.peagle import PEagleDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.utils import resolve_mask_token_id

    layer = create_transformer_layer_config(
        verifier_name_or_path=str(verifier), num_layers=num_layers, draft_arch="llama", hidden_act=None,
        sliding_window=0, full_attention_indices=list(range(num_layers)),
    )  # fmt: skip
    return PEagleDraftModel.from_training_args(
        verifier_config=layer,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=str(verifier),
        target_layer_ids=list(layer_ids),
        draft_vocab_size=int(d2t.numel()),
        mask_token_id=resolve_mask_token_id(str(verifier), layer.vocab_size),
        norm_before_residual=True,  # its schema's default
        num_depths=K,
        # its default on CUDA; flex attention has no backward on a CPU, where its SDPA path runs
        draft_attn_impl="simple_flex_attention" if cuda else "sdpa",
    )


def reference_optimizers(model: torch.nn.Module, total_steps: int) -> tuple[list[Any], list[Any]]:
    """Its `build_optimizers` with its schema's defaults, and its default linear schedule (1% warm-up)."""
    from speculators.train.config.schema import OptimizerArgs, SchedulerArgs
    from speculators.train.optimizers import build_optimizers
    from transformers import get_linear_schedule_with_warmup

    from peagle_core.model.precision import has_fast_bf16
    from peagle_core.training.muon import Muon

    opt = OptimizerArgs()
    if opt.muon_lr is None:  # its config resolves an unset muon_lr to lr
        opt.muon_lr = opt.lr
    assert SchedulerArgs().scheduler_type == "linear"
    optimizers = build_optimizers(model, opt)
    device = next(model.parameters()).device
    if not has_fast_bf16(device):
        # torch's Muon orthogonalizes in bf16, which a CPU without AMX or AVX512-BF16 emulates (~13x slower
        # than fp32 here): the same Muon with fp32 iterations, as ours runs there, so that the equal-time
        # budget measures the trainers rather than the emulation. Its groups and hyperparameters are kept.
        optimizers = [
            Muon(o.param_groups, ns_dtype=torch.float32) if type(o) is torch.optim.Muon else o
            for o in optimizers
        ]
    schedulers = [get_linear_schedule_with_warmup(o, total_steps // 100, total_steps) for o in optimizers]
    return optimizers, schedulers


def train_reference(
    args: argparse.Namespace, pipeline: Any, verifier_dir: Path, steps: int, name: str
) -> tuple[Path, float]:
    """The reference's parts trained on our batches for `steps` steps, exported by our exporter."""
    from _real_data import RealData
    from speculators.losses import resolve_loss_config
    from speculators.train.config.schema import DataArgs

    from peagle_core.model.precision import resolve_precision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = RealData.of(pipeline, device)
    spec = data.spec
    ours = data.drafter(device)  # our draft vocabulary map for this data
    torch.manual_seed(spec.training.seed)
    layers = list(data.verifier.layer_ids)
    t2d, d2t = ours.t2d.cpu().clone(), ours.d2t.cpu().clone()
    model = reference_model(verifier_dir, spec.model.num_layers, layers, t2d, d2t, cuda=device.type == "cuda")
    model.to(device).train()
    optimizers, schedulers = reference_optimizers(model, steps)
    kwargs = {
        "num_depths": K,
        "down_sample_ratio": spec.model.down_sample_ratio,
        "down_sample_ratio_min": spec.model.down_sample_ratio_min,
        "max_anchors": DataArgs().max_anchors,
        "loss_config": resolve_loss_config("kl_div", "eager"),
    }
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
            "verifier_last_hidden_states")  # fmt: skip
    # Its trainer autocasts to bf16; here only where bf16 is fast, as ours does (emulated bf16 only slows it).
    bf16 = resolve_precision(spec.training.precision, device) == "bf16"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    t0 = time.monotonic()
    for i, batch in enumerate(data.batches(steps)):
        batch = batch.to(device)
        with autocast:
            _, loss, _metrics = model(**{k: getattr(batch, k) for k in keys}, **kwargs)
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o, s in zip(optimizers, schedulers, strict=True):
            o.step()
            s.step()
        if i % 25 == 0 or i == steps - 1:
            loss_value = round(float(loss.detach()), 4)
            emit(bench="vs_reference", trainer=name, step=i + 1, of=steps, loss=loss_value)
    seconds = time.monotonic() - t0
    return _export_reference(args, model, ours, verifier_dir, data.verifier, name), seconds


def _export_reference(
    args: argparse.Namespace, model: Any, ours: Any, verifier_dir: Path, verifier: Any, name: str
) -> Path:
    """Its weights in our drafter (by name, strict, its mask token) written by our exporter."""
    from peagle_core.model.drafter import PEagleDraftModel
    from peagle_core.serving.export import export_checkpoint

    state = {k: v.cpu() for k, v in model.state_dict().items() if not k.startswith("verifier_")}
    config = ours.config.model_copy(update={"mask_token_id": int(model.mask_token_id)})
    drafter = PEagleDraftModel(config)
    drafter.load_state_dict(state, strict=True)
    out = args.work / name / "export"
    if out.exists():
        import shutil

        shutil.rmtree(out)
    return export_checkpoint(
        drafter.float(), out, verifier_name_or_path=str(verifier_dir), verifier_config=verifier.config,
        speculative_tokens=K, dtype="fp32",
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ main


def inputs(args: argparse.Namespace) -> tuple[Path, Path, list[dict[str, str]]]:
    """(verifier dir, training JSONL, evaluation prompts with categories)."""
    if args.dry_run:
        from peagle_core.toy import build_toy_verifier, write_toy_dataset

        verifier = build_toy_verifier("test")
        data = write_toy_dataset(args.work / "corpus.jsonl", n=64)
        return verifier, data, [{"prompt": f"Tell me about topic {i}.", "category": "toy"} for i in range(4)]
    from _prompts import mt_bench_prompts, sharegpt_by_tokens

    from peagle_core.recipes.material import verifier_dir
    from peagle_core.recipes.preset import load_recipe

    verifier = verifier_dir(load_recipe(args.recipe))
    return (
        verifier,
        sharegpt_by_tokens(int(args.data_tokens), args.seq_len),
        mt_bench_prompts(args.eval_prompts),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("bench-vs-reference"), help="shared store, reused")
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help="our side's recipe preset (`peagle recipes`)")
    p.add_argument("--tokens", type=float, default=1e6, help="the equal-tokens budget (one pass each)")
    p.add_argument("--data-tokens", type=float, help="distinct ShareGPT tokens cached (default: --tokens)")
    p.add_argument("--minutes", type=float, help="the equal wall-clock budget (default: ours' at --tokens)")
    p.add_argument("--seeds", type=int, default=2, help="our trainer's seeds at equal tokens (the noise)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--total-seq-len", type=int, default=4096, help="tokens per step, both trainers")
    p.add_argument("--eval-prompts", type=int, default=80, help="MT-Bench first turns (80 = all)")
    p.add_argument("--timing-prompts", type=int, default=16, help="of those, timed for speed-ups (0: none)")
    p.add_argument("--rounds", type=int, default=2, help="paired timing rounds")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--ours-eval",
        default="first",
        choices=["first", "all", "none"],
        help="which drafters our own evaluator also scores (vLLM scores every one)",
    )
    p.add_argument("--dry-run", action="store_true", help="toy verifier, two steps each, our evaluator only")
    args = p.parse_args()
    if args.dry_run:
        args.tokens, args.total_seq_len, args.seeds, args.timing_prompts = 1024, 512, 1, 0
        args.ours_eval = "all"
    args.work.mkdir(parents=True, exist_ok=True)
    args.data_tokens = args.data_tokens or args.tokens
    verifier, data, prompts = inputs(args)
    steps = max(1, math.ceil(args.tokens / args.total_seq_len))
    emit(bench="vs_reference", tokens=steps * args.total_seq_len, steps=steps, k=K, recipe=args.recipe)

    rows: list[dict[str, Any]] = []
    with Measure(args, verifier, prompts, bench="vs_reference", k=K) as measure:
        ours: list[tuple[Path, float]] = []
        pipeline = None
        for seed in range(args.seeds):
            raw = our_spec(args, verifier, data, steps, seed=seed)
            export, seconds, pipeline = train_ours(args, raw, f"ours-tokens-seed{seed}")
            ours.append((export, seconds))
            emit(bench="vs_reference", trainer="ours", seed=seed, spec=raw)
            rows.append(
                measure(f"ours, equal tokens, seed {seed}", export, steps=steps, train_s=round(seconds))
            )
            if seed == 0:  # the reference next: a run cut short still has the equal-tokens pair
                ref_export, ref_seconds = train_reference(args, pipeline, verifier, steps, "reference-tokens")
                rows.append(
                    measure("reference, equal tokens", ref_export, steps=steps, train_s=round(ref_seconds))
                )

        minutes = args.minutes or ours[0][1] / 60
        budget = _equal_time(args, minutes, ours[0][1] / steps, ref_seconds / steps)
        if args.dry_run:  # a smoke test: one more reference run is enough
            budget["ours"] = steps
        if budget["ours"] != steps:
            raw = our_spec(args, verifier, data, budget["ours"], seed=0)
            export, seconds, _ = train_ours(args, raw, "ours-time")
            rows.append(measure("ours, equal time", export, steps=budget["ours"], train_s=round(seconds)))
        else:
            rows.append({**rows[0], "drafter": "ours, equal time (= equal tokens, seed 0)"})
            emit(bench="vs_reference", **rows[-1])
        export, seconds = train_reference(args, pipeline, verifier, budget["reference"], "reference-time")
        rows.append(
            measure("reference, equal time", export, steps=budget["reference"], train_s=round(seconds))
        )
    emit(bench="vs_reference", minutes=round(minutes, 2), table=table(rows))


def _equal_time(args: argparse.Namespace, minutes: float, ours_step_s: float, ref_step_s: float) -> dict:
    """Steps each trainer fits in `minutes` at its own measured step time (from the equal-tokens runs)."""
    out = {
        "ours": max(1, int(minutes * 60 / max(ours_step_s, 1e-9))),
        "reference": max(1, int(minutes * 60 / max(ref_step_s, 1e-9))),
    }
    emit(bench="vs_reference", budget="equal_time", minutes=round(minutes, 2),
         ours_step_s=round(ours_step_s, 3), reference_step_s=round(ref_step_s, 3), **out)  # fmt: skip
    return out


if __name__ == "__main__":
    main()
