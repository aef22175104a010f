"""Learning-rate schedule: linear warmup, then cosine decay to `min_lr_ratio` of the peak."""

from __future__ import annotations

import math

import torch

from peagle_core.spec import TrainingSpec


def cosine_with_warmup(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following `cosine_with_warmup`; its state_dict resumes exactly."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: cosine_with_warmup(
            step, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
        ),
    )


def scheduler_for(
    optimizer: torch.optim.Optimizer, tc: TrainingSpec, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The spec's schedule over `total_steps`: warmup for `training.warmup_ratio` of them, then the decay."""
    warmup_steps = math.ceil(tc.warmup_ratio * total_steps)
    return build_scheduler(
        optimizer, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=tc.min_lr_ratio
    )
