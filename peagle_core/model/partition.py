"""Sequence partitioning for long contexts: one packed sequence's COD rows trained in S anchor segments.

COD is sampled once; each segment runs forward + backward on its own rows (recomputing, with grad, the
depth-0 keys its queries need) so only one segment's activations are alive at a time. Loss weights use
the whole sequence's per-depth counts, so the accumulated gradient equals the unpartitioned step's.
"""

from __future__ import annotations

from typing import Any

import torch

from peagle_core.model.objective import Objective, Teacher, distillation_loss, sample_rows, unwrap


def partitioned_backward(
    model: torch.nn.Module,
    teacher: Teacher,
    batch: Any,
    num_segments: int,
    generator: torch.Generator | None = None,
    scale: float = 1.0,
    objective: Objective | None = None,
) -> dict[str, torch.Tensor]:
    """Forward + backward of one packed batch in `num_segments` segments; gradients accumulate in
    `.grad` (scaled by `scale`). Returns the batch's metrics summed over segments (loss, acc_{d},
    positions_{d} as for one unpartitioned pass)."""
    if num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    rows = sample_rows(unwrap(model).config, batch, generator)
    segments = min(num_segments, batch.input_ids.shape[1])
    totals: dict[str, torch.Tensor] = {}
    for s in range(segments):
        segment = (s, segments) if segments > 1 else None
        out = distillation_loss(model, teacher, batch, rows, segment=segment, objective=objective)
        (out.loss * scale).backward()
        for key, value in out.metrics.items():
            totals[key] = totals.get(key, 0) + value.detach()
    return totals
