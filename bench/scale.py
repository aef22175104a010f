"""Scale-out: step time, tokens/s and peak memory per rank for DDP vs FSDP at 1, 2 and 4 ranks, and DCP
checkpoint save (sync, and async's blocking part) and load time at each world size. One JSON line per
rank and configuration.

Each configuration is a torchrun launch of this script (gloo on CPU, nccl on CUDA) training the toy drafter
through peagle_core's own `setup`/`train_step`/`save_checkpoint`/`restore_latest`. The global batch is
fixed (`--rows` packed rows per step, whatever the world size), so the figures compare the same work
split more ways. `state_mb` is the rank's share of weights + optimizer moments, the part FSDP divides.

    python bench/scale.py --quick          # 1 and 2 ranks, few steps (what bench/gpu_suite.py runs)
    python bench/scale.py                  # 1, 2 and 4 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _rank_main(args: argparse.Namespace) -> None:
    """One rank of one configuration: timed steps, then checkpoint save / async save / load."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from _common import peak_rss_mb
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from peagle_core.data.packing import step_shards
    from peagle_core.hidden_states.loader import BatchLoader
    from peagle_core.spec import load_spec
    from peagle_core.training import distributed as dist_utils
    from peagle_core.training.builders import epoch_bins, global_batch_bins
    from peagle_core.training.loop import Hooks, setup, train_step
    from peagle_core.training.resume import DataPosition, restore_latest, save_checkpoint

    torch.set_num_threads(1)
    spec = load_spec(args.spec)
    info = dist_utils.init_distributed()
    out = Path(args.out)
    run, _ = setup(spec, out, info, Hooks(info), resume=False, dataset_dir=args.dataset, cache_dir=None)
    device = run.device
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        dist_utils.barrier(info)

    bins = epoch_bins(run.data.train_idx, list(run.data.dataset.lengths), spec, 0)
    n = args.warmup + args.steps
    shards = step_shards(len(bins), 0, global_batch_bins(spec), info.rank, info.world_size)
    blocks = step_shards(len(bins), 0, global_batch_bins(spec))  # each step's rows over all ranks
    shards, blocks = [(x * (1 + n // len(x)))[:n] for x in (shards, blocks)]
    rows = [bins[b] for s in shards for b in s.bins]
    loader = iter(
        BatchLoader(run.data.dataset, run.data.source, rows, total_seq_len=spec.training.total_seq_len)
    )
    times, tokens = [], 0.0
    for i, (shard, block) in enumerate(zip(shards, blocks, strict=True)):
        sync()
        t0 = time.perf_counter()
        train_step(run, loader, shard, epoch=0)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            tokens += sum(run.data.dataset.lengths[j] - 1 for b in block.bins for j in bins[b])
    loader.close()

    state = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in run.model.parameters())
    moments = sum(
        (v.to_local() if hasattr(v, "to_local") else v).numel()
        for s in run.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.ndim > 0
    )
    position = DataPosition(step=len(shards), epoch=0, bins_done=0)
    ckpt = dict(module=run.train_module, optimizer=run.optimizer, scheduler=run.scheduler)
    sync()
    t0 = time.perf_counter()
    save_checkpoint(out / "checkpoints", position=position, info=info, **ckpt)
    save_s = time.perf_counter() - t0
    sync()
    t0 = time.perf_counter()
    restore_latest(out / "checkpoints", info=info, **ckpt)
    sync()
    load_s = time.perf_counter() - t0

    # dcp.async_save: how long training would block (staging) against the whole write.
    group = dist.new_group(backend="gloo") if info.enabled and cuda else None
    model_state, optim_state = get_state_dict(run.train_module, run.optimizer)
    sync()
    t0 = time.perf_counter()
    future = dcp.async_save(
        {"model": model_state, "optim": optim_state}, checkpoint_id=out / "async", process_group=group
    )
    async_block_s = time.perf_counter() - t0
    future.result()
    sync()
    async_total_s = time.perf_counter() - t0

    step_s = sorted(times)[len(times) // 2] if times else None
    figures = {
        "bench": "scale",
        "sharding": spec.training.sharding,
        "world_size": info.world_size,
        "rank": info.rank,
        "device": run.device.type,
        "step_s_median": round(step_s, 4) if step_s else None,
        "tokens_per_s": round(tokens / sum(times), 1) if times else None,
        "state_mb": round((state + moments) * 4 / 2**20, 2),  # fp32 weights + AdamW moments on this rank
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "cuda_max_allocated_mb": round(torch.cuda.max_memory_allocated(run.device) / 2**20, 1)
        if cuda
        else None,
        "ckpt_save_s": round(save_s, 3),
        "ckpt_load_s": round(load_s, 3),
        "ckpt_async_block_s": round(async_block_s, 3),
        "ckpt_async_total_s": round(async_total_s, 3),
        "ckpt_mb": round(
            sum(f.stat().st_size for f in (out / "checkpoints").rglob("*") if f.is_file()) / 2**20, 2
        ),
    }
    (out / f"rank{info.rank}.json").write_text(json.dumps(figures))
    dist_utils.barrier(info)
    del run, ckpt, model_state, optim_state, loader, future, group  # the DDP wrapper goes before the group
    dist_utils.shutdown()


def _prepare(work: Path, quick: bool) -> tuple[Path, Path]:
    """The toy verifier and a prepared toy dataset (built once, shared by every launch)."""
    from peagle_core.data import prepare_dataset
    from peagle_core.toy import build_toy_verifier, write_toy_dataset

    verifier = build_toy_verifier("test" if quick else "default")
    data = write_toy_dataset(work / "corpus.jsonl", n=96 if quick else 256, seed=0)
    prepare_dataset(verifier, data, work / "data", seq_len=128, draft_vocab_size=256)
    return verifier, data


def _spec(verifier: Path, data: Path, sharding: str, rows: int, layers: int) -> dict[str, Any]:
    return {
        "verifier": {"name_or_path": str(verifier)},
        "dataset": {"path": str(data), "seq_len": 128, "val_fraction": 0.05},
        "hidden_states": {"mode": "online"},
        "model": {"num_layers": layers, "num_depths": 3, "draft_vocab_size": 256},
        # `rows` rows a step at any world size: grad_accum 1 x `rows` GPUs as the job's declared shape.
        "training": {
            "total_seq_len": 256,
            "grad_accum": 1,
            "sharding": sharding,
            "checkpoint_every_steps": 10**6,
        },
        "resources": {"gpus": rows},
        "evaluation": {"prompts": 0, "engine": "peagle"},
        "export": {"vllm_check": False},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 2 ranks, 2+3 steps, the small toy")
    parser.add_argument("--ranks", type=int, nargs="*", default=None, help="world sizes (default 1 2 4)")
    parser.add_argument("--sharding", nargs="*", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration")
    parser.add_argument("--rows", type=int, default=4, help="packed rows per optimizer step (all ranks)")
    parser.add_argument("--layers", type=int, default=2, help="drafter decoder layers")
    parser.add_argument("--work", type=Path, default=None)
    # One rank of a torchrun launch (internal).
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--dataset", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        _rank_main(args)
        return

    from peagle_core.spec import parse_spec

    ranks = args.ranks or ([1, 2] if args.quick else [1, 2, 4])
    steps = args.steps or (3 if args.quick else 8)
    work = args.work or Path(tempfile.mkdtemp(prefix="peagle-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    verifier, data = _prepare(work, args.quick)
    for sharding in args.sharding:
        for w in ranks:
            out = work / f"{sharding}-{w}"
            spec_file = work / f"{sharding}.json"
            spec_file.write_text(
                parse_spec(_spec(verifier, data, sharding, args.rows, args.layers)).model_dump_json()
            )
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench")]),
            }
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(w),
                   str(Path(__file__).resolve()), "--rank-worker", "--spec", str(spec_file),
                   "--dataset", str(work / "data"), "--out", str(out), "--steps", str(steps)]  # fmt: skip
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(json.dumps({"bench": "scale", "sharding": sharding, "world_size": w, "status": "failed",
                                  "error": (proc.stdout + proc.stderr)[-1500:]}), flush=True)  # fmt: skip
                continue
            for r in range(w):
                line = json.loads((out / f"rank{r}.json").read_text())
                print(json.dumps({**line, "launch_s": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
