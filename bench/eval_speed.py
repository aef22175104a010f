"""Evaluator speed: the KV-cached, batched evaluator against the full-recompute reference, same prompts.

Prints one JSON line per evaluator (`reference`, `cached`, and `cached` with the drafter recomputed in
full every step, `drafter_cache: false`) with wall time, generated tokens/s and acceptance length, then a
`speedup` line (reference time / cached time) that also says whether both produced the same tokens.

The verifier is the toy (test size, built and cached) unless `--verifier DIR` names a Hugging Face
directory (e.g. SmolLM2-135M-Instruct from `peagle models get`). The drafter is an untrained 1-layer one
(AL about 1: this measures cost, not quality) unless `--drafter DIR` names a checkpoint. Prompts are the
toy corpus's first user turns rendered with the verifier's chat template.

    nice python bench/eval_speed.py [--verifier DIR] [--drafter DIR] [--prompts 8] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import emit


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verifier", type=Path, default=None, help="HF model directory (default: the toy)")
    p.add_argument("--drafter", type=Path, default=None, help="drafter checkpoint (default: untrained)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=4, help="drafted tokens per step")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--skip", default="", help="evaluators not to run, comma-separated: reference,uncached_drafter"
    )
    return p.parse_args()


def toy_verifier_dir() -> Path:
    from peagle_core.toy import build_toy_verifier

    cache = os.environ.get("PEAGLE_CACHE_DIR")
    root = Path(cache) / "toy" if cache else Path(tempfile.gettempdir()) / "peagle-bench-toy"
    return build_toy_verifier("test", seed=0, cache_dir=root)


def chat_prompts(tokenizer: Any, n: int) -> list[torch.Tensor]:
    """The first user turn of the first `n` toy conversations, rendered for generation."""
    from peagle_core.toy import build_corpus

    prompts = []
    for conv in build_corpus(seed=0)[:n]:
        first_user = next(m for m in conv["messages"] if m["role"] == "user")
        ids = tokenizer.apply_chat_template([first_user], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        prompts.append(torch.tensor(list(ids), dtype=torch.long))
    return prompts


def untrained_drafter(verifier: Any, k: int) -> Any:
    from peagle_core.model.config import PEagleConfig
    from peagle_core.model.drafter import PEagleDraftModel

    torch.manual_seed(0)
    config = PEagleConfig.from_verifier(
        verifier.config, num_layers=1, num_depths=k, aux_layer_ids=list(verifier.layer_ids)
    )
    model = PEagleDraftModel(config)
    model.init_embeddings(verifier.embed_weight.detach().float())
    return model


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from peagle_core.evaluation.acceptance import evaluate
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.model.drafter import PEagleDraftModel

    verifier_dir = args.verifier or toy_verifier_dir()
    verifier = Verifier.load(str(verifier_dir), device="cpu", dtype="float32")
    if args.drafter:
        drafter = PEagleDraftModel.from_pretrained(args.drafter)
    else:
        drafter = untrained_drafter(verifier, args.k)
    drafter.eval()
    k = min(args.k, drafter.config.num_depths)
    prompts = chat_prompts(verifier.tokenizer, args.prompts)
    eos = verifier.tokenizer.eos_token_id
    skip = set(filter(None, args.skip.split(",")))
    common = {
        "bench": "eval_speed",
        "verifier": "toy" if args.verifier is None else str(args.verifier),
        "prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "max_new_tokens": args.max_new_tokens,
        "k": k,
        "threads": torch.get_num_threads(),
    }

    def evaluator(**how: Any) -> Callable[[], Any]:
        return lambda: evaluate(
            drafter, verifier, prompts, k, args.max_new_tokens, eos, batch_size=args.batch_size, **how
        )

    runs = {
        "reference": evaluator(reference=True),
        "cached": evaluator(),
        "uncached_drafter": evaluator(drafter_cache=False),
    }
    results: dict[str, tuple[float, Any]] = {}
    # warm-up: one short prompt through the cached path (allocator, thread pool, lazy imports)
    evaluate(drafter, verifier, prompts[:1], k, 2, eos)
    for name, run in runs.items():
        if name in skip:
            continue
        started = time.perf_counter()
        result = run()
        elapsed = time.perf_counter() - started
        results[name] = (elapsed, result)
        emit(
            **common,
            evaluator=name if name == "reference" else "cached",
            **({} if name == "reference" else {"drafter_cache": name == "cached"}),
            wall_s=round(elapsed, 3),
            generated_tokens=result.num_generated_tokens,
            tokens_per_s=round(result.num_generated_tokens / elapsed, 2),
            acceptance_length=round(result.acceptance_length, 4),
            verifier_passes=result.verifier_passes,
        )
    if "reference" in results and "cached" in results:
        (t_ref, ref), (t_new, new) = results["reference"], results["cached"]
        emit(
            **common,
            metric="speedup",
            speedup=round(t_ref / t_new, 2),
            same_tokens=ref.tokens == new.tokens,
            same_acceptance=ref.acceptance_length == new.acceptance_length,
        )


if __name__ == "__main__":
    main()
