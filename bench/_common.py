"""Shared benchmark helpers: JSON-line output, child processes, free ports, a measured GEMM peak and model
FLOP counts for MFU, and process memory. Imports nothing heavy at the top, so every script's --help is fast."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import peagle_core  # noqa: F401  (sets the allocator's huge pages before torch allocates)
from worker.rendezvous import free_port  # noqa: F401  (the benches' too)

if TYPE_CHECKING:
    import torch


def emit(**fields: Any) -> None:
    """Print one measurement as a single JSON object on its own stdout line."""
    print(json.dumps(fields), flush=True)


def gemm_peak_flops(
    n: int = 2048,
    repeats: int = 5,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    min_seconds: float = 1.0,
) -> float:
    """Best observed FLOP/s of an n x n matmul on `device` in `dtype` (fp32 by default): the denominator
    of MFU. At least `repeats` samples, and more until `min_seconds` have passed: five AMX samples span
    35 ms, and one disturbance that long halved a run's peak (and doubled its MFU)."""
    import torch

    dtype = dtype or torch.float32
    device = torch.device(device)
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    a @ b  # warm up the BLAS thread pool / cuBLAS handle
    best, samples, start = float("inf"), 0, time.perf_counter()
    while samples < repeats or time.perf_counter() - start < min_seconds:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
        samples += 1
    return 2 * n**3 / best


def trunk_flops_per_row(cfg: Any) -> int:
    """Forward matmul FLOPs of one drafter row through fc and the decoder layers (attention scores aside)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    flops = 2 * 3 * h * h  # fc
    for layer in range(cfg.num_layers):
        d_in = 2 * h if layer == 0 else h
        flops += 2 * d_in * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * i
    return flops


def drafter_step_flops(cfg: Any, seq_len: int, positions: list[int]) -> int:
    """Model FLOPs of one training step over a packed row: trunk and drafter lm_head forward + backward
    (3x), the frozen teacher head forward only. `positions[d]` counts the loss rows at depth d."""
    rows = seq_len + sum(positions[1:])  # depth 0 covers every position; deeper rows are loss rows
    head = 2 * cfg.hidden_size * cfg.draft_vocab_size
    return 3 * rows * trunk_flops_per_row(cfg) + sum(positions) * (3 * head + head)


def llama_forward_flops(cfg: Any, lengths: list[int], lm_head: bool = False) -> int:
    """Forward FLOPs of a Llama-shaped HF model over sequences of `lengths`: the matmuls of every layer,
    causal attention scores and values, and the lm_head when asked."""
    h, i, n_layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    per_token = n_layers * (2 * h * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * i)
    if lm_head:
        per_token += 2 * h * cfg.vocab_size
    tokens = sum(lengths)
    # QK^T and PV: 2 * 2 * q per visible key; a causal row sees on average (T + 1) / 2 keys.
    attention = n_layers * sum(4 * q * t * (t + 1) // 2 for t in lengths)
    return per_token * tokens + attention


def rss_mb() -> float:
    """Current resident set size of this process, MiB."""
    import psutil

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
