"""How far vLLM's acceptance length strays from ours on the same prompts: the noise the gate's floor allows.

Trains a drafter on the toy verifier (or takes `--drafter DIR`, an fp32 or bf16 export), then at every
K on the same held-out prompts: our evaluator with the fp32 and the bf16 weights, vLLM on the bf16 and the
fp32 export with all prompts in one batch, and vLLM at batch 1. Then the same comparison on disjoint
subsets of `--subset` prompts (how noisy a handful of prompts is), and vLLM on two corrupted copies of the
export (d2t rolled by one, wrong aux layers), which must fall below the floor. One JSON line per figure.

    python bench/gate_noise.py --size test --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from _common import emit


def train_drafter(verifier_dir: Path, data: Path, out: Path, args: argparse.Namespace) -> Path:
    """A drafter trained on the toy verifier through the job's pipeline (prepare, train, export); its
    exported directory."""
    from peagle_core.pipeline.stages import run_pipeline
    from peagle_core.spec import parse_spec

    spec = parse_spec(
        {
            "verifier": {"name_or_path": str(verifier_dir)},
            "dataset": {"path": str(data), "seq_len": args.seq_len, "val_fraction": 0.05},
            "hidden_states": {"mode": "online"},
            "model": {
                "num_layers": args.num_layers,
                "num_depths": args.num_depths,
                "draft_vocab_size": args.draft_vocab,
            },
            "training": {
                "epochs": 1000,
                "max_steps": args.steps,
                "total_seq_len": 4 * args.seq_len,
                "lr": 3e-3,
                "checkpoint_every_steps": 10**6,
            },
            "evaluation": {"prompts": 0},
            "export": {"vllm_check": False, "dtype": "fp32"},
        }
    )
    result = run_pipeline(spec, out)
    if result.export_dir is None:
        raise SystemExit(f"training ended {result.status} without an exported drafter")
    return Path(result.export_dir)


def corrupt(src: Path, dst: Path, how: str) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if how == "d2t":
        tensors = load_file(str(dst / "model.safetensors"))
        # Draft id i now maps where draft id i+1 did: every proposal is a neighbour's token.
        tensors["d2t"] = torch.roll(tensors["d2t"] + torch.arange(len(tensors["d2t"])), 1) - torch.arange(
            len(tensors["d2t"])
        )
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    else:
        cfg = json.loads((dst / "config.json").read_text())
        ids = cfg["eagle_aux_hidden_state_layer_ids"]
        cfg["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2] if ids != [0, 1, 2] else [1, 2, 3]
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="test", choices=["test", "default"], help="toy verifier size")
    p.add_argument("--drafter", type=Path, help="an exported drafter (skips training)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--num-depths", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--conversations", type=int, default=600)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--subset", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from peagle_core.evaluation.acceptance import evaluate
    from peagle_core.figures import Acceptance
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.model.drafter import PEagleDraftModel
    from peagle_core.serving.export import export_checkpoint
    from peagle_core.serving.gate import acceptance_floor
    from peagle_core.toy import build_corpus, build_toy_verifier, write_toy_dataset
    from peagle_core.vllm_engine import VllmProcess, VllmRun

    cache = Path(os.environ.get("PEAGLE_CACHE_DIR", Path.home() / ".cache" / "peagle")) / "toy"
    verifier_dir = build_toy_verifier(args.size, seed=0, cache_dir=cache)
    with tempfile.TemporaryDirectory(prefix="peagle-bench-gate-") as tmp_s:
        tmp = Path(tmp_s)
        if args.drafter is None:
            data = write_toy_dataset(tmp / "train.jsonl", n=args.conversations, seed=0)
            src = train_drafter(verifier_dir, data, tmp / "run", args)
        else:
            src = args.drafter
        fp32 = PEagleDraftModel.from_pretrained(src).float()
        exports = {}
        for dtype in ("fp32", "bf16"):
            exports[dtype] = export_checkpoint(
                fp32, tmp / f"export-{dtype}", verifier_name_or_path=str(verifier_dir), dtype=dtype
            )
        bf16 = PEagleDraftModel.from_pretrained(exports["bf16"]).float()  # bf16 weights, fp32 compute
        tok = AutoTokenizer.from_pretrained(str(verifier_dir))
        prompts = []
        for conv in build_corpus(seed=0)[-args.prompts :]:
            head = [m for m in conv["messages"] if m["role"] != "assistant"][:2]
            ids = tok.apply_chat_template(head, add_generation_prompt=True, tokenize=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        verifier = Verifier.load(str(verifier_dir), device="cpu")
        eos = verifier.tokenizer.eos_token_id
        vdir, n = str(verifier_dir), args.new_tokens

        def ours_per_prompt(model, k):
            return [evaluate(model, verifier, [torch.tensor(q)], k, n, eos) for q in prompts]

        def pooled_ours(rs) -> Acceptance:
            passes = sum(r.verifier_passes for r in rs)
            al = sum(r.acceptance_length * r.verifier_passes for r in rs) / max(passes, 1)
            rates = [
                sum(r.acceptance_rate_per_position[j] * r.verifier_passes for r in rs) / max(passes, 1)
                for j in range(len(rs[0].acceptance_rate_per_position))
            ]
            return Acceptance(al, rates, drafts=passes)

        def pooled_vllm(runs: list[VllmRun]) -> Acceptance:
            drafts = sum(r.num_drafts for r in runs)
            accepted = sum(r.num_accepted_tokens for r in runs)
            per_pos = [
                sum(r.accepted_per_position[j] for r in runs)
                for j in range(len(runs[0].accepted_per_position))
            ]
            return Acceptance(
                1 + accepted / max(drafts, 1), [a / max(drafts, 1) for a in per_pos], drafts=drafts
            )

        def gap(a: Acceptance, b: Acceptance) -> dict:
            floor = acceptance_floor(a, b)
            return {
                "ours": round(a.acceptance_length, 4),
                "vllm": round(b.acceptance_length, 4),
                "rel_gap_al": round((a.acceptance_length - b.acceptance_length) / a.acceptance_length, 4),
                "rel_gap_excess": round(
                    (a.acceptance_length - b.acceptance_length) / max(a.acceptance_length - 1, 1e-9), 4
                ),
                "ours_rates": [round(r, 4) for r in a.rate_per_position],
                "vllm_rates": [round(r, 4) for r in b.rate_per_position],
                "ours_drafts": a.drafts,
                "vllm_drafts": b.drafts,
                "floor": None if floor is None else round(floor, 4),
                "passes": floor is None or b.acceptance_length >= floor,
            }

        with VllmProcess() as vllm:
            plain = vllm.generate(vdir, prompts, n)
            for k in range(1, fp32.config.num_depths + 1):
                ours32 = ours_per_prompt(fp32, k)
                ours16 = ours_per_prompt(bf16, k)
                all32, all16 = pooled_ours(ours32), pooled_ours(ours16)
                emit(bench="gate_noise", k=k, compare="ours fp32 vs ours bf16", **gap(all32, all16))
                for dtype in ("bf16", "fp32"):
                    run = vllm.generate(vdir, prompts, n, drafter=str(exports[dtype]), k=k)
                    assert run.tokens == plain.tokens
                    emit(bench="gate_noise", k=k, compare=f"ours fp32 vs vllm {dtype} batch {len(prompts)}",
                         ours_tokens_equal=[r.tokens[0] for r in ours32] == run.tokens,
                         **gap(all32, pooled_vllm([run])))  # fmt: skip
                singles = [vllm.generate(vdir, [q], n, drafter=str(exports["bf16"]), k=k) for q in prompts]
                emit(bench="gate_noise", k=k, compare="ours fp32 vs vllm bf16 batch 1",
                     **gap(all32, pooled_vllm(singles)))  # fmt: skip
                worst = None
                for start in range(0, len(prompts) - args.subset + 1, args.subset):
                    part = slice(start, start + args.subset)
                    g = gap(pooled_ours(ours32[part]), pooled_vllm(singles[part]))
                    if worst is None or abs(g["rel_gap_excess"]) > abs(worst["rel_gap_excess"]):
                        worst = g
                    if not g["passes"]:
                        emit(bench="gate_noise", k=k, compare=f"FALSE FAIL subset {start}", **g)
                emit(bench="gate_noise", k=k, compare=f"worst subset of {args.subset} (batch 1)", **worst)
                for how in ("d2t", "aux_layers"):
                    bad = corrupt(exports["bf16"], tmp / f"bad-{how}-{k}", how)
                    run = vllm.generate(vdir, prompts, n, drafter=str(bad), k=k)
                    emit(bench="gate_noise", k=k, compare=f"ours fp32 vs vllm corrupted {how}",
                         lossless=run.tokens == plain.tokens, **gap(all32, pooled_vllm([run])))  # fmt: skip
                    small = vllm.generate(vdir, prompts[: args.subset], n, drafter=str(bad), k=k)
                    emit(bench="gate_noise", k=k, compare=f"{args.subset} prompts, corrupted {how}",
                         **gap(pooled_ours(ours32[: args.subset]), pooled_vllm([small])))  # fmt: skip


if __name__ == "__main__":
    main()
