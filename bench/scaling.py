"""How acceptance grows with training tokens on the real model: one run per token budget, scored by vLLM.

Every budget trains its own drafter with the shipped recipe (`peagle recipes`; the recipe flags of
bench/_recipe.py depart from it) and its own full LR schedule (an intermediate
checkpoint of one long run would be scored mid-schedule, at a high learning rate), sharing one store so
the data and the verifier's hidden states are made once. Each drafter's acceptance length comes from
vLLM's spec-decode counters on MT-Bench first turns (all 80 by default) at K = num_depths, with our
training loss and accuracy per depth beside it. One JSON line per budget, then the curve as a PNG.

    python bench/scaling.py --budgets 3e5,7.5e5,1.5e6,3e6 --plot docs/scaling.png
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import emit, peak_rss_mb
from _prompts import add_data_arg, mt_bench_prompts, training_data
from _recipe import add_recipe_args, recipe_spec, recipe_value


def plot(points: list[dict[str, Any]], path: Path) -> None:
    """AL against tokens (log x), with depth-0 training accuracy on a second axis."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    tokens = [p["tokens"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(tokens, [p["vllm_acceptance_length"] for p in points], "o-", label="vLLM acceptance length")
    ax.set_xscale("log")
    ax.set_xticks(tokens, [f"{t / 1e6:.2g}M" for t in tokens])
    ax.minorticks_off()
    ax.set_xlabel("training tokens (one pass over distinct data)")
    ax.set_ylabel(f"acceptance length at K={points[0]['k']}")
    ax.grid(True, which="both", alpha=0.3)
    acc = ax.twinx()
    acc.plot(tokens, [p["train_accuracy"].get("acc_0") for p in points], "s--", color="tab:orange",
             label="train accuracy, depth 0")  # fmt: skip
    acc.set_ylabel("training accuracy, depth 0 (last step)")
    acc.minorticks_off()
    fig.legend(loc="upper left", bbox_to_anchor=(0.1, 0.9))
    ax.set_title(f"P-EAGLE on {points[0].get('verifier', 'SmolLM2')}: acceptance vs training tokens")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="1e6,3e6,1e7", help="training tokens per run, comma-separated")
    p.add_argument("--work", type=Path, default=Path("bench-scaling"), help="shared store, reused")
    add_data_arg(p)
    p.add_argument("--eval-prompts", type=int, default=80, help="MT-Bench first turns scored (80 = all)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--plot", type=Path, default=Path("bench-scaling/scaling.png"))
    p.add_argument("--one-budget", type=float, help=argparse.SUPPRESS)  # a child's one run
    add_recipe_args(p)
    p.set_defaults(epochs=1000)  # the budget ends each run
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    points_file = args.work / "points.jsonl"
    if args.one_budget is not None:
        point = train_and_score(args, args.one_budget)
        with points_file.open("a") as f:
            f.write(json.dumps(point) + "\n")
        return

    # Each budget in its own process: its memory (the cache's mapped shards, the allocator's high-water
    # mark) is returned before the next, and a budget already scored is not run again.
    for budget in sorted(float(b) for b in args.budgets.split(",")):
        if not any(pt["budget"] == budget for pt in read_points(points_file)):
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one-budget", str(budget)], check=True)
    wanted = {float(b) for b in args.budgets.split(",")}
    points = sorted(
        (pt for pt in read_points(points_file) if pt["budget"] in wanted), key=lambda pt: pt["tokens"]
    )
    if points and all(pt["vllm_acceptance_length"] is not None for pt in points):
        plot(points, args.plot)
        emit(bench="scaling", plot=str(args.plot), points=len(points))
    (args.work / "scaling.json").write_text(json.dumps(points, indent=1))


def read_points(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train_and_score(args: argparse.Namespace, budget: float) -> dict[str, Any]:
    """One budget's drafter trained through the job's pipeline and scored by vLLM; its JSON point."""
    from peagle_core.cli.progress import RunProgress
    from peagle_core.figures import Acceptance
    from peagle_core.pipeline.stages import Callbacks, LocalStore, Pipeline
    from peagle_core.recipes.material import verifier_dir
    from peagle_core.recipes.preset import load_recipe
    from peagle_core.serving.report import EvaluationReport
    from peagle_core.spec import parse_spec

    recipe = load_recipe(args.recipe)
    verifier = verifier_dir(recipe)
    data, regenerate = training_data(args.data, recipe_value(args, "dataset.seq_len"), args.recipe)
    prompts = mt_bench_prompts(args.eval_prompts)
    store = LocalStore(args.work / "store")
    row_tokens = recipe_value(args, "training.total_seq_len")
    depths = recipe_value(args, "model.num_depths")
    args.steps = max(1, math.ceil(budget / row_tokens))
    spec = parse_spec(recipe_spec(args, verifier, data, prompts, regenerate=regenerate, name=f"scaling {budget:g}", extra={
        "evaluation.engine": "vllm",
        "evaluation.speculative_tokens": [depths],
        "evaluation.measure_speedup": False,
        "export.vllm_check": False,  # scored by vLLM already; the gate's fp32 check is real_model's
    }))  # fmt: skip
    emit(bench="scaling", budget=budget, spec=spec.model_dump(mode="json", exclude_unset=True))
    t0 = time.monotonic()
    steps: list[
        tuple[float, int]
    ] = []  # (time, step) when each optimizer step first reports: the training rate

    def on_metrics(m: dict[str, Any]) -> None:
        step = int(m.get("step", 0))
        if not steps or step > steps[-1][1]:  # evaluation re-reports its step later
            steps.append((time.monotonic(), step))

    with RunProgress(metrics=on_metrics) as progress:  # on stderr, beside the JSON lines on stdout
        callbacks = Callbacks(progress.reporter())
        result = Pipeline.of(spec, args.work / f"run-{int(budget)}", store=store, callbacks=callbacks).run(
            resume=True
        )
    steps = [s for s in steps if s[1] > 0]
    report = result.evaluation or EvaluationReport()
    by_k = {k: (r.vllm.acceptance_length if r.vllm else None) for k, r in report.results.items()}
    at_k = report.at(depths)
    vllm = (at_k.vllm if at_k is not None else None) or Acceptance()
    point = {
        "budget": budget,
        "recipe": recipe.label,
        "verifier": recipe.verifier,
        "tokens": args.steps * row_tokens,
        "steps": result.step,
        "k": depths,
        "vllm_acceptance_length": vllm.acceptance_length,
        "vllm_acceptance_length_by_k": by_k,
        "vllm_acceptance_rate_per_position": vllm.acceptance_rate_per_position,
        "train_loss": result.metrics.get("loss"),
        "train_accuracy": {k: round(v, 4) for k, v in result.metrics.items() if k.startswith("acc_")},
        "seconds": round(time.monotonic() - t0, 1),
        "train_seconds": round(steps[-1][0] - steps[0][0], 1) if len(steps) > 1 else None,
        "train_tokens_per_s": round((steps[-1][1] - steps[0][1]) * row_tokens / (steps[-1][0] - steps[0][0]))
        if len(steps) > 1
        else None,
        "peak_rss_mb": peak_rss_mb(),
    }
    emit(bench="scaling", data=args.data, eval_prompts=len(prompts), **point)
    return point


if __name__ == "__main__":
    main()
