"""Training throughput: tokens/s and MFU of full training steps (cached hidden states → forward, backward, AdamW).

Standard small config: the toy verifier's H=256, a 4-layer drafter with K=4 depths, packed rows of 2048
tokens. Hidden states come from an offline cache built first (not timed). MFU divides the step's model
FLOPs by a measured fp32 GEMM peak (bench/_common.py). Prints one JSON line.

    python bench/train_throughput.py --steps 10
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from _common import drafter_step_flops, emit, gemm_peak_flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--toy-size", default="default", choices=["default", "test"])
    parser.add_argument("--samples", type=int, default=400, help="conversations to cache")
    args = parser.parse_args()

    from peagle_core.data import prepare_dataset
    from peagle_core.data.packing import pack_bins
    from peagle_core.hidden_states.build import build_cache
    from peagle_core.hidden_states.cache import CacheFingerprint
    from peagle_core.hidden_states.loader import BatchLoader, VerifierCompute, make_source
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.spec import parse_spec
    from peagle_core.toy import build_toy_verifier, write_toy_dataset
    from peagle_core.training.builders import build_model, build_optimizer, build_teacher
    from peagle_core.training.loop import forward_backward

    work = Path(tempfile.mkdtemp(prefix="peagle-throughput-"))
    verifier_dir = build_toy_verifier(args.toy_size)
    data = write_toy_dataset(work / "corpus.jsonl", n=args.samples)
    dataset = prepare_dataset(verifier_dir, data, work / "data", seq_len=min(args.seq_len, 1024))
    verifier = Verifier.load(str(verifier_dir), device="cpu")
    fingerprint = CacheFingerprint.of(verifier, dataset)
    build_cache(
        work / "cache", dataset, VerifierCompute(dataset, lambda: verifier), fingerprint, dtype="bf16"
    )
    source = make_source("offline", dataset, verifier_factory=lambda: verifier, cache_dir=work / "cache",
                         fingerprint=fingerprint)  # fmt: skip

    spec = parse_spec(
        {
            "verifier": {"name_or_path": str(verifier_dir)},
            "dataset": {"path": str(data), "seq_len": min(args.seq_len, 1024)},
            "model": {"num_layers": 4, "num_depths": 4, "draft_vocab_size": None},
            "training": {"total_seq_len": args.seq_len},
        }
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build_model(spec, verifier, dataset, device).train()
    teacher = build_teacher(verifier, model)
    optimizer = build_optimizer(model, 1e-4, 0.01)
    generator = torch.Generator().manual_seed(0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    cfg = model.config

    bins = []
    epoch = 0
    while len(bins) < args.steps + args.warmup:
        bins += pack_bins(dataset.lengths, args.seq_len, seed=0, epoch=epoch)
        epoch += 1
    loader = iter(BatchLoader(dataset, source, bins[: args.steps + args.warmup], total_seq_len=args.seq_len))

    tokens = flops = 0
    elapsed = 0.0
    for i in range(args.steps + args.warmup):
        batch = next(loader).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = forward_backward(
            model, teacher, batch, num_segments=1, generator=generator, scale=1.0, autocast=autocast
        )
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i < args.warmup:
            continue
        positions = [int(metrics[f"positions_{d}"]) for d in range(cfg.num_depths)]
        elapsed += dt
        tokens += batch.num_tokens
        flops += drafter_step_flops(cfg, args.seq_len, positions)

    peak = gemm_peak_flops() if device.type == "cpu" else float("nan")
    achieved = flops / elapsed
    emit(
        metric="train_throughput",
        device=device.type,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_depths=cfg.num_depths,
        seq_len=args.seq_len,
        steps=args.steps,
        tokens_per_s=round(tokens / elapsed, 1),
        step_s=round(elapsed / args.steps, 4),
        model_tflops=round(achieved / 1e12, 4),
        peak_tflops=round(peak / 1e12, 4),
        mfu=round(achieved / peak, 4) if peak == peak else None,
        threads=torch.get_num_threads(),
    )


if __name__ == "__main__":
    main()
