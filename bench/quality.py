"""Drafter quality on the toy verifier: acceptance length at K = 2, 4, 6 after a fixed CPU training budget.

Trains the default drafter (4 layers, 4 parallel depths) on the toy corpus within `--minutes` of wall clock,
then prints one JSON line per K with the trained and the untrained drafter's acceptance length on held-out
prompts. K above the trained depths drafts from mask positions the drafter never trained on.

The budget covers everything after setup: the hidden-state cache (built once, so every epoch reads it),
a short calibration run that times a step, and the run itself, whose cosine schedule is sized to end
inside the budget (the deadline stops it regardless).

    python bench/quality.py --minutes 10
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import emit

CALIBRATION_STEPS = 12
SCHEDULE_SAFETY = 0.92  # leaves slack for load spikes so the schedule, not the deadline, ends the run


def quality_spec(verifier_dir: Path, data: Path, args: argparse.Namespace, max_steps: int) -> Any:
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
                "max_steps": max_steps,
                "total_seq_len": args.total_seq_len,
                "lr": args.lr,
                "warmup_ratio": args.warmup_ratio,
                "checkpoint_every_steps": 10**6,
                "seed": 0,
            },
            "evaluation": {"prompts": 0},  # evaluated below, beside the untrained drafter
        }
    )


def seconds_per_step(stamps: list[float]) -> float:
    """Mean step time from the metric callbacks' timestamps, skipping the first (warm-up) step."""
    steady = stamps[1:]
    return (steady[-1] - steady[0]) / max(1, len(steady) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="training budget (wall clock)")
    parser.add_argument("--toy-size", default="default", choices=["default", "test"])
    parser.add_argument("--num-depths", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-ratio", type=float, default=0.03)
    parser.add_argument("--total-seq-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    args = parser.parse_args()

    from peagle_core.builders import build_model
    from peagle_core.data import PreparedDataset
    from peagle_core.evaluate import evaluate, held_out_prompts
    from peagle_core.toy import build_toy_verifier, write_toy_dataset
    from peagle_core.train import train
    from peagle_core.verifier import Verifier

    work = args.out or Path(tempfile.mkdtemp(prefix="peagle-quality-"))
    t0 = time.monotonic()
    verifier_dir = build_toy_verifier(args.toy_size)
    data = write_toy_dataset(work / "corpus.jsonl")
    emit(event="setup", verifier=str(verifier_dir), seconds=round(time.monotonic() - t0, 1),
         torch_threads=torch.get_num_threads(), loadavg=list(os.getloadavg()))  # fmt: skip

    deadline = time.monotonic() + args.minutes * 60
    cache_dir, data_dir = work / "cache", work / "calibrate" / "data"
    stamps: list[float] = []
    train(
        quality_spec(verifier_dir, data, args, CALIBRATION_STEPS),
        work / "calibrate",
        cache_dir=cache_dir,
        resume=False,
        on_metrics=lambda m: "loss" in m and stamps.append(time.monotonic()),
    )
    step_s = seconds_per_step(stamps)
    # The real run's own setup (verifier, cache open, model) costs about what the calibration's did
    # outside its steps, minus the cache build it no longer does; a step's time is a fair bound for it.
    max_steps = max(1, int(SCHEDULE_SAFETY * (deadline - time.monotonic() - 2 * step_s) / step_s))
    emit(event="calibrated", seconds_per_step=round(step_s, 3), max_steps=max_steps,
         budget_left_s=round(deadline - time.monotonic(), 1))  # fmt: skip

    spec = quality_spec(verifier_dir, data, args, max_steps)
    losses: list[float] = []
    result = train(
        spec,
        work / "run",
        dataset_dir=data_dir,
        cache_dir=cache_dir,
        resume=False,
        on_metrics=lambda m: "loss" in m and losses.append(m["loss"]),
        should_stop=lambda: time.monotonic() > deadline,
    )
    last = result.metrics
    emit(event="trained", steps=result.step, planned_steps=max_steps, status=result.status,
         first_loss=round(losses[0], 4), last_loss=round(losses[-1], 4),
         train_acc={d: round(last[f"acc_{d}"], 3) for d in range(args.num_depths)},
         minutes=args.minutes, loadavg=list(os.getloadavg()))  # fmt: skip

    dataset = PreparedDataset.open(data_dir)
    _, val_idx = dataset.split(spec.dataset.val_fraction, spec.training.seed)
    verifier = Verifier.load(str(verifier_dir), device="cpu")
    prompts = held_out_prompts(dataset, val_idx, limit=args.prompts)
    torch.manual_seed(spec.training.seed)
    untrained = build_model(spec, verifier, dataset, torch.device("cpu"))
    eos = verifier.tokenizer.eos_token_id
    for k in (2, 4, 6):
        trained_r = evaluate(result.model, verifier, prompts, k, args.max_new_tokens, eos)
        untrained_r = evaluate(untrained, verifier, prompts, k, args.max_new_tokens, eos)
        emit(
            metric="acceptance_length",
            k=k,
            trained=round(trained_r.acceptance_length, 3),
            untrained=round(untrained_r.acceptance_length, 3),
            trained_rate_per_position=[round(r, 3) for r in trained_r.acceptance_rate_per_position],
            k_beyond_trained_depths=k > args.num_depths,
            prompts=len(prompts),
            generated_tokens=trained_r.num_generated_tokens,
            train_steps=result.step,
            train_minutes=args.minutes,
        )


if __name__ == "__main__":
    main()
