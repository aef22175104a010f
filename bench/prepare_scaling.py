"""Data preparation against a row's turns: one JSON line per size with the time `prepare_dataset` takes on a
single conversation of that many turns, and the time of its masking alone (`tokenize_conversation`).

The toy test verifier's tokenizer and chat template (built once and cached, as the tests do). Target: time
linear in a row's turns; before one-pass masking, 1,000 turn pairs took ~10 s and the cost grew with the
square of the turns.

    python bench/prepare_scaling.py --turns 1000 10000 100000 --seq-len 2048
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

from _common import emit


def conversation(turns: int) -> list[dict[str, str]]:
    """`turns` alternating user and assistant turns of a few words each."""
    return [
        {"role": "user", "content": f"What does f{i // 2} return?"}
        if i % 2 == 0
        else {"role": "assistant", "content": f"It returns {i // 2} squared."}
        for i in range(turns)
    ]


def best_of(repeats: int, fn: Any) -> float:
    """The fastest of `repeats` runs, in seconds: a busy machine only ever makes a run slower."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _prepare(verifier: Path, data: Path, outs: Iterator[Path], seq_len: int) -> None:
    from peagle_core.data.prepare import prepare_dataset

    prepare_dataset(verifier, data, next(outs), seq_len=seq_len)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from peagle_core.data.chat import tokenize_conversation
    from peagle_core.toy import build_toy_verifier

    verifier = build_toy_verifier("test")
    tokenizer = AutoTokenizer.from_pretrained(verifier)
    with tempfile.TemporaryDirectory() as tmp:
        for turns in args.turns:
            messages = conversation(turns)
            data = Path(tmp) / f"{turns}.jsonl"
            data.write_text(json.dumps({"messages": messages}) + "\n")
            outs = iter(Path(tmp) / f"prepared-{turns}-{k}" for k in range(args.repeats))
            prepare_s = best_of(args.repeats, partial(_prepare, verifier, data, outs, args.seq_len))
            mask_s = best_of(
                args.repeats, partial(tokenize_conversation, tokenizer, messages, max_tokens=args.seq_len)
            )
            emit(bench="prepare_scaling", turns=turns, row_bytes=data.stat().st_size, seq_len=args.seq_len,
                 prepare_s=round(prepare_s, 4), mask_s=round(mask_s, 4),
                 mask_us_per_turn=round(1e6 * mask_s / turns, 3))  # fmt: skip


if __name__ == "__main__":
    main()
