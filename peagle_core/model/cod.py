"""Conditional drop-token (COD) sampling: which (anchor, depth) positions one training step predicts.

Depth 0 keeps every position; depth d keeps a geometrically shrinking random subset of the chains
alive at depth d-1 whose target (aligned index anchor + d) is a loss position of the same document.
"""

from __future__ import annotations

import math

import torch


def cod_depth_budget(
    n_anchor: int, depth: int, down_sample_ratio: float, down_sample_ratio_min: float
) -> int:
    """How many chains depth `depth` (>= 1) keeps: floor((n_anchor - d) * max(r**d, r_min))."""
    keep = max(down_sample_ratio**depth, down_sample_ratio_min)
    return max(0, math.floor((n_anchor - depth) * keep))


def _check_settings(num_depths: int, ratio: float, ratio_min: float, max_anchors: int | None) -> None:
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"down_sample_ratio must be in (0, 1], got {ratio}")
    if not (0.0 <= ratio_min <= 1.0):
        raise ValueError(f"down_sample_ratio_min must be in [0, 1], got {ratio_min}")
    if num_depths < 1:
        raise ValueError(f"num_depths must be >= 1, got {num_depths}")
    if max_anchors is not None and max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1 or None, got {max_anchors}")


def sample_cod_indices(
    seq_len: int,
    loss_mask: torch.Tensor,
    num_depths: int,
    down_sample_ratio: float = 0.7,
    down_sample_ratio_min: float = 0.2,
    max_anchors: int | None = None,
    generator: torch.Generator | None = None,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample nested COD chains over one aligned (packed) sequence.

    Returns `(anchor_pos, depth)`: two 1-D int64 tensors of equal length on CPU, grouped by depth
    ascending, anchors ascending within a depth. Depth 0 is every position 0..seq_len-1. A chain
    anchored at `a` survives to depth d only if `loss_mask[a+d] == 1` and (when `document_ids` is
    given) `a+d` lies in the same document as `a`. Deterministic for a seeded `generator`.
    """
    _check_settings(num_depths, down_sample_ratio, down_sample_ratio_min, max_anchors)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    mask = loss_mask.reshape(-1).detach().to("cpu")
    if mask.numel() != seq_len:
        raise ValueError(f"loss_mask has {mask.numel()} entries, expected seq_len={seq_len}")
    is_loss = mask != 0
    docs = None
    if document_ids is not None:
        docs = document_ids.reshape(-1).detach().to("cpu")
        if docs.numel() != seq_len:
            raise ValueError(f"document_ids has {docs.numel()} entries, expected seq_len={seq_len}")

    n_anchor = int(is_loss.sum())
    if max_anchors is not None:
        n_anchor = min(n_anchor, max_anchors)

    anchors = [torch.arange(seq_len, dtype=torch.long)]
    depths = [torch.zeros(seq_len, dtype=torch.long)]
    alive = anchors[0]
    for d in range(1, num_depths):
        target = alive + d
        inside = target < seq_len
        alive, target = alive[inside], target[inside]
        ok = is_loss[target]
        if docs is not None:
            ok &= docs[target] == docs[alive]
        survivors = alive[ok]
        budget = cod_depth_budget(n_anchor, d, down_sample_ratio, down_sample_ratio_min)
        if survivors.numel() > budget:
            pick = torch.randperm(survivors.numel(), generator=generator)[:budget]
            survivors = survivors[pick].sort().values
        if survivors.numel() == 0:
            break
        alive = survivors
        anchors.append(survivors)
        depths.append(torch.full_like(survivors, d))
    return torch.cat(anchors), torch.cat(depths)
