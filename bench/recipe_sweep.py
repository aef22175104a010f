"""Recipe comparison on the real model: variants of the shipped recipe trained on the same data, scored alike.

Every variant trains through the same pipeline a job runs, sharing one store, so the data (regenerated
or not) and the verifier's hidden states are made once and reused while the drafter recipe changes. Each
variant is scored by our decoder on MT-Bench first turns (acceptance length at every K up to num_depths,
per position; ours equals vLLM's on this model, bench/real_model.py). One JSON line per variant.

    python bench/recipe_sweep.py --data regen:160 --steps 80 base lr=5e-3 num_layers=2 draft_vocab=4096
    python bench/recipe_sweep.py --data sharegpt:2000 --steps 80 base

A variant is `name` or `name:key=value,...` (or just `key=value,...`) over the recipe flags of
bench/_recipe.py (num_layers, num_depths, draft_vocab, cod_ratio, cod_min, lr, epochs, total_seq_len,
precision, optimizer, depth_weights, tv_weight, in_vocab_only, freeze_lm_head, steps, ...); `base` is the
recipe (`--recipe`, `peagle recipes`) with the flags as given.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _common import emit
from _prompts import add_data_arg, mt_bench_prompts, training_data
from _recipe import RECIPE_FLAGS, add_recipe_args, overrides, recipe_spec, recipe_value


def parse_variant(text: str, base: argparse.Namespace) -> tuple[str, argparse.Namespace]:
    """(name, the recipe flags with the variant's overrides)."""
    name, _, body = text.rpartition(":") if ":" in text else ("", "", text)
    args = argparse.Namespace(**vars(base))
    if body != "base":
        for item in filter(None, body.split(",")):
            key, sep, value = item.partition("=")
            if not sep or key not in RECIPE_FLAGS:
                raise SystemExit(f"variant {text!r}: {item!r} is not one of {', '.join(RECIPE_FLAGS)}=VALUE")
            kind = RECIPE_FLAGS[key][1]
            setattr(args, key, int(value) if kind is bool else kind(value))
    return name or body, args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+", help="`base`, `key=value,...` or `name:key=value,...`")
    p.add_argument("--work", type=Path, default=Path("bench-recipe-sweep"), help="shared store, reused")
    add_data_arg(p, default="regen:160")
    p.add_argument("--eval-prompts", type=int, default=16, help="MT-Bench first turns scored")
    p.add_argument("--new-tokens", type=int, default=64)
    add_recipe_args(p)
    # A fixed step budget per variant (`--steps`, a variant's `steps=`) ends each run; the epochs only
    # bound it. Regenerated answers are kept short: the sweep compares recipes, not data.
    p.set_defaults(steps=80, epochs=50, regen_tokens=96)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    from peagle_core.cli.progress import RunProgress
    from peagle_core.figures import Acceptance, k_key
    from peagle_core.pipeline.stages import Callbacks, LocalStore, Pipeline
    from peagle_core.recipes.material import verifier_dir
    from peagle_core.recipes.preset import load_recipe
    from peagle_core.serving.report import EvaluationReport
    from peagle_core.spec import parse_spec

    verifier = verifier_dir(load_recipe(args.recipe))
    data, regenerate = training_data(args.data, recipe_value(args, "dataset.seq_len"), args.recipe)
    prompts = mt_bench_prompts(args.eval_prompts)

    store = LocalStore(args.work / "store")
    for text in args.variants:
        name, v = parse_variant(text, args)
        depths = recipe_value(v, "model.num_depths")
        spec = parse_spec(recipe_spec(v, verifier, data, prompts, regenerate=regenerate, name=f"sweep {name}", extra={
            "evaluation.engine": "peagle",  # vLLM agrees with ours here; it would only add minutes
            # Every K up to num_depths: a K=4 drafter is compared with a K=2 one at K=2 too.
            "evaluation.speculative_tokens": list(range(1, depths + 1)),
            "evaluation.measure_speedup": False,
            "export.vllm_check": False,
        }))  # fmt: skip
        t0 = time.monotonic()
        with RunProgress() as progress:  # on stderr, beside the JSON lines on stdout
            callbacks = Callbacks(reporter=progress.reporter())
            result = Pipeline.of(spec, args.work / f"run-{name}", store=store, callbacks=callbacks).run(
                resume=False
            )
        m = result.metrics
        report = result.evaluation or EvaluationReport()
        at_k = report.ours(depths) or Acceptance()
        emit(
            bench="recipe_sweep",
            variant=name,
            data=args.data,
            steps=result.step,
            seconds=round(time.monotonic() - t0, 1),
            recipe=overrides(v),  # the departures from the recipe
            acceptance_length=at_k.acceptance_length,
            # Every K the evaluation ran (`evaluation.speculative_tokens`), not only K = num_depths.
            acceptance_length_by_k={
                k_key(k): r.ours.acceptance_length if r.ours else None for k, r in report.results.items()
            },
            acceptance_rate_per_position=at_k.acceptance_rate_per_position,
            categories={c: f.acceptance_length for c, f in (at_k.categories or {}).items()},
            train_accuracy={k: round(val, 3) for k, val in m.items() if k.startswith("acc_")},
            loss=m.get("loss"),
            eval_prompts=len(prompts),
        )


if __name__ == "__main__":
    main()
