"""torch.distributed plumbing for training under torchrun: process-group setup, rank info, small collectives."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job; a single process is rank 0 of world size 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) set the env:// rendezvous variables for several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def init_distributed() -> DistInfo:
    """Join the process group when launched by torchrun (nccl on CUDA, gloo on CPU); no-op otherwise."""
    if not under_torchrun():
        return DistInfo()
    info = DistInfo(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group(backend=backend)
    return info


def shutdown() -> None:
    """Leave the process group (safe to call when never joined), after freeing what still holds it.

    Call it once the caller has dropped its DDP/FSDP wrappers. A DDP reducer that outlives the group holds
    the group's last reference, and frees it from a C++ destructor with the GIL held (at interpreter exit,
    or whenever the wrapper is collected); gloo's destructor joins its worker threads, one of which may wait
    for the GIL to free a finished collective's tensors: a rank that never exits. Collecting first frees the
    reducer while the group is still registered; `destroy_process_group` then drops the last reference
    from Python, which releases the GIL while gloo's threads are joined."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def device_for(info: DistInfo) -> torch.device:
    """This rank's device: its local GPU when CUDA is available, else the CPU."""
    return torch.device("cuda", info.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def any_rank(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """True on every rank if `flag` is true on any rank (so a stop request stops all ranks together)."""
    if not info.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def sum_tensor_across_ranks(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The element-wise sum of `t` over ranks (a copy; `t` is untouched)."""
    if not info.enabled:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def sum_across_ranks(counts: dict[str, int], info: DistInfo, device: torch.device) -> dict[str, int]:
    """Every rank's integer counters added up, key by key (all ranks must call it with the same keys)."""
    if not info.enabled:
        return counts
    keys = list(counts)
    t = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64, device=device)
    total = sum_tensor_across_ranks(t, info)
    return {k: round(v) for k, v in zip(keys, total.tolist(), strict=True)}
