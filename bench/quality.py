"""Drafter quality on the toy verifier: acceptance length at K = 2, 4, 6 after a fixed CPU training budget.

Trains the default drafter shape (4 layers) on the toy corpus for `--minutes`, then prints one JSON line per
K with the trained and the untrained drafter's acceptance length on held-out prompts. The drafter trains
6 parallel depths (not the default 4) so that K=6 is meaningful.

    python bench/quality.py --minutes 10
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from _common import emit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="training budget (wall clock)")
    parser.add_argument("--toy-size", default="default", choices=["default", "test"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--out", type=Path, default=None, help="work directory (default: a temp dir)")
    args = parser.parse_args()

    from peagle_core.evaluate import evaluate, held_out_prompts
    from peagle_core.spec import parse_spec
    from peagle_core.toy import build_toy_verifier, write_toy_dataset
    from peagle_core.train import build_model, train
    from peagle_core.verifier import Verifier

    work = args.out or Path(tempfile.mkdtemp(prefix="peagle-quality-"))
    t0 = time.monotonic()
    verifier_dir = build_toy_verifier(args.toy_size)
    data = write_toy_dataset(work / "corpus.jsonl")
    emit(event="setup", verifier=str(verifier_dir), seconds=round(time.monotonic() - t0, 1))

    spec = parse_spec(
        {
            "verifier": {"name_or_path": str(verifier_dir)},
            "dataset": {"path": str(data), "seq_len": 512, "val_fraction": 0.05},
            "hidden_states": {"mode": "hybrid", "dtype": "fp32"},
            "model": {"num_layers": 4, "num_depths": 6, "draft_vocab_size": None},
            "training": {
                "epochs": 100,
                "total_seq_len": 1024,
                "lr": args.lr,
                "warmup_ratio": 0.01,
                "checkpoint_every_steps": 10**6,
                "seed": 0,
            },
            "evaluation": {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens},
        }
    )
    deadline = time.monotonic() + args.minutes * 60
    losses: list[float] = []
    result = train(
        spec,
        work / "run",
        on_metrics=lambda m: "loss" in m and losses.append(m["loss"]),
        should_stop=lambda: time.monotonic() > deadline,
    )
    emit(event="trained", steps=result.step, status=result.status, first_loss=losses[0], last_loss=losses[-1],
         minutes=args.minutes)  # fmt: skip

    from peagle_core.data import PreparedDataset

    dataset = PreparedDataset.open(work / "run" / "data")
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
            prompts=len(prompts),
            train_steps=result.step,
            train_minutes=args.minutes,
        )


if __name__ == "__main__":
    main()
