"""Training-state checkpoints that load at any world size: model and optimizer through
torch.distributed.checkpoint (sharded, resharded on load), schedule and data position in meta.json.

Layout: `root/step_{N:08d}/{.metadata, __R_0.distcp..., model.safetensors, meta.json}`. Every rank writes
its shards into one temporary directory; rank 0 adds the whole weights (`model.safetensors`, for readers
that want one file) and meta.json, renames it into place and then writes `root/latest`, so a crash mid-save
leaves the previous checkpoint as the one a resume picks up. Checkpoints of the earlier format
(`model.safetensors` + `state.pt` with per-rank RNG) still resume at the world size that wrote them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule

from peagle_core.errors import CheckpointError
from peagle_core.io import atomic_write_bytes
from peagle_core.training import distributed as dist_utils
from peagle_core.training.sharding import full_state_dict

LATEST = "latest"
WEIGHTS = "model.safetensors"
META = "meta.json"
DCP_METADATA = ".metadata"  # written by DCP once every rank's shards are down
LEGACY_STATE = "state.pt"  # the earlier format's optimizer, scheduler and per-rank RNG


@dataclass
class DataPosition:
    """Where training resumes: the epoch and how many of its packed rows (in the world-size-free order of
    `peagle_core.data.packing.pack_bins`) earlier steps consumed."""

    step: int
    epoch: int
    bins_done: int


@dataclass
class TrainingState:
    """A restored checkpoint: where it is, where training continues, and who wrote it."""

    path: Path
    position: DataPosition
    metrics: dict[str, Any]
    world_size: int  # of the run that wrote it


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# ------------------------------------------------------------------------------------------------- save


def save_checkpoint(
    root: str | Path,
    *,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    position: DataPosition,
    info: dist_utils.DistInfo,
    metrics: dict[str, Any] | None = None,
    extra_json: dict[str, Any] | None = None,
    keep_last: int | None = 2,
) -> Path:
    """Write `root/step_N/` (a collective: every rank calls it), then point `root/latest` at it and prune
    older checkpoints. `module` is what training runs (plain, DDP or FSDP). `extra_json` maps file names to
    objects stored beside the state (e.g. `eval.json`); rank 0's are the ones written."""
    root = Path(root)
    final = root / step_dir_name(position.step)
    # One name every rank agrees on (rank 0 clears a leftover of a crashed save first).
    tmp = root / f".{final.name}.tmp-dcp"
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist_utils.barrier(info)
    model_state, optim_state = get_state_dict(module, optimizer)
    # Synchronous: dcp.async_save would return after staging, but `latest` may only name a checkpoint
    # whose files are all down, so its rename would wait on the future anyway (bench/scale.py measures it).
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    weights = full_state_dict(module)
    if info.is_main:
        save_file({k: v.detach().contiguous().clone() for k, v in weights.items()}, str(tmp / WEIGHTS))
        meta = {
            "format": "dcp",
            "position": asdict(position),
            "scheduler": scheduler.state_dict(),
            "world_size": info.world_size,
            "metrics": metrics or {},
        }
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        for name, obj in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        _publish(tmp, final)
        atomic_write_bytes(root / LATEST, (final.name + "\n").encode())
        if keep_last:
            for old in sorted(root.glob("step_*"))[:-keep_last]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
    dist_utils.barrier(info)
    return final


def _publish(tmp: Path, final: Path) -> None:
    """fsync every file of `tmp`, then rename it to `final` (replacing one a crashed run left)."""
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------- load


def latest_checkpoint(root: str | Path) -> Path | None:
    """The directory `root/latest` names, or None when there is no complete checkpoint yet."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / META).is_file():
        raise CheckpointError(
            [f"{pointer} names {path.name}, which is missing or incomplete"], path=str(root)
        )
    return path


def restore_latest(
    root: str | Path,
    *,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    info: dist_utils.DistInfo,
) -> TrainingState | None:
    """Load the newest checkpoint under `root` into the training objects (every rank calls it), at this
    run's world size and sharding. Returns it (its `position` says where to continue), or None when there
    is none."""
    latest = latest_checkpoint(root)
    if latest is None:
        return None
    try:
        meta = json.loads((latest / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError([f"cannot read training checkpoint: {exc}"], path=str(latest)) from None
    if (latest / DCP_METADATA).is_file():
        return _restore_dcp(latest, meta, module, optimizer, scheduler)
    if (latest / LEGACY_STATE).is_file():
        return _restore_legacy(latest, meta, module, optimizer, scheduler, info)
    raise CheckpointError([f"{latest.name} holds neither DCP shards nor {LEGACY_STATE}"], path=str(latest))


def _restore_dcp(
    path: Path,
    meta: dict[str, Any],
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> TrainingState:
    model_state, optim_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as exc:  # DCP raises CheckpointException and friends from every rank's reader
        raise CheckpointError([f"cannot read training checkpoint: {exc}"], path=str(path)) from None
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(meta["scheduler"])
    return TrainingState(
        path=path,
        position=DataPosition(**meta["position"]),
        metrics=meta.get("metrics", {}),
        world_size=int(meta["world_size"]),
    )


def _restore_legacy(
    path: Path,
    meta: dict[str, Any],
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    info: dist_utils.DistInfo,
) -> TrainingState:
    """The earlier format: whole weights, optimizer and scheduler state, a per-rank position."""
    try:
        state = torch.load(path / LEGACY_STATE, map_location="cpu", weights_only=True)
        weights = load_file(str(path / WEIGHTS))
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError([f"cannot read training checkpoint: {exc}"], path=str(path)) from None
    written_by = len(state["rng"]["ranks"])
    if written_by != info.world_size:
        raise CheckpointError(
            [f"checkpoint {path.name} is in the earlier (pre-DCP) format, written by {written_by} ranks; it "
             f"resumes only at that world size, and this run has {info.world_size}"],
            path=str(path),
        )  # fmt: skip
    if isinstance(module, FSDPModule):
        raise CheckpointError(
            [
                f"checkpoint {path.name} is in the earlier (pre-DCP) format; resume it with training.sharding: ddp"
            ],
            path=str(path),
        )
    getattr(module, "module", module).load_state_dict(weights)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    old = meta["position"]
    # Its batch_index counted each rank's micro-batches; rank r's j-th was row j*W + r of the same shuffled
    # order (rows were dealt round-robin), so j rows per rank are j*W rows of the epoch.
    position = DataPosition(step=old["step"], epoch=old["epoch"], bins_done=old["batch_index"] * written_by)
    return TrainingState(path=path, position=position, metrics=meta.get("metrics", {}), world_size=written_by)
