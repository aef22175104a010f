"""Row counts rounded up to a multiple of `ROW_BUCKET` on CPU, so oneDNN reuses its matmul kernels from step
to step instead of generating new ones.

oneDNN generates (JIT-compiles) a kernel for every matmul shape it meets and keeps the last 1,024. The
drafter's rows (depth 0 plus the COD rows), the loss's last chunk and each chunk's teacher rows change
count every step, so SmolLM2's step on real rows generated ~17 kernels a step, ~84 ms of 0.97 s
(docs/decisions.md). Padded to a multiple of 128, a few dozen shapes cover every step. GPUs keep exact
counts: cuBLAS generates nothing per shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_BUCKET = 128


def padded_rows(rows: int, device: torch.device) -> int:
    """`rows` rounded up to the bucket on CPU; unchanged elsewhere."""
    if device.type != "cpu":
        return rows
    return (rows + ROW_BUCKET - 1) // ROW_BUCKET * ROW_BUCKET


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` [n, ...] with zero rows appended up to `padded_rows(n)`: a copy on CPU, `x` itself elsewhere.
    No branch on the count, so a compiled graph with dynamic rows stays one graph."""
    if x.device.type != "cpu":
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, padded_rows(x.shape[0], x.device) - x.shape[0]))


def pad_index(index: torch.Tensor) -> torch.Tensor:
    """A 1-d index padded like `pad_rows` by repeating its last entry (rows gathered twice, never out of
    range); callers give the extra rows zero weight or drop them."""
    extra = padded_rows(index.shape[0], index.device) - index.shape[0]
    if extra == 0:
        return index
    return torch.cat([index, index[-1:].expand(extra)])
