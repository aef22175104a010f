"""The headline benchmark: a drafter for a real chat model, and its speed-up measured in vLLM.

SmolLM2-135M-Instruct from its wheel is the verifier. Whole ShareGPT conversations as written (every
assistant turn, `--data sharegpt-tokens:T` picks them until T tokens; `regen:N` has the verifier answer N
first turns instead) train a P-EAGLE drafter within a fixed budget, through the same pipeline a job runs
(the spec is printed first, so the same job can be submitted). Then, on all 80 MT-Bench first turns, at
every K = 1..num_depths: acceptance length per position and per category, in vLLM (its spec-decode
counters) and in ours; whether vLLM's output equals its plain greedy output; and vLLM's output tokens/s
with and without the drafter, and with vLLM's `ngram`, at batch 1 and batch 8 (median of `--repeats`
rounds timed in alternating pairs, after a warm-up). One JSON line per figure.

    python bench/real_model.py                       # the recipe in docs/decisions.md, < 60 min on 2 cores
    python bench/real_model.py --drafter DIR         # measure an exported drafter only
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _common import emit

MODEL = "smollm2-135m-instruct"


def recipe(
    args: argparse.Namespace, verifier: Path, data: Path, eval_prompts: list[Any], *, regenerate: bool
) -> dict[str, Any]:
    """The job spec the bench trains with (printed, so a user can submit the same job)."""
    regen = {"engine": "vllm", "max_new_tokens": args.regen_tokens} if regenerate else False
    return {
        "name": f"real-model bench ({MODEL})",
        # `auto`: vLLM extracts hidden states (and regenerates) in bf16 where bf16 is fast (1.7x fp32 on
        # SmolLM2 here, bench/hidden_states.py); our own verifier passes stay fp32 on a CPU.
        "verifier": {"name_or_path": str(verifier), "dtype": args.verifier_dtype},
        "dataset": {
            "path": str(data),
            "seq_len": args.seq_len,
            "val_fraction": 0.0,
            "regenerate": regen,
        },
        # vLLM computes SmolLM2's hidden states ~8x faster than transformers here (bench/hidden_states.py).
        "hidden_states": {"mode": "offline", "dtype": "bf16", "engine": args.hs_engine},
        "model": {
            "num_layers": args.num_layers,
            "num_depths": args.num_depths,
            "draft_vocab_size": args.draft_vocab,
            "down_sample_ratio": args.cod_ratio,
            "down_sample_ratio_min": args.cod_min,
            "freeze_lm_head": args.freeze_lm_head,
        },
        "training": {
            "epochs": args.epochs,
            "max_steps": args.steps,
            "lr": args.lr,
            "warmup_ratio": 0.03,
            "total_seq_len": args.total_seq_len,
            "checkpoint_every_steps": 100,
            "precision": args.precision,
            "optimizer": args.optimizer,
            "depth_weights": depth_weights(args.depth_weights),
            "tv_weight": args.tv_weight,
            "in_vocab_targets_only": args.in_vocab_only,
        },
        "evaluation": {"prompts": eval_prompts, "max_new_tokens": args.new_tokens, "engine": "both"},
        "export": {"dtype": "fp32", "vllm_check": True},
    }


def add_recipe_args(p: argparse.ArgumentParser) -> None:
    """The flags `recipe` reads (bench/recipe_sweep.py shares them, with its own defaults)."""
    p.add_argument("--regen-tokens", type=int, default=192)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--verifier-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--hs-engine", default="vllm", choices=["vllm", "transformers"])
    p.add_argument("--total-seq-len", type=int, default=4096)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--num-depths", type=int, default=4)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--cod-ratio", type=float, default=0.7)
    p.add_argument("--cod-min", type=float, default=0.2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    p.add_argument("--depth-weights", default="count", help="count, equal or w0/w1/...")
    p.add_argument("--tv-weight", type=float, default=0.0)
    p.add_argument("--in-vocab-only", type=int, default=0, choices=[0, 1])
    p.add_argument("--freeze-lm-head", type=int, default=0, choices=[0, 1])


def depth_weights(text: str) -> str | list[float]:
    """`training.depth_weights` from a flag: count, equal, or weights joined by '/'."""
    return text if text in ("count", "equal") else [float(w) for w in text.split("/")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("bench-real-model"), help="reused between runs")
    p.add_argument("--drafter", type=Path, help="an exported drafter: skip training")
    p.add_argument(
        "--store",
        type=Path,
        help="a store shared with other benches (bench/scaling.py's): reuse its data and cache",
    )
    p.add_argument(
        "--data",
        default="sharegpt-tokens:3e6",
        help="training data, as bench/recipe_sweep.py's --data: sharegpt-tokens:T (whole conversations up to "
        "T tokens), regen:N (N first turns answered by the verifier), file:PATH, ...",
    )
    add_recipe_args(p)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--eval-prompts", type=int, default=80, help="MT-Bench first turns (80 = all)")
    p.add_argument("--ks", type=int, nargs="*", help="K values to evaluate (default 1..num_depths)")
    p.add_argument("--timing-prompts", type=int, default=16, help="0: no speed-up timing")
    p.add_argument(
        "--timing-ks", type=int, nargs="*", help="K values timed at each batch size (default: num_depths)"
    )
    p.add_argument(
        "--ngram-ks", type=int, nargs="*", help="K values timed for vLLM's ngram (default: the --timing-ks)"
    )
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serve-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="timed serving")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import AutoTokenizer

    from peagle_core.catalogue.datasets import get_dataset
    from peagle_core.catalogue.models import get_model
    from peagle_core.evaluation.acceptance import evaluate
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.model.drafter import PEagleDraftModel
    from peagle_core.pipeline.stages import LocalStore, Pipeline, run_pipeline
    from peagle_core.serving.categories import eval_categories_figures, pool_eval, pool_runs, run_categories
    from peagle_core.serving.judge import agreement_gap, engine_options
    from peagle_core.spec import parse_spec
    from peagle_core.vllm_engine import VllmEngine

    t0 = time.monotonic()
    verifier_dir = get_model(MODEL)
    emit(bench="real_model", stage="model", verifier=str(verifier_dir), seconds=time.monotonic() - t0)

    mt_path, _ = get_dataset("mt-bench", first_turn=True, prompts_only=True)
    mt_rows = [json.loads(line) for line in mt_path.read_text().splitlines()][: args.eval_prompts]
    texts = [r["messages"][0]["content"] for r in mt_rows]
    categories = [r.get("category", "all") for r in mt_rows]

    drafter_dir = args.drafter
    if drafter_dir is None:
        from recipe_sweep import training_data  # it imports this module: not at the top

        train_path, regenerate = training_data(args.data, args.seq_len)
        spec = parse_spec(recipe(args, verifier_dir, train_path, texts[:8], regenerate=regenerate))
        emit(bench="real_model", stage="spec", spec=spec.model_dump(mode="json", exclude_unset=True))
        t0 = time.monotonic()
        if args.store is not None:
            result = Pipeline.of(spec, args.work / "run", store=LocalStore(args.store)).run(resume=True)
        else:
            result = run_pipeline(spec, args.work / "run")
        emit(bench="real_model", stage="train", seconds=round(time.monotonic() - t0, 1), status=result.status,
             step=result.step, metrics={k: v for k, v in result.metrics.items() if isinstance(v, int | float)},
             serving=result.serving.to_dict() if result.serving else None)  # fmt: skip
        drafter_dir = result.export_dir

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(str(verifier_dir))
    prompts = []
    for text in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    verifier = Verifier.load(str(verifier_dir), device=str(device))
    drafter = PEagleDraftModel.from_pretrained(drafter_dir).to(device)
    depths = drafter.config.num_depths
    eos = verifier.tokenizer.eos_token_id
    by_cat: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(categories):
        by_cat[c].append(i)
    by_cat = dict(by_cat)

    opts = {**engine_options(device), "max_model_len": 2048}  # one engine for every prompt set
    v = str(verifier_dir)
    tensors = [torch.tensor(p, device=device) for p in prompts]
    with VllmEngine() as vllm:
        t0 = time.monotonic()
        plain = vllm.generate(v, prompts, args.new_tokens, **opts)
        emit(bench="real_model", stage="vllm_plain", prompts=len(prompts), seconds=time.monotonic() - t0)
        for k in args.ks or range(1, depths + 1):
            # Each category decoded apart (vLLM's counters are per call), then pooled by drafts.
            t0 = time.monotonic()
            ours_parts = {c: evaluate(drafter, verifier, [tensors[i] for i in idx], k, args.new_tokens, eos)
                          for c, idx in by_cat.items()}  # fmt: skip
            ours = pool_eval(ours_parts, by_cat)
            ours_s = time.monotonic() - t0
            t0 = time.monotonic()
            runs = {c: vllm.generate(v, [prompts[i] for i in idx], args.new_tokens, drafter=str(drafter_dir),
                                     k=k, **opts) for c, idx in by_cat.items()}  # fmt: skip
            theirs = pool_runs(runs, by_cat)
            vllm_s = time.monotonic() - t0
            emit(
                bench="real_model",
                k=k,
                prompts=len(prompts),
                vllm_acceptance_length=theirs.acceptance_length,
                vllm_acceptance_rate_per_position=theirs.acceptance_rate_per_position,
                peagle_acceptance_length=ours.acceptance_length,
                peagle_acceptance_rate_per_position=ours.acceptance_rate_per_position,
                agreement_gap=agreement_gap(ours.acceptance_length, theirs.acceptance_length),
                lossless_prompts=sum(a == b for a, b in zip(theirs.tokens, plain.tokens, strict=True)),
                ours_equal_vllm_prompts=sum(a == b for a, b in zip(ours.tokens, theirs.tokens, strict=True)),
                vllm_seconds=round(vllm_s, 1),
                peagle_eval_seconds=round(ours_s, 1),
            )
            if k == max(args.ks or [depths]):
                vllm_cats, ours_cats = run_categories(runs), eval_categories_figures(ours_parts)
                for c in by_cat:
                    emit(bench="real_model", k=k, category=c, prompts=len(by_cat[c]),
                         vllm_acceptance_length=vllm_cats[c]["acceptance_length"],
                         vllm_acceptance_rate_per_position=vllm_cats[c]["acceptance_rate_per_position"],
                         peagle_acceptance_length=ours_cats[c]["acceptance_length"])  # fmt: skip

        timing = prompts[: args.timing_prompts]
        if not timing:  # --timing-prompts 0: acceptance only
            return
        fp32_plain = vllm.generate(v, timing[:1], args.new_tokens, **opts)  # warm
        fp32_plain = [vllm.generate(v, [p], args.new_tokens, **opts) for p in timing]
    time_serving(args, v, drafter_dir, timing, opts, depths, fp32_plain)


def time_serving(
    args: argparse.Namespace,
    verifier: str,
    drafter_dir: Path,
    timing: list[list[int]],
    opts: dict[str, Any],
    depths: int,
    fp32_plain: list[Any],
) -> None:
    """Paired speed-ups in the serving dtype (`--serve-dtype`, bf16 by default: what users serve): the
    drafter and vLLM's `ngram` at each timed K, at batch 1 and 8, each against plain decoding; then each
    speculator's best K, and plain bf16 against plain fp32 once. Losslessness is checked in fp32 above;
    here the greedy match rate says how often bf16 spec decoding kept plain bf16's tokens."""
    from peagle_core.serving.speedup import batch_groups, paired_speedups
    from peagle_core.vllm_engine import VllmEngine

    serve = {**opts, "dtype": args.serve_dtype}
    batchings = [batch_groups(timing, b) for b in (1, 8)]
    rows: list[dict[str, Any]] = []
    with VllmEngine() as plain:
        ours_ks = args.timing_ks or range(1, depths + 1)
        for method, ks in (("eagle3", ours_ks), ("ngram", args.ngram_ks or ours_ks)):
            for k in ks:
                # One engine process per configuration: vLLM's CPU build cannot build another engine in a
                # process whose ngram proposer has loaded numba (peagle_core.serving.judge).
                with VllmEngine() as drafted:
                    rows += paired_speedups(
                        plain, drafted, verifier, batchings, args.new_tokens,
                        drafter=str(drafter_dir) if method == "eagle3" else None, k=k, method=method,
                        rounds=args.repeats, options=serve,
                    )  # fmt: skip
        bf16_plain = [plain.generate(verifier, [p], args.new_tokens, **serve) for p in timing]
    for r in rows:
        emit(bench="real_model", stage="speedup", dtype=args.serve_dtype, method=r["method"], k=r["k"],
             batch=r["batch_size"], prompts=r["prompts"], repeats=r["rounds"],
             plain_tokens_per_s=r["baseline_output_tokens_per_s"], drafter_tokens_per_s=r["output_tokens_per_s"],
             speedup=r["speedup"], speedup_per_round=r["speedup_per_round"],
             acceptance_length=r["acceptance_length"], greedy_match=r["lossless"])  # fmt: skip
    for batch in (1, 8):
        best = {}
        for method in ("eagle3", "ngram"):
            mine = [r for r in rows if r["method"] == method and r["batch_size"] == min(batch, len(timing))]
            best[method] = max(mine, key=lambda r: r["speedup"] or 0.0, default=None)
        d, n = best["eagle3"], best["ngram"]
        emit(bench="real_model", stage="best_k", dtype=args.serve_dtype, batch=batch,
             peagle_k=d and d["k"], peagle_speedup=d and d["speedup"], ngram_k=n and n["k"],
             ngram_speedup=n and n["speedup"],
             margin_over_ngram=d and n and d["speedup"] and n["speedup"] and round(d["speedup"] - n["speedup"], 4))  # fmt: skip
    rate = lambda runs: sum(r.num_output_tokens for r in runs) / sum(r.seconds for r in runs)  # noqa: E731
    emit(bench="real_model", stage="dtype", batch=1, prompts=len(timing),
         fp32_plain_tokens_per_s=round(rate(fp32_plain), 2), bf16_plain_tokens_per_s=round(rate(bf16_plain), 2),
         bf16_over_fp32=round(rate(bf16_plain) / rate(fp32_plain), 3),
         bf16_equals_fp32_prompts=sum(a.tokens == b.tokens for a, b in zip(bf16_plain, fp32_plain, strict=True)))  # fmt: skip


if __name__ == "__main__":
    main()
