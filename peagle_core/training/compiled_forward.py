"""The drafter's training forward compiled by TorchInductor, and when a run compiles it (`training.compile`).

Inductor fuses what eager PyTorch runs as separate passes between the matmuls (RMSNorm, rotary, SwiGLU,
residual adds, autocast's casts) in the forward and in the backward it derives; the attention stays the
hand-fused kernels (`peagle_core.model.attention` keeps it out of the graph). Row counts change every step
(COD), so the graph is compiled with dynamic shapes, once per process (cached on disk after).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from peagle_core.model.loss import compile_enabled

log = logging.getLogger(__name__)

# Compiling costs ~25 s once; at SmolLM2's shape on 2 AMX cores it saves ~0.1 s a step (docs/decisions.md).
CPU_COMPILE_MIN_STEPS = 250


def should_compile(setting: str, device: torch.device, distributed: bool, method: str, steps: int) -> bool:
    """Whether this run trains through `CompiledForward`: `on` on one rank, `auto` on a CPU rank alone
    for a P-EAGLE run of at least `CPU_COMPILE_MIN_STEPS` steps, `off` (or PEAGLE_COMPILE=0) never."""
    if setting == "off" or distributed or not compile_enabled():
        return False
    if setting == "on":
        return True
    return device.type == "cpu" and method == "peagle" and steps >= CPU_COMPILE_MIN_STEPS


class CompiledForward(nn.Module):
    """Calls `drafter`'s forward compiled; `module` is the drafter itself (as DDP's wrapper names it), so
    the objective reads its config and lm_head through it. Falls back to the eager forward for good,
    logged once, if compiling fails (a machine without a C++ compiler)."""

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.module = drafter
        self._compiled = torch.compile(drafter.forward, dynamic=True)
        self._failed = False

    def forward(self, *args: Any) -> torch.Tensor:
        if not self._failed:
            try:
                return self._compiled(*args)
            except Exception:
                log.warning("compiling the drafter's forward failed; training eagerly", exc_info=True)
                self._failed = True
        return self.module(*args)
