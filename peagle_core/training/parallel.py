"""The drafter as the ranks train it: wrapped for distribution (`training.sharding`: DDP or FSDP2 under
torchrun) in the precision `training.precision` resolves to on this device, its forward compiled where
`training.compile` says."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.model.precision import resolve_precision
from peagle_core.spec import TrainingSpec
from peagle_core.training import sharding
from peagle_core.training.compiled_forward import CompiledForward, should_compile
from peagle_core.training.hooks import Hooks


@dataclass
class ParallelModel:
    """The drafter (`model`, sharded in place under FSDP) and what forward/backward run through."""

    model: PEagleDraftModel  # `sharding.full_model` gathers it whole
    train_module: torch.nn.Module  # the drafter, or its DDP wrapper
    precision: str  # what `training.precision` resolved to on this device
    autocast: Any  # bf16 autocast under precision bf16, None for fp32
    step_module: torch.nn.Module | None = None  # what forward/backward call: `train_module`, or compiled

    def __post_init__(self) -> None:
        if self.step_module is None:
            self.step_module = self.train_module

    @classmethod
    def wrap(
        cls, model: PEagleDraftModel, tc: TrainingSpec, device: torch.device, hooks: Hooks, steps: int = 0
    ) -> ParallelModel:
        """`model` in the spec's precision and sharding, compiled or not for a run of `steps` optimizer
        steps, announced. Build the optimizer after this: under FSDP its parameters are the shards."""
        precision = resolve_precision(tc.precision, device)
        hooks.event(
            "precision", f"training in {precision} (training.precision: {tc.precision})", precision=precision
        )
        train_module = sharding.wrap(model, tc.sharding, hooks.info, device, precision=precision)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else None
        compiled = should_compile(tc.compile, device, hooks.info.enabled, model.config.method, steps)
        hooks.event(
            "compile",
            f"drafter forward {'compiled' if compiled else 'eager'} (training.compile: {tc.compile}, "
            f"{steps} steps)",
            compiled=compiled,
        )
        step_module = CompiledForward(model) if compiled else train_module
        return cls(model, train_module, precision, autocast, step_module)

    @classmethod
    def single(cls, model: PEagleDraftModel, device: torch.device) -> ParallelModel:
        """`model` on one rank: bf16 autocast on CUDA, fp32 elsewhere (what benchmarks of one step use)."""
        bf16 = device.type == "cuda"
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else None
        return cls(model, model, "bf16" if bf16 else "fp32", autocast)
