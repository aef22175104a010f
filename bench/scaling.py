"""How acceptance grows with training tokens on the real model: one run per token budget, scored by vLLM.

Every budget trains its own drafter with the same recipe and its own full LR schedule (an intermediate
checkpoint of one long run would be scored mid-schedule, at a high learning rate), sharing one store so
the data and the verifier's hidden states are made once. Each drafter's acceptance length comes from
vLLM's spec-decode counters on MT-Bench first turns (all 80 by default) at K = num_depths, with our
training loss and accuracy per depth beside it. One JSON line per budget, then the curve as a PNG.

    python bench/scaling.py --budgets 1e6,3e6,1e7 --data sharegpt-all:17000 --plot docs/scaling.png
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from _common import emit
from real_model import MODEL, add_recipe_args, recipe
from recipe_sweep import mt_bench_prompts, training_data


def plot(points: list[dict[str, Any]], path: Path) -> None:
    """AL against tokens (log x), with depth-0 training accuracy on a second axis."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    tokens = [p["tokens"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(tokens, [p["vllm_acceptance_length"] for p in points], "o-", label="vLLM acceptance length")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel(f"acceptance length at K={points[0]['k']}")
    ax.grid(True, which="both", alpha=0.3)
    acc = ax.twinx()
    acc.plot(tokens, [p["train_accuracy"].get("acc_0") for p in points], "s--", color="tab:orange",
             label="train accuracy, depth 0")  # fmt: skip
    acc.set_ylabel("training accuracy (depth 0)")
    fig.legend(loc="lower right")
    ax.set_title(f"P-EAGLE on {MODEL}: acceptance vs training tokens")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="1e6,3e6,1e7", help="training tokens per run, comma-separated")
    p.add_argument("--work", type=Path, default=Path("bench-scaling"), help="shared store, reused")
    p.add_argument("--data", default="sharegpt-all:17000", help="as bench/recipe_sweep.py's --data")
    p.add_argument("--eval-prompts", type=int, default=80, help="MT-Bench first turns scored (80 = all)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--plot", type=Path, default=Path("bench-scaling/scaling.png"))
    add_recipe_args(p)
    p.set_defaults(seq_len=1024, hs_engine="vllm", epochs=1000)  # the budget ends each run
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    from peagle_core.catalogue.models import get_model
    from peagle_core.evaluation.report import AcceptanceFigures, EvaluationReport
    from peagle_core.pipeline.stages import LocalStore, Pipeline
    from peagle_core.spec import parse_spec

    verifier = get_model(MODEL)
    data, regenerate = training_data(args.data)
    prompts = mt_bench_prompts(args.eval_prompts)
    store = LocalStore(args.work / "store")
    points = []
    for budget in sorted(float(b) for b in args.budgets.split(",")):
        args.steps = max(1, math.ceil(budget / args.total_seq_len))
        raw = recipe(args, verifier, data, prompts, regenerate=regenerate)
        raw["evaluation"]["engine"] = "vllm"
        raw["export"]["vllm_check"] = False  # scored by vLLM already; the gate's fp32 check is real_model's
        spec = parse_spec(raw)
        t0 = time.monotonic()
        result = Pipeline.of(spec, args.work / f"run-{int(budget)}", store=store).run(resume=True)
        at_k = (result.evaluation or EvaluationReport()).at(args.num_depths)
        vllm = (at_k.vllm if at_k is not None else None) or AcceptanceFigures()
        point = {
            "tokens": args.steps * args.total_seq_len,
            "steps": result.step,
            "k": args.num_depths,
            "vllm_acceptance_length": vllm.acceptance_length,
            "vllm_acceptance_rate_per_position": vllm.acceptance_rate_per_position,
            "train_loss": result.metrics.get("loss"),
            "train_accuracy": {k: round(v, 4) for k, v in result.metrics.items() if k.startswith("acc_")},
            "seconds": round(time.monotonic() - t0, 1),
        }
        points.append(point)
        emit(bench="scaling", data=args.data, eval_prompts=len(prompts), **point)
    if all(pt["vllm_acceptance_length"] is not None for pt in points):
        plot(points, args.plot)
        emit(bench="scaling", plot=str(args.plot), points=len(points))
    (args.work / "scaling.json").write_text(json.dumps(points, indent=1))


if __name__ == "__main__":
    main()
