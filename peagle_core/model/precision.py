"""Training precision (`training.precision`): which devices have fast bf16, and the autocast a step runs under.

Master weights, optimizer state, the loss and its reductions stay fp32 in every precision; `bf16` runs
the matmuls (and what autocast puts on its bf16 list) in bf16.
"""

from __future__ import annotations

import contextlib
from functools import cache
from pathlib import Path
from typing import Any, Literal

import torch

Precision = Literal["fp32", "bf16"]

# CPU flags of instructions that make a bf16 matmul faster than fp32 (measured on this project's
# machines: AMX-BF16 5.7x, AVX512-BF16 without AMX 2.4x); without them oneDNN emulates bf16, slower.
FAST_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls beat fp32 on `device`: CUDA, or a CPU with AMX-BF16 or AVX512-BF16."""
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        return any(flag in cpu_flags() for flag in FAST_BF16_FLAGS)
    return False


def has_amx(device: torch.device) -> bool:
    """A CPU with AMX tiles: there even attention's bf16 flash kernel beats fp32 (without AMX it does not)."""
    return device.type == "cpu" and "amx_bf16" in cpu_flags()


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """`auto` -> bf16 where the device has fast bf16, else fp32; `fp32` and `bf16` as given."""
    if requested == "auto":
        return "bf16" if has_fast_bf16(device) else "fp32"
    if requested not in ("fp32", "bf16"):
        raise ValueError(f"unknown precision {requested!r}; use auto, fp32 or bf16")
    return requested  # type: ignore[return-value]


def vllm_dtype(spec_dtype: str, device: torch.device | str) -> str:
    """The dtype vLLM runs the verifier in for hidden states and regeneration: `auto` is bf16 where the
    device has fast bf16 (vLLM decodes SmolLM2 1.6x faster in bf16 on an AVX512-BF16 CPU), else fp32."""
    if spec_dtype == "auto":
        return "bfloat16" if has_fast_bf16(torch.device(device)) else "float32"
    return spec_dtype


def autocast_for(precision: Precision, device: torch.device) -> Any:
    """The context a step's forward and loss run under: bf16 autocast, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
