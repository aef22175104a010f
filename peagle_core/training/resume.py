"""Training-state checkpoints: weights, optimizer, scheduler, RNG streams and data position, saved atomically.

Layout: `root/step_{N:08d}/{model.safetensors, state.pt, meta.json}`; `root/latest` names the newest one and
is written last, so a crash mid-save leaves the previous checkpoint as the one a resume picks up.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from peagle_core.errors import CheckpointError
from peagle_core.io import atomic_dir, atomic_write_bytes

LATEST = "latest"
WEIGHTS = "model.safetensors"
STATE = "state.pt"
META = "meta.json"


@dataclass
class DataPosition:
    """Where training resumes: the epoch and the index of the next packed batch (micro-batch) in it."""

    step: int
    epoch: int
    batch_index: int


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# --------------------------------------------------------------------------------------------- RNG state


def capture_rng(cod_generator: torch.Generator | None = None) -> dict[str, Any]:
    """Every random stream training draws from, in a form `torch.load(weights_only=True)` accepts."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if cod_generator is not None:
        state["cod"] = cod_generator.get_state()
    return state


def restore_rng(state: dict[str, Any], cod_generator: torch.Generator | None = None) -> None:
    """Put every stream back where `capture_rng` found it."""
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if cod_generator is not None and "cod" in state:
        cod_generator.set_state(state["cod"])


def _tuples(x: Any) -> Any:
    # random.setstate needs tuples; a round trip through torch.save may hand back lists.
    return tuple(_tuples(v) for v in x) if isinstance(x, list | tuple) else x


# ------------------------------------------------------------------------------------------- save / load


def save_checkpoint(
    root: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    position: DataPosition,
    rng: dict[str, Any],
    metrics: dict[str, Any] | None = None,
    extra_json: dict[str, Any] | None = None,
    keep_last: int | None = 2,
) -> Path:
    """Write `root/step_N/` atomically, then point `root/latest` at it and prune older checkpoints.

    `extra_json` maps file names to objects stored beside the state (e.g. `eval.json`).
    """
    root = Path(root)
    final = root / step_dir_name(position.step)
    weights = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    with atomic_dir(final) as tmp:
        save_file(weights, str(tmp / WEIGHTS))
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng},
            tmp / STATE,
        )
        meta = {"position": asdict(position), "metrics": metrics or {}}
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        for name, obj in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    atomic_write_bytes(root / LATEST, (final.name + "\n").encode())
    if keep_last:
        for old in sorted(root.glob("step_*"))[:-keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


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


@dataclass
class TrainingState:
    """A checkpoint read back: model weights and everything needed to continue bit-for-bit."""

    path: Path
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    position: DataPosition
    metrics: dict[str, Any]


def load_checkpoint(path: str | Path) -> TrainingState:
    """Read a `step_N/` directory written by `save_checkpoint`."""
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
        state = torch.load(path / STATE, map_location="cpu", weights_only=True)
        weights = load_file(str(path / WEIGHTS))
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError([f"cannot read training checkpoint: {exc}"], path=str(path)) from None
    return TrainingState(
        path=path,
        weights=weights,
        optimizer=state["optimizer"],
        scheduler=state["scheduler"],
        rng=state["rng"],
        position=DataPosition(**meta["position"]),
        metrics=meta.get("metrics", {}),
    )


def restore_latest(
    root: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    cod_generator: torch.Generator,
    rank: int = 0,
    world_size: int = 1,
) -> TrainingState | None:
    """Load the newest checkpoint under `root` into the training objects: weights, optimizer, schedule and
    this rank's RNG streams. Returns it (its `position` says where to continue), or None when there is none."""
    latest = latest_checkpoint(root)
    if latest is None:
        return None
    state = load_checkpoint(latest)
    rngs = state.rng["ranks"]
    if len(rngs) != world_size:
        raise CheckpointError(
            [f"checkpoint was written by {len(rngs)} ranks, this run has {world_size}"], path=str(latest)
        )
    model.load_state_dict(state.weights)
    optimizer.load_state_dict(state.optimizer)
    scheduler.load_state_dict(state.scheduler)
    restore_rng(rngs[rank], cod_generator)
    return state
