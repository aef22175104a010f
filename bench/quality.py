"""Drafter quality on the toy verifier: dataset answers vs the verifier's own (regenerated) answers.

Trains the default drafter (4 layers, 4 parallel depths) twice for the same number of optimizer steps, once
on the corpus as written and once on the corpus whose assistant turns the verifier rewrote
(`peagle_core.regeneration.rewrite`), then prints one JSON line per (data, K) with the acceptance length on the same
held-out prompts. The budget is a step count, not wall clock, so both runs get equal training on a shared,
loaded machine; the default (`--steps`) takes about 10 minutes per run on an idle 2-core machine.
Regeneration is timed and reported on its own line; it is not part of the training budget.

    nice python bench/quality.py [--steps N] [--data dataset,regenerated]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import emit

# About 10 minutes of training per run on an idle 2-core machine: 240 steps of this spec took 338 s (1.4 s/step)
# at a load average of 3-8 on a shared 2-core machine; 630 assumes about 0.95 s/step idle (not measured).
DEFAULT_STEPS = 630


def quality_spec(verifier_dir: Path, data: Path, args: argparse.Namespace) -> Any:
    from peagle_core.spec import parse_spec

    return parse_spec(
        {
            "verifier": {"name_or_path": str(verifier_dir)},
            "dataset": {"path": str(data), "seq_len": 512, "val_fraction": 0.05},
            # The cache is built before training, so every epoch reads it instead of running the verifier.
            "hidden_states": {"mode": "offline", "dtype": "fp32"},
            "model": {"num_layers": 4, "num_depths": args.num_depths, "draft_vocab_size": None},
            "training": {
                "epochs": 1000,
                "max_steps": args.steps,
                "total_seq_len": args.total_seq_len,
                "lr": args.lr,
                "warmup_ratio": args.warmup_ratio,
                "checkpoint_every_steps": 10**6,
                "seed": 0,
            },
            "evaluation": {"prompts": 0},  # evaluated below, on the same prompts for both runs
        }
    )


def answer_stats(path: Path, tokenizer: Any) -> dict[str, Any]:
    """Length and repetition of the assistant turns: the evidence when one data source loses."""
    lengths, distinct, repeats = [], [], collections.Counter()
    for line in path.read_text().splitlines():
        for m in json.loads(line)["messages"]:
            if m["role"] != "assistant":
                continue
            ids = tokenizer(m["content"], add_special_tokens=False)["input_ids"]
            lengths.append(len(ids))
            grams = list(zip(ids, ids[1:], ids[2:], strict=False))
            distinct.append(len(set(grams)) / len(grams) if grams else 1.0)
            repeats[m["content"]] += 1
    n = len(lengths)
    return {
        "turns": n,
        "mean_tokens": round(sum(lengths) / max(1, n), 1),
        "distinct_3gram_ratio": round(sum(distinct) / max(1, n), 3),
        "unique_answers": len(repeats),
        "top_answer_share": round(repeats.most_common(1)[0][1] / max(1, n), 3) if n else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps per run")
    parser.add_argument("--data", default="dataset,regenerated", help="which runs, comma-separated")
    parser.add_argument("--toy-size", default="default", choices=["default", "test"])
    parser.add_argument("--num-depths", type=int, default=4)
    parser.add_argument("--ks", default="2,4,6")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--regen-max-new-tokens", type=int, default=160)
    parser.add_argument("--regen-engine", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-ratio", type=float, default=0.03)
    parser.add_argument("--total-seq-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    args = parser.parse_args()

    from peagle_core.data.prepare import prepare_for_spec
    from peagle_core.evaluation.acceptance import evaluate, held_out_prompts
    from peagle_core.events import CallbackReporter
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.regeneration.rewrite import RegenParams, rewrite_dataset
    from peagle_core.toy import build_toy_verifier, write_toy_dataset
    from peagle_core.training.loop import train

    work = args.out or Path(tempfile.mkdtemp(prefix="peagle-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    verifier_dir = build_toy_verifier(args.toy_size)
    sources = {"dataset": write_toy_dataset(work / "corpus.jsonl")}
    emit(event="setup", verifier=str(verifier_dir), seconds=round(time.monotonic() - t0, 1),
         torch_threads=torch.get_num_threads(), loadavg=list(os.getloadavg()))  # fmt: skip

    runs = [d.strip() for d in args.data.split(",") if d.strip()]
    if "regenerated" in runs:
        params = RegenParams(max_new_tokens=args.regen_max_new_tokens, seq_len=512, engine=args.regen_engine)
        sources["regenerated"] = work / "regenerated.jsonl"
        report = rewrite_dataset(
            str(verifier_dir), sources["dataset"], sources["regenerated"], params, batch_size=64
        )
        emit(event="regenerated", engine=args.regen_engine, **report.to_dict(), loadavg=list(os.getloadavg()))

    verifier = Verifier.load(str(verifier_dir), device="cpu")
    for name, path in sources.items():
        emit(event="answers", data=name, **answer_stats(path, verifier.tokenizer))

    # One set of held-out prompts for both runs: the dataset run's validation split (prompts end where the
    # first assistant turn starts, so they are the same text in both datasets).
    ref_spec = quality_spec(verifier_dir, sources["dataset"], args)
    ref = prepare_for_spec(ref_spec, sources["dataset"], work / "eval_data")
    _, val_idx = ref.split(ref_spec.dataset.val_fraction, ref_spec.training.seed)
    prompts = held_out_prompts(ref, val_idx, limit=args.prompts)
    eos = verifier.tokenizer.eos_token_id

    for name in runs:
        spec = quality_spec(verifier_dir, sources[name], args)
        run_dir = work / name
        data_dir = run_dir / "prepared"
        dataset = prepare_for_spec(spec, sources[name], data_dir)
        _, own_val = dataset.split(spec.dataset.val_fraction, spec.training.seed)
        start = time.monotonic()
        losses: list[float] = []
        result = train(
            spec,
            run_dir / "train",
            dataset_dir=data_dir,
            cache_dir=run_dir / "cache",
            resume=False,
            reporter=CallbackReporter(
                metrics=lambda m, losses=losses: "loss" in m and losses.append(m["loss"])
            ),
        )
        emit(event="trained", data=name, steps=result.step, status=result.status,
             seconds=round(time.monotonic() - start, 1), first_loss=round(losses[0], 4),
             last_loss=round(losses[-1], 4), train_samples=len(dataset) - len(own_val),
             loadavg=list(os.getloadavg()))  # fmt: skip
        for k in (int(x) for x in args.ks.split(",")):
            r = evaluate(result.model, verifier, prompts, k, args.max_new_tokens, eos)
            emit(
                metric="acceptance_length",
                k=k,
                data=name,
                trained=round(r.acceptance_length, 3),
                acceptance_rate_per_position=[round(x, 3) for x in r.acceptance_rate_per_position],
                k_beyond_trained_depths=k > args.num_depths,
                prompts=len(prompts),
                generated_tokens=r.num_generated_tokens,
                train_steps=result.step,
            )
        del result


if __name__ == "__main__":
    main()
