"""The batch loader reading a hidden-state cache larger than the memory it may use: seconds per batch.

A run whose bf16 cache outgrows RAM reads it back from disk in the trainer's shuffled order. This bench
builds a cache of SmolLM2's widths (3 x 576 aux, 576 last) with synthetic values, packs it into the
trainer's rows (`peagle_core.data.packing.pack_bins`, 4,096 tokens) and times `BatchLoader` over them:
once from the page cache (`warm`), and, where this process may make a cgroup (v1 or v2, as root), once
inside a memory limit smaller than the cache (`disk`), so every read misses. Compare `s_per_batch` with a
training step's seconds (`bench/train_throughput.py`): the loader runs beside the step on its own thread.

    python bench/loader_disk.py --tokens 1.5e6 --limit-mb 2500
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from _common import emit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN = 576  # SmolLM2-135M
CGROUP_NAME = "peagle-loader-disk"


class SyntheticDataset:
    """Token ids and loss masks of random lengths (what the loader collates beside the hidden states)."""

    fingerprint = "loader-disk-synthetic"

    def __init__(self, tokens: int, seed: int = 0):
        rng = random.Random(seed)
        self.lengths: list[int] = []
        while sum(self.lengths) < tokens:
            self.lengths.append(rng.randint(200, 1024))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.lengths[i]
        return torch.full((n,), i % 1000, dtype=torch.long), torch.ones(n, dtype=torch.long)


def _fingerprint():
    from peagle_core.hidden_states.cache import CacheFingerprint

    return CacheFingerprint("loader-disk", (1, 2, 3), SyntheticDataset.fingerprint)


def build(path: Path, dataset: SyntheticDataset) -> None:
    from peagle_core.hidden_states.cache import DEFAULT_SHARD_BYTES, HiddenStateCache
    from peagle_core.hidden_states.codec import HiddenRecord

    cache = HiddenStateCache.create(path, _fingerprint(), dtype="bf16", num_dataset_samples=len(dataset))
    if len(cache) == len(dataset):
        return
    aux, last = torch.randn(1024, 3 * HIDDEN), torch.randn(1024, HIDDEN)
    items, size = [], 0
    for i, n in enumerate(dataset.lengths):
        items.append((i, HiddenRecord(aux[:n], last[:n]), dataset[i][0]))
        size += n * 4 * HIDDEN * 2
        if size >= DEFAULT_SHARD_BYTES:
            cache.write_shard(items)
            items, size = [], 0
    if items:
        cache.write_shard(items)


def read(path: Path, dataset: SyntheticDataset, batches: int, seq_len: int) -> dict[str, float]:
    from peagle_core.data.packing import pack_bins
    from peagle_core.hidden_states.cache import HiddenStateCache
    from peagle_core.hidden_states.loader import BatchLoader, OfflineSource

    cache = HiddenStateCache.create(path, _fingerprint(), dtype="bf16", num_dataset_samples=len(dataset))
    bins = pack_bins(dataset.lengths, seq_len, 0, 0)[:batches]
    loader = BatchLoader(
        dataset, OfflineSource(dataset, cache, check_token_ids=False), bins, total_seq_len=seq_len
    )
    t0 = time.perf_counter()
    n = sum(1 for _ in loader)
    elapsed = time.perf_counter() - t0
    read_mb = n * seq_len * 4 * HIDDEN * 2 / 1e6
    return {"batches": n, "s_per_batch": round(elapsed / n, 4), "mb_per_s": round(read_mb / elapsed, 1)}


def memory_cgroup(limit_bytes: int) -> Path | None:
    """A memory cgroup limited to `limit_bytes` (page cache is charged to it), or None where none can be made."""
    for base, limit_file in (
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),  # v1
        (Path("/sys/fs/cgroup"), "memory.max"),  # v2
    ):
        group = base / CGROUP_NAME
        try:
            group.mkdir(exist_ok=True)
            (group / limit_file).write_text(str(limit_bytes))
            return group
        except OSError:
            continue
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1.5e6, help="tokens in the cache (~4.6 KB each)")
    parser.add_argument(
        "--limit-mb", type=int, default=2500, help="the cgroup's memory limit (below the cache)"
    )
    parser.add_argument("--batches", type=int, default=120)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--work", type=Path, default=Path("bench-loader-disk"))
    parser.add_argument("--phase", choices=["read"], help=argparse.SUPPRESS)  # a child's one read
    args = parser.parse_args()
    for name in ("tokens", "limit_mb", "batches", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    dataset = SyntheticDataset(int(args.tokens))
    cache_dir = args.work / "cache"
    if args.phase == "read":
        print(json.dumps(read(cache_dir, dataset, args.batches, args.seq_len)), flush=True)
        return

    build(cache_dir, dataset)
    cache_mb = sum(f.stat().st_size for f in cache_dir.glob("*.safetensors")) / 1e6
    child = [sys.executable, __file__, "--phase", "read", "--tokens", str(args.tokens), "--batches",
             str(args.batches), "--seq-len", str(args.seq_len), "--work", str(args.work)]  # fmt: skip
    common = {"metric": "loader_s_per_batch", "cache_mb": round(cache_mb), "tokens": sum(dataset.lengths)}
    for f in cache_dir.glob("*.safetensors"):  # into the page cache: the warm read's premise
        f.read_bytes()
    emit(**common, where="warm", **json.loads(_run(child)))
    group = memory_cgroup(args.limit_mb << 20)
    if group is None:
        emit(**common, where="disk", skipped="no memory cgroup can be made here (needs root)")
        return
    try:
        # the child joins the group before it execs, so its page cache is charged there from the start
        enter = f'echo $$ > {group}/{"tasks" if (group / "tasks").exists() else "cgroup.procs"}; exec "$@"'
        with open("/proc/sys/vm/drop_caches", "w") as drop:
            drop.write("1")
        emit(
            **common,
            where="disk",
            limit_mb=args.limit_mb,
            **json.loads(_run(["sh", "-c", enter, "sh", *child])),
        )
    finally:
        group.rmdir()


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


if __name__ == "__main__":
    main()
