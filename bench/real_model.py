"""The headline benchmark: the shipped CPU recipe trained for a real chat model, and its speed-up in vLLM.

The job spec is the recipe preset's (`peagle recipes smollm2-cpu`; every flag below that names a spec
field departs from it), trained through the same pipeline a job runs on the recipe's data (the spec is
printed first, so the same job can be submitted). Then, on MT-Bench first turns (all 80 by default, one
category after another), at every K = 1..num_depths: acceptance length per position and per category in
vLLM (its spec-decode counters) and in ours, and whether vLLM's output equals its plain greedy output.
Then the product's judge times vLLM with the drafter and with vLLM's `ngram` against plain decoding at
batch 1 and 8, and its serving recommendation names the K to serve. One JSON line per figure.

With `--methods peagle,eagle3` each method trains on the same data and cache (the recipe's K as EAGLE-3's
`ttt_steps`) for the same training time: the first method runs the recipe's budget, each other one the steps
its own measured step time fits in that time (a three-step calibration run first). Every drafter is then
measured as above and the last line is one table at batch 1 and 8 (each method at each K, ngram, plain) with
the product's choice of method (`peagle_core.serving.method_choice`).

    python bench/real_model.py                       # the recipe; ~1 hour on a 2-core AMX CPU
    python bench/real_model.py --drafter DIR         # measure an exported drafter only
    python bench/real_model.py --methods peagle,eagle3 --data sharegpt-tokens:5e5
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _common import emit
from _prompts import add_data_arg, mt_bench_prompts, training_data
from _recipe import add_recipe_args, recipe_spec, recipe_value


def parser() -> argparse.ArgumentParser:
    """This bench's flags: the recipe's (each defaulting to the recipe's value), data, what to measure."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("bench-real-model"), help="reused between runs")
    p.add_argument("--drafter", type=Path, help="an exported drafter: skip training")
    p.add_argument(
        "--drafters",
        help="exported drafters to compare, METHOD=DIR,...: skip training (e.g. after --methods)",
    )
    p.add_argument(
        "--store",
        type=Path,
        help="a store shared with other benches (bench/scaling.py's): reuse its data and cache",
    )
    add_data_arg(p)
    add_recipe_args(p)
    p.add_argument("--eval-prompts", type=int, default=80, help="MT-Bench first turns scored (80 = all)")
    p.add_argument("--ks", type=int, nargs="*", help="K values to evaluate (default 1..num_depths)")
    p.add_argument(
        "--timing-prompts", type=int, help="prompts timed (default: the recipe's evaluation prompts); 0: none"
    )
    p.add_argument("--timing-ks", type=int, nargs="*", help="K values timed (default: the recipe's)")
    p.add_argument(
        "--ngram-ks", type=int, nargs="*", help="vLLM ngram's K values timed (default: the timed Ks and 4)"
    )
    p.add_argument(
        "--code-prompts",
        type=int,
        default=16,
        help="a second prompt set, with code: the first N of Arena-Hard's coding prompts (whose chat fits in "
        "1,024 tokens), measured and timed as the MT-Bench set is (prompt lookup is strongest on code); 0: none",
    )
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="paired timing rounds")
    p.add_argument("--serve-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="timed serving")
    p.add_argument(
        "--methods",
        default="peagle",
        help="model.method values trained at equal training time (peagle,eagle3)",
    )
    return p


def main() -> None:
    args = parser().parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    from peagle_core.recipes.material import verifier_dir as recipe_verifier
    from peagle_core.recipes.preset import load_recipe

    recipe = load_recipe(args.recipe)
    t0 = time.monotonic()
    verifier = recipe_verifier(recipe)
    emit(bench="real_model", stage="model", recipe=recipe.label, verifier=str(verifier),
         seconds=round(time.monotonic() - t0, 1))  # fmt: skip
    prompts = mt_bench_prompts(args.eval_prompts)
    timing = prompts[: recipe.eval_prompts if args.timing_prompts is None else args.timing_prompts]
    # The job's own evaluation needs prompts even where nothing is timed (--timing-prompts 0).
    job_prompts = timing or prompts[: recipe.eval_prompts]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.drafters:
        drafters = {m: Path(d) for m, _, d in (item.partition("=") for item in args.drafters.split(","))}
    elif args.drafter is not None:
        drafters = {methods[0]: args.drafter}
    elif len(methods) == 1:
        drafters = {methods[0]: train(args, recipe, verifier, job_prompts, method=methods[0])[0]}
    else:
        drafters = train_at_equal_time(args, recipe, verifier, job_prompts, methods)
    code = code_prompts(verifier, args.code_prompts)
    rows: dict[str, list[dict[str, Any]]] = {}
    for method, drafter in drafters.items():
        depths = measure_acceptance(args, verifier, drafter, prompts, method=method)
        ks = args.timing_ks or [k for k in recipe_value(args, "evaluation.speculative_tokens") if k <= depths]
        if timing:
            rows[method] = time_serving(args, verifier, drafter, [p["prompt"] for p in timing], ks, method)
        if code:
            measure_acceptance(args, verifier, drafter, code, method=method, prompt_set=CODE_SET)
            time_serving(
                args, verifier, drafter, [p["prompt"] for p in code], ks, method, prompt_set=CODE_SET
            )
    if len(rows) > 1:
        compare_methods(rows)


CODE_SET = "arena-hard-coding"


def code_prompts(verifier_dir: Path, n: int) -> list[dict[str, str]]:
    """The first `n` of Arena-Hard's coding prompts whose chat-templated prompt fits in 1,024 tokens."""
    if n <= 0:
        return []
    from transformers import AutoTokenizer

    from peagle_core.recipes.prompts import eval_prompts

    tok = AutoTokenizer.from_pretrained(str(verifier_dir))
    fits = [
        r
        for r in eval_prompts("arena-hard")
        if r["category"] == "coding" and len(token_ids(tok, r["prompt"])) <= 1024
    ]
    emit(
        bench="real_model",
        stage="prompt_set",
        prompt_set=CODE_SET,
        prompts=min(n, len(fits)),
        available=len(fits),
    )
    return fits[:n]


def train_at_equal_time(
    args: argparse.Namespace, recipe: Any, verifier: Path, timing: list[dict[str, str]], methods: list[str]
) -> dict[str, Path]:
    """Each method trained for the first one's training time: the first at the recipe's budget, the others
    at the steps their own step time (a three-step calibration run on the same cache) fits in it."""
    first, *others = methods
    drafter, seconds, steps = train(args, recipe, verifier, timing, method=first)
    out = {first: drafter}
    for method in others:
        _, calibration_s, calibration_steps = train(args, recipe, verifier, timing, method=method, steps=3,
                                                     tag="calibration")  # fmt: skip
        fit = max(1, int(seconds / (calibration_s / calibration_steps)))
        emit(bench="real_model", stage="equal_time", method=method, seconds=round(seconds, 1),
             reference_method=first, reference_steps=steps, steps=fit)  # fmt: skip
        out[method] = train(args, recipe, verifier, timing, method=method, steps=fit)[0]
    return out


def compare_methods(rows: dict[str, list[dict[str, Any]]]) -> None:
    """One table at every batch size (each method at each K, ngram, plain) and the method to serve."""
    from peagle_core.serving.method_choice import choose_method
    from peagle_core.serving.recommendation import NGRAM, ServingRecommendation

    table = [
        {"method": method if r["method"] != NGRAM else "ngram", "k": r["k"], "batch": r["batch_size"],
         "speedup": r["speedup"], "acceptance_length": r["acceptance_length"]}
        for method, measured in rows.items() for r in [x.to_dict() for x in measured]
        if r["method"] != NGRAM or method == next(iter(rows))  # ngram once: it does not depend on the drafter
    ]  # fmt: skip
    table += [
        {"method": "plain", "k": 0, "batch": b, "speedup": 1.0} for b in sorted({t["batch"] for t in table})
    ]
    emit(
        bench="real_model",
        stage="methods_table",
        rows=sorted(table, key=lambda t: (t["batch"], t["method"], t["k"])),
    )
    recs = {m: ServingRecommendation.choose(measured, method=m) for m, measured in rows.items()}
    choice = choose_method({m: r for m, r in recs.items() if r is not None})
    if choice is not None:
        emit(bench="real_model", stage="method_choice", **choice.to_dict())


# The bench's one departure from the recipe: it times the drafter itself after training (`time_serving`).
BENCH_OVERRIDES = {"evaluation.measure_speedup": False}


def job_spec(
    args: argparse.Namespace, verifier: Path, data: Path, eval_prompts: list[Any], *, regenerate: bool
) -> dict[str, Any]:
    """The job this bench trains: the recipe, the flags given, `BENCH_OVERRIDES`."""
    name = f"real-model bench ({args.recipe})"
    return recipe_spec(
        args, verifier, data, eval_prompts, regenerate=regenerate, name=name, extra=BENCH_OVERRIDES
    )


def train(
    args: argparse.Namespace,
    recipe: Any,
    verifier: Path,
    eval_prompts: list[dict[str, str]],
    *,
    method: str = "peagle",
    steps: int | None = None,
    tag: str = "",
) -> tuple[Path, float, int]:
    """The recipe (as `method`, for `steps` steps where given) trained through the job's pipeline: its
    exported drafter, training seconds (first to last optimizer step, scaled by steps / (steps - 1)) and
    steps. The speed-up is timed after, on the measured drafter (`time_serving`), so the job does not."""
    from peagle_core.cli.progress import RunProgress
    from peagle_core.pipeline.stages import Callbacks, LocalStore, Pipeline
    from peagle_core.spec import parse_spec

    data, regenerate = training_data(args.data, recipe_value(args, "dataset.seq_len"), args.recipe)
    raw = job_spec(args, verifier, data, eval_prompts, regenerate=regenerate)
    raw["model"]["method"] = method
    if steps is not None:
        raw["training"]["max_steps"] = steps
    if tag == "calibration":  # a few steps to time one: no in-job evaluation, no vLLM gate (minutes each)
        raw["evaluation"] = {**raw.get("evaluation", {}), "prompts": 0, "measure_speedup": False}
        raw["export"] = {**raw.get("export", {}), "vllm_check": False}
    spec = parse_spec(raw)
    emit(bench="real_model", stage="spec", method=method, tag=tag,
         spec=spec.model_dump(mode="json", exclude_unset=True))  # fmt: skip
    times: list[tuple[float, int]] = []

    def on_metrics(m: dict[str, Any]) -> None:
        step = int(m.get("step", 0))
        if step > 0 and (not times or step > times[-1][1]):
            times.append((time.monotonic(), step))

    t0 = time.monotonic()
    run = args.work / "-".join(x for x in ("run", method if method != "peagle" else "", tag) if x)
    store = LocalStore(args.store if args.store is not None else args.work / "store")
    with RunProgress(metrics=on_metrics) as progress:  # on stderr, beside the JSON lines on stdout
        callbacks = Callbacks(progress.reporter())
        result = Pipeline.of(spec, run, store=store, callbacks=callbacks).run(resume=True)
    seconds = (times[-1][0] - times[0][0]) * len(times) / max(len(times) - 1, 1) if len(times) > 1 else 0.0
    emit(bench="real_model", stage="train", method=method, tag=tag, seconds=round(time.monotonic() - t0, 1),
         train_seconds=round(seconds, 1), status=result.status, step=result.step,
         metrics={k: v for k, v in result.metrics.items() if isinstance(v, float | int)})  # fmt: skip
    if result.export_dir is None:
        raise SystemExit(f"training ended {result.status} without an exported drafter")
    return Path(result.export_dir), seconds, result.step


def measure_acceptance(
    args: argparse.Namespace,
    verifier_dir: Path,
    drafter_dir: Path,
    rows: list[dict],
    *,
    method: str = "peagle",
    prompt_set: str = "mt-bench",
) -> int:
    """Acceptance per K, per position and per category in vLLM and in ours (fp32, greedy), losslessness
    and ours = vLLM per prompt, on `rows` (of `prompt_set`); returns the drafter's number of depths."""
    import torch
    from transformers import AutoTokenizer

    from peagle_core.evaluation.acceptance import evaluate
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.model.drafter import PEagleDraftModel
    from peagle_core.serving.categories import per_category, pool_eval, pool_runs
    from peagle_core.serving.judge import agreement_gap, engine_options
    from peagle_core.vllm_engine import VllmProcess

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(str(verifier_dir))
    prompts = [token_ids(tok, r["prompt"]) for r in rows]
    verifier = Verifier.load(str(verifier_dir), device=str(device))
    drafter = PEagleDraftModel.from_pretrained(drafter_dir).to(device)
    depths = drafter.config.num_depths
    eos = verifier.tokenizer.eos_token_id
    by_cat: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        by_cat[r["category"]].append(i)
    opts = {**engine_options(device), "max_model_len": 2048}  # one engine for every prompt set
    v = str(verifier_dir)
    tensors = [torch.tensor(p, device=device) for p in prompts]
    with VllmProcess() as vllm:
        plain = vllm.generate(v, prompts, args.new_tokens, **opts)
        rate = round(plain.num_output_tokens / plain.seconds, 2)
        emit(bench="real_model", stage="vllm_plain", prompt_set=prompt_set, prompts=len(prompts), dtype=opts["dtype"],
             output_tokens_per_s=rate, seconds=round(plain.seconds, 1))  # fmt: skip
        ks = args.ks or list(range(1, depths + 1))
        for k in ks:
            # Each category decoded apart (vLLM's counters are per call), then pooled by drafts.
            t0 = time.monotonic()
            ours_parts = {c: evaluate(drafter, verifier, [tensors[i] for i in idx], k, args.new_tokens, eos)
                          for c, idx in by_cat.items()}  # fmt: skip
            ours, ours_s = pool_eval(ours_parts, by_cat), time.monotonic() - t0
            t0 = time.monotonic()
            runs = {c: vllm.generate(v, [prompts[i] for i in idx], args.new_tokens, drafter=str(drafter_dir),
                                     k=k, **opts) for c, idx in by_cat.items()}  # fmt: skip
            theirs, vllm_s = pool_runs(runs, by_cat), time.monotonic() - t0
            emit(
                bench="real_model",
                prompt_set=prompt_set,
                method=method,
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
            if k == max(ks):
                vllm_cats = {
                    c: a.to_dict()
                    for c, a in per_category({n: r.acceptance() for n, r in runs.items()}).items()
                }
                ours_cats = {c: a.to_dict() for c, a in per_category(ours_parts).items()}
                for c in by_cat:
                    emit(bench="real_model", prompt_set=prompt_set, k=k, category=c, prompts=len(by_cat[c]),
                         vllm_acceptance_length=vllm_cats[c]["acceptance_length"],
                         vllm_acceptance_rate_per_position=vllm_cats[c]["acceptance_rate_per_position"],
                         peagle_acceptance_length=ours_cats[c]["acceptance_length"])  # fmt: skip
    return depths


def time_serving(
    args: argparse.Namespace,
    verifier_dir: Path,
    drafter_dir: Path,
    texts: list[str],
    ks: list[int],
    method: str = "peagle",
    prompt_set: str = "mt-bench",
) -> list[dict[str, Any]]:
    """The product's speed-up measurement (`VllmJudge.measure_speedup`: paired rounds, the drafter and
    vLLM's `ngram` at each K of `ks`, batch 1 and 8, in `--serve-dtype`) and its serving recommendation
    (the K to serve, ngram's best beside it)."""
    import torch
    from transformers import AutoTokenizer

    from peagle_core.serving.judge import VllmJudge, engine_options
    from peagle_core.serving.recommendation import ServingRecommendation

    tok = AutoTokenizer.from_pretrained(str(verifier_dir))
    prompts = [token_ids(tok, t) for t in texts]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with VllmJudge(str(verifier_dir), prompts, args.new_tokens, options=engine_options(device),
                   timing_dtype=args.serve_dtype) as judge:  # fmt: skip
        ngram_ks = args.ngram_ks or sorted({*ks, 4})  # prompt lookup is usually at its best near K=4
        rows = judge.measure_speedup(
            drafter_dir, ks, batch_sizes=(1, 8), rounds=args.repeats, ngram_ks=ngram_ks
        )
    for r in (row.to_dict() for row in rows):
        emit(bench="real_model", stage="speedup", prompt_set=prompt_set, dtype=r["dtype"], method=r["method"], k=r["k"],
             batch=r["batch_size"], prompts=r["prompts"], repeats=r["rounds"],
             plain_tokens_per_s=r["baseline_output_tokens_per_s"], drafter_tokens_per_s=r["output_tokens_per_s"],
             speedup=r["speedup"], speedup_per_round=r["speedup_per_round"],
             acceptance_length=r["acceptance_length"], greedy_match=r["lossless"])  # fmt: skip
    rec = ServingRecommendation.choose(rows, method=method)
    if rec is None:
        return rows
    for b in rec.batches:
        margin = b.best_speedup - b.ngram_speedup if None not in (b.best_speedup, b.ngram_speedup) else None
        emit(bench="real_model", stage="best_k", prompt_set=prompt_set, dtype=args.serve_dtype, batch=b.batch_size, peagle_k=b.best_k,
             peagle_speedup=b.best_speedup, ngram_k=b.ngram_k, ngram_speedup=b.ngram_speedup,
             margin_over_ngram=None if margin is None else round(margin, 4))  # fmt: skip
    emit(bench="real_model", stage="recommendation", prompt_set=prompt_set, method=method, k=rec.k,
         sentence=rec.sentence())  # fmt: skip
    return rows


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """A user turn through the chat template, as vLLM and our evaluator are given it."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


if __name__ == "__main__":
    main()
