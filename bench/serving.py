"""A trained drafter in real vLLM: acceptance length from vLLM's counters beside ours, and vLLM's speed.

Trains a drafter on the toy verifier (or takes `--drafter DIR`), then, on the same held-out prompts:
vLLM's greedy decoding without a drafter (output tokens/s), and with it at every K = 1..num_depths
(acceptance length and per-position rates from vLLM's spec-decode counters, output tokens/s, and whether
the output equals the plain greedy output), plus our own evaluator's acceptance length at each K.
One JSON line per measurement. On a GPU machine with vLLM's CUDA build the same script runs in bf16.

    python bench/serving.py --size default --steps 200
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from _common import emit


def train_drafter(verifier_dir: Path, data: Path, out: Path, args: argparse.Namespace) -> Path:
    from peagle_core.pipeline.stages import run_pipeline
    from peagle_core.spec import parse_spec

    spec = parse_spec(
        {
            "verifier": {"name_or_path": str(verifier_dir)},
            "dataset": {"path": str(data), "seq_len": args.seq_len, "val_fraction": 0.05},
            "hidden_states": {"mode": "hybrid", "dtype": "fp32"},
            "model": {"num_layers": args.num_layers, "num_depths": args.num_depths, "draft_vocab_size": None},
            "training": {
                "epochs": 1000,
                "max_steps": args.steps,
                "total_seq_len": 4 * args.seq_len,
                "lr": 2e-3,
                "checkpoint_every_steps": 10**6,
            },
            "evaluation": {"prompts": 0},  # measured below on the bench's own prompts
            "export": {"vllm_check": False},
        }
    )
    result = run_pipeline(spec, out)
    assert result.export_dir is not None
    return result.export_dir


def best_of(n: int, fn):
    """The fastest of `n` identical runs (the others differ only by what else the machine was doing)."""
    runs = [fn() for _ in range(n)]
    return min(runs, key=lambda r: r.seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="default", choices=["test", "default"], help="toy verifier size")
    p.add_argument("--drafter", type=Path, help="an exported drafter (skips training)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-depths", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--conversations", type=int, default=1200)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting; the fastest is reported")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from peagle_core.evaluation.acceptance import evaluate
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.model.drafter import PEagleDraftModel
    from peagle_core.serving.judge import agreement_gap, engine_options
    from peagle_core.toy import build_corpus, build_toy_verifier, write_toy_dataset
    from peagle_core.vllm_engine import VllmProcess

    cache = Path(os.environ.get("PEAGLE_CACHE_DIR", Path.home() / ".cache" / "peagle")) / "toy"
    verifier_dir = build_toy_verifier(args.size, seed=0, cache_dir=cache)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="peagle-bench-serving-") as tmp:
        if args.drafter is None:
            data = write_toy_dataset(Path(tmp) / "train.jsonl", n=args.conversations, seed=0)
            drafter_dir = train_drafter(verifier_dir, data, Path(tmp) / "run", args)
        else:
            drafter_dir = args.drafter
        tok = AutoTokenizer.from_pretrained(str(verifier_dir))
        # Prompts from the corpus tail, past the conversations the drafter trained on.
        convs = build_corpus(seed=0)[-args.prompts :]
        prompts = []
        for conv in convs:
            head = [m for m in conv["messages"] if m["role"] != "assistant"][:2]
            ids = tok.apply_chat_template(head, add_generation_prompt=True, tokenize=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))

        verifier = Verifier.load(str(verifier_dir), device=str(device))
        drafter = PEagleDraftModel.from_pretrained(drafter_dir).to(device)
        depths = drafter.config.num_depths
        opts = engine_options(device)
        with VllmProcess() as vllm:
            vllm.generate(str(verifier_dir), prompts[:1], 4, **opts)  # warm-up: engine build, first batch
            plain = best_of(
                args.repeats, lambda: vllm.generate(str(verifier_dir), prompts, args.new_tokens, **opts)
            )
            emit(bench="serving", engine="vllm", k=0, drafter=False, device=device.type,
                 output_tokens=plain.num_output_tokens, output_tokens_per_s=plain.summary()["output_tokens_per_s"])  # fmt: skip
            for k in range(1, depths + 1):
                vllm.generate(str(verifier_dir), prompts[:1], 4, drafter=str(drafter_dir), k=k, **opts)
                run = best_of(
                    args.repeats,
                    lambda k=k: vllm.generate(
                        str(verifier_dir), prompts, args.new_tokens, drafter=str(drafter_dir), k=k, **opts
                    ),
                )
                ours = evaluate(
                    drafter,
                    verifier,
                    [torch.tensor(p, device=device) for p in prompts],
                    k,
                    args.new_tokens,
                    verifier.tokenizer.eos_token_id,
                )
                s = run.summary()
                emit(
                    bench="serving",
                    engine="vllm",
                    k=k,
                    drafter=True,
                    device=device.type,
                    vllm_acceptance_length=s["acceptance_length"],
                    vllm_acceptance_rate_per_position=s["acceptance_rate_per_position"],
                    peagle_acceptance_length=ours.acceptance_length,
                    peagle_acceptance_rate_per_position=ours.acceptance_rate_per_position,
                    agreement_gap=agreement_gap(ours.acceptance_length, s["acceptance_length"]),
                    output_equals_plain_greedy=run.tokens == plain.tokens,
                    output_tokens_per_s=s["output_tokens_per_s"],
                    speedup_vs_plain=s["output_tokens_per_s"] / plain.summary()["output_tokens_per_s"],
                    num_drafts=run.num_drafts,
                    num_accepted_tokens=run.num_accepted_tokens,
                )


if __name__ == "__main__":
    main()
