"""`peagle demo --model NAME`: the shipped CPU recipe (`peagle recipes smollm2-cpu`) run as a job on a real
catalogue model, with its own smaller budget.

The job spec is the recipe's (`peagle_core.recipes.preset`); the demo departs from it only by
`REAL_BUDGETS`: fewer training tokens so that it fits in ~20 minutes on 2 cores, fewer evaluation prompts,
and vLLM's speed-up timed at batch 1 only. The speed-up is vLLM's own, measured by the job: output tokens/s
with the drafter and with vLLM's training-free `ngram` speculator, each over plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECIPE = "smollm2-cpu"


@dataclass(frozen=True)
class RealBudget:
    """How much the real-model demo spends, as departures from the recipe: its training tokens, its
    evaluation prompts, and `overrides` of the recipe's spec (dotted paths)."""

    train_tokens: int
    eval_prompts: int
    overrides: dict[str, Any] = field(default_factory=dict)


REAL_BUDGETS = {
    # One pass over 0.8M tokens, not the recipe's 3M: hidden states ~5 min and training ~5 min on a 2-core
    # AMX CPU (README, "Real material"); 8 prompts, one per MT-Bench category; the speed-up at batch 1 only,
    # in 2 paired rounds (3 took 7.3 of the demo's 21.3 minutes from a fresh clone).
    "default": RealBudget(
        train_tokens=800_000,
        eval_prompts=8,
        overrides={"evaluation.speedup_batch_sizes": [1], "evaluation.speedup_rounds": 2},
    ),
    # Seconds: a smoke test of the path, not the recipe (a small sequence, vocabulary and step count).
    "test": RealBudget(
        train_tokens=4_000,
        eval_prompts=2,
        overrides={
            "dataset.seq_len": 256,
            "model.draft_vocab_size": 2048,
            "training.max_steps": 4,
            "training.total_seq_len": 1024,
            "evaluation.max_new_tokens": 8,
            "evaluation.speedup_batch_sizes": [1],
        },
    ),
}


# fp32 rates of this recipe on a 2-core AVX2-only EPYC (Zen 3), 2026-12-07, in bench/recipe_sweep.py on 0.6M
# ShareGPT tokens: vLLM's hidden states at seq_len 1024 (398 tokens/s over 177k tokens) and the K=2 step
# (100 steps of 4,096 tokens in under 7.3 min, setup included; 1,097 tokens/s at the last step).
AVX2_HIDDEN_STATES_TOKENS_S = 400.0
AVX2_TRAIN_TOKENS_S = 950.0


def slow_cpu_notice(
    size: str, *, flags: frozenset[str] | None = None, cuda: bool | None = None
) -> str | None:
    """What to expect when the job trains on this machine's CPU and it has no bf16 matrix instructions
    (`flags`, `cuda`: this machine's unless given): the demo's budget timed at the fp32 rates measured on
    such a CPU. None on a GPU or a fast-bf16 CPU, where the README's times hold."""
    from peagle_core.model.precision import FAST_BF16_FLAGS, cpu_flags

    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    flags = cpu_flags() if flags is None else flags
    if cuda or any(f in flags for f in FAST_BF16_FLAGS):
        return None
    tokens = REAL_BUDGETS[size].train_tokens
    minutes = (tokens / AVX2_HIDDEN_STATES_TOKENS_S + tokens / AVX2_TRAIN_TOKENS_S) / 60
    if minutes < 1:  # a smoke-test budget
        return None
    return (
        "note: this CPU has no bf16 matrix instructions (AMX or AVX512-BF16), so the recipe runs in fp32 "
        f"(`precision: auto`). Its hidden states and training of {tokens / 1e6:g}M tokens alone take about "
        f"{minutes:.0f} min at the rates measured on a 2-core AVX2 CPU ({AVX2_HIDDEN_STATES_TOKENS_S:.0f} and "
        f"{AVX2_TRAIN_TOKENS_S:.0f} tokens/s), against ~9 min on a 2-core AMX one; the progress bar's ETA is "
        "this machine's, and `--size test` runs the same path in minutes."
    )


def real_inputs(model: str, size: str, work: Path) -> tuple[Path, Path, list[dict[str, str]]]:
    """(verifier dir, training conversations JSONL, evaluation prompts), from the catalogue's wheels."""
    from peagle_core.recipes.material import training_data, verifier_dir
    from peagle_core.recipes.preset import RecipeError, load_recipe
    from peagle_core.recipes.prompts import eval_prompts

    recipe, b = load_recipe(RECIPE), REAL_BUDGETS[size]
    if model != recipe.verifier:
        raise RecipeError(
            f"--model: the real demo runs the {RECIPE} recipe, whose verifier is {recipe.verifier}"
        )
    seq_len = b.overrides.get("dataset.seq_len")
    data = training_data(recipe, work, train_tokens=b.train_tokens, seq_len=seq_len)
    return verifier_dir(recipe), data.path, eval_prompts(recipe.eval_dataset, b.eval_prompts)


def real_spec(
    verifier: str, dataset_id: str, eval_prompts: list[Any], size: str, *, vllm: bool | None = None
) -> dict[str, Any]:
    """The job the real-model demo posts: the recipe's spec with the demo's budget. Without vLLM
    (`vllm`, else whether it imports) the hidden states come from transformers in hybrid mode and nothing
    is timed."""
    from peagle_core.recipes.preset import load_recipe
    from peagle_core.vllm_engine import vllm_available

    b = REAL_BUDGETS[size]
    overrides = dict(b.overrides)
    if not (vllm_available() if vllm is None else vllm):
        overrides.update({
            "hidden_states.mode": "hybrid", "hidden_states.engine": "transformers",
            "evaluation.measure_speedup": False,
        })  # fmt: skip
    return load_recipe(RECIPE).job_spec(
        verifier,
        dataset_id=dataset_id,
        eval_prompts=eval_prompts,
        name=f"demo-{Path(verifier).name}-{size}",
        overrides=overrides,
    )
