"""Shared benchmark helpers: JSON-line output, a measured fp32 GEMM peak for MFU, and process memory."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from typing import Any

import psutil
import torch


def emit(**fields: Any) -> None:
    """Print one measurement as a single JSON object on its own stdout line."""
    print(json.dumps(fields), flush=True)


def gemm_peak_flops(n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best observed FLOP/s of an n x n matmul on this machine (the denominator of MFU)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm up the BLAS thread pool
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def rss_mb() -> float:
    """Current resident set size of this process, MiB."""
    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(args: list[str], timeout: float | None = None) -> list[dict[str, Any]]:
    """Run `python <args>` in a fresh process (so its peak RSS is its own); return its JSON stdout lines."""
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
