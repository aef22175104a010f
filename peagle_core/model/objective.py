"""The training objective: which rows a step trains (COD sampling, or every position at every EAGLE-3
training-time-test step; sequence segments) and how they score.

The drafter only maps rows to hidden states. This module samples the rows of a packed batch, runs the
drafter on them, and distils the teacher (the verifier's frozen final norm and lm_head rows over the
draft vocabulary) into the drafter's lm_head with the fused KL loss, weighted over depths as the
`Objective` says. Batches are packed to batch size 1: every field is [1, T] (docs/interfaces.md, Token alignment).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from peagle_core.model.attention import run_starts
from peagle_core.model.cod import sample_cod_indices
from peagle_core.model.config import DrafterSettings
from peagle_core.model.eagle3 import ttt_rows
from peagle_core.model.loss import fused_kl_loss

Rows = tuple[torch.Tensor, torch.Tensor]  # (anchor_pos, depth), grouped by depth, anchors ascending
DepthWeights = Literal["count", "equal"] | Sequence[float]


@dataclass(frozen=True)
class Objective:
    """How a batch's rows score (`training.depth_weights`, `tv_weight`, `in_vocab_targets_only`).

    depth_weights: `count` is the mean over all loss rows, so each depth weighs as many rows as COD gave it
    (the reference's); `equal` is the mean over depths of each depth's mean; [w0, ...] gives depth d the
    share w_d / sum(w) of the batch's loss (over the depths that have rows).
    tv_weight: adds tv_weight * TV(teacher, drafter) to each row's KL (acceptance-aimed).
    in_vocab_targets_only: drops rows whose teacher top-1 over the verifier's whole vocabulary lies
    outside the draft vocabulary (no draft can be accepted there); needs a teacher with `full_lm_head`.
    """

    depth_weights: DepthWeights = "count"
    tv_weight: float = 0.0
    in_vocab_targets_only: bool = False

    def row_weights(self, counts: torch.Tensor, row_depth: torch.Tensor) -> torch.Tensor:
        """The weight of each row at depth `row_depth`, given the batch's loss-row `counts` per depth;
        the weights of all the batch's rows sum to 1 (0 when it has none)."""
        present = counts > 0
        if self.depth_weights == "count":
            return torch.full_like(row_depth, 1.0, dtype=torch.float32) / counts.sum().clamp_min(1)
        if self.depth_weights == "equal":
            share = present.float()
        else:
            share = torch.tensor(list(self.depth_weights), dtype=torch.float32, device=counts.device)
            if share.numel() != counts.numel():
                raise ValueError(f"depth_weights has {share.numel()} entries for {counts.numel()} depths")
            share = share * present
        share = share / share.sum().clamp_min(1e-12)
        return (share / counts.clamp_min(1).float())[row_depth]


class Teacher(nn.Module):
    """The verifier's frozen final RMSNorm and its lm_head rows over the draft vocabulary.

    It defines the distribution the drafter learns; it is not part of the drafter's checkpoint.
    """

    def __init__(
        self,
        norm_weight: torch.Tensor,
        norm_eps: float,
        lm_head: torch.Tensor,
        full_lm_head: torch.Tensor | None = None,
        verifier_ids: torch.Tensor | None = None,
    ):
        super().__init__()
        self.register_buffer("norm_weight", norm_weight.detach().float().clone())
        self.register_buffer("lm_head", lm_head.detach().float().clone())
        self.norm_eps = float(norm_eps)
        # The whole vocabulary's rows, kept only where the objective asks where the teacher's top-1 lies.
        in_draft = None
        if full_lm_head is not None:
            if verifier_ids is None:
                raise ValueError("a teacher with full_lm_head needs the draft vocabulary's verifier_ids")
            in_draft = torch.zeros(full_lm_head.shape[0], dtype=torch.bool)
            in_draft[verifier_ids.cpu()] = True
            full_lm_head = full_lm_head.detach().float().clone()
        self.register_buffer("full_lm_head", full_lm_head)
        self.register_buffer("in_draft_vocab", in_draft)

    @classmethod
    def from_verifier(
        cls,
        final_norm: nn.Module,
        lm_head_weight: torch.Tensor,
        verifier_ids: torch.Tensor,
        *,
        keep_full_lm_head: bool = False,
    ) -> Teacher:
        """Copy the verifier's final norm and the lm_head rows `verifier_ids` (the draft vocabulary), and
        the whole lm_head with `keep_full_lm_head` (for `Objective.in_vocab_targets_only`)."""
        weight = getattr(final_norm, "weight", None)
        if weight is None:
            raise ValueError("the verifier's final norm has no 'weight'")
        eps = getattr(final_norm, "variance_epsilon", None) or getattr(final_norm, "eps", None)
        if eps is None:  # torch.nn.RMSNorm(eps=None) uses the dtype's machine epsilon
            eps = torch.finfo(torch.float32).eps
        rows = lm_head_weight.detach()[verifier_ids.to(lm_head_weight.device)]
        full = lm_head_weight if keep_full_lm_head else None
        return cls(weight, eps, rows, full, verifier_ids if keep_full_lm_head else None)

    def forward(self, last_hidden_states: torch.Tensor) -> torch.Tensor:
        """The verifier's final norm of its last hidden states [T, H]; `lm_head` rows turn them into logits."""
        x = last_hidden_states.float()
        return (F.rms_norm(x, (x.shape[-1],), eps=self.norm_eps) * self.norm_weight).to(
            self.norm_weight.dtype
        )

    def top1_in_draft_vocab(self, normed: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
        """[T] whether the verifier's greedy token over its whole vocabulary, from normed last hidden
        states [T, H], is in the draft vocabulary (chunked: [chunk, V] logits at a time)."""
        if self.full_lm_head is None:
            raise ValueError(
                "this teacher keeps no full lm_head (Teacher.from_verifier(keep_full_lm_head=True))"
            )
        top1 = (
            torch.cat([(c @ self.full_lm_head.T.to(c.dtype)).argmax(-1) for c in normed.split(chunk_rows)])
            if normed.shape[0]
            else torch.zeros(0, dtype=torch.long, device=normed.device)
        )
        return self.in_draft_vocab[top1]


@dataclass
class LossOutput:
    """`loss` (scalar, differentiable) and `metrics` (0-dim tensors, no host sync): loss, acc_{d}, positions_{d}."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def unwrap(model: nn.Module) -> nn.Module:
    """The drafter itself, also when DDP wraps it."""
    return getattr(model, "module", model)


def loss_positions(batch: Any) -> torch.Tensor:
    """[T] 1 where the aligned position is a loss target, 0 elsewhere (padding never is)."""
    return batch.loss_mask[0].to(torch.long) * (batch.document_ids[0] >= 0)


def sample_rows(settings: DrafterSettings, batch: Any, generator: torch.Generator | None = None) -> Rows:
    """COD rows of one packed batch: every position at depth 0, shrinking random chains deeper, chains
    stopping at document ends (deterministic for a seeded `generator`; on CPU). EAGLE-3: every chain to
    `ttt_steps` (`peagle_core.model.eagle3.ttt_rows`)."""
    if settings.method == "eagle3":
        return ttt_rows(batch.input_ids.shape[1], batch.document_ids[0].cpu(), settings.row_depths)
    return sample_cod_indices(
        batch.input_ids.shape[1],
        loss_positions(batch),
        settings.num_depths,
        settings.down_sample_ratio,
        settings.down_sample_ratio_min,
        settings.max_anchors,
        generator=generator,
        document_ids=batch.document_ids[0],
    )


def segment_bounds(seq_len: int, s: int, num_segments: int) -> tuple[int, int]:
    """The anchor range [lo, hi) of segment s of `num_segments` contiguous ranges."""
    if not 0 <= s < num_segments:
        raise ValueError(f"segment index {s} outside 0..{num_segments - 1}")
    return s * seq_len // num_segments, (s + 1) * seq_len // num_segments


def segment_rows(rows: Rows, document_ids: torch.Tensor, s: int, num_segments: int) -> Rows:
    """Rows of segment s: its deeper rows, plus depth-0 rows from its first anchor's document start
    (the keys its queries attend to, recomputed with grad) up to its end."""
    anchor_pos, depth = rows
    lo, hi = segment_bounds(document_ids.numel(), s, num_segments)
    first = int(run_starts(document_ids)[lo]) if lo < hi else hi
    keep = torch.where(
        depth == 0, (anchor_pos >= first) & (anchor_pos < hi), (anchor_pos >= lo) & (anchor_pos < hi)
    )
    return anchor_pos[keep], depth[keep]


def _is_loss_target(loss_mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Rows whose target lies inside the sequence on a loss position (rows past the end never count)."""
    inside = target < loss_mask.numel()
    return inside & (loss_mask[target.clamp_max(loss_mask.numel() - 1)] == 1)


def distillation_loss(
    model: nn.Module,
    teacher: Teacher,
    batch: Any,
    rows: Rows,
    segment: tuple[int, int] | None = None,
    objective: Objective | None = None,
) -> LossOutput:
    """KL(teacher ‖ drafter) over the loss rows among `rows`, weighted over depths by `objective`
    (default: `Objective()`, the mean over every loss row).

    `model` is the drafter (or its DDP wrapper). `segment=(s, S)` runs only the anchors of the s-th of S
    ranges, weighted by the whole batch's per-depth counts, so the S segment losses and metrics sum to
    the unpartitioned ones. Accuracy: the drafter's argmax equals the teacher's, over the loss rows.
    """
    objective = objective or Objective()
    if batch.input_ids.shape[0] != 1:
        raise ValueError(f"training batches are packed to batch size 1, got {batch.input_ids.shape[0]}")
    drafter = unwrap(model)
    num_depths = drafter.config.row_depths
    docs = batch.document_ids[0].to(torch.long)
    loss_mask = loss_positions(batch)
    teacher_rows = teacher(batch.verifier_last_hidden_states[0])
    if objective.in_vocab_targets_only:
        loss_mask = _in_vocab_targets(loss_mask, teacher, teacher_rows)
    device = batch.input_ids.device
    anchor_pos, depth = rows[0].to(device), rows[1].to(device)
    counts = torch.bincount(depth[_is_loss_target(loss_mask, anchor_pos + depth)], minlength=num_depths)

    if segment is not None:
        anchor_pos, depth = segment_rows((anchor_pos, depth), docs, *segment)
        lo, hi = segment_bounds(docs.numel(), *segment)
        in_segment = (anchor_pos >= lo) & (anchor_pos < hi)
    else:
        in_segment = torch.ones_like(anchor_pos, dtype=torch.bool)
    if anchor_pos.numel() == 0:  # an empty segment contributes nothing
        return _empty_loss(drafter.lm_head.weight, num_depths)

    hidden = model(
        batch.hidden_states[0],
        batch.input_ids[0],
        batch.position_ids[0].to(torch.long),
        docs,
        anchor_pos,
        depth,
    )
    target = anchor_pos + depth
    loss_rows = torch.nonzero(in_segment & _is_loss_target(loss_mask, target)).flatten()
    row_depth = depth[loss_rows]
    result = fused_kl_loss(
        hidden,
        drafter.lm_head.weight,
        teacher_rows,
        teacher.lm_head,
        target[loss_rows],
        objective.row_weights(counts, row_depth),
        tv_weight=objective.tv_weight,
        hidden_rows=loss_rows,
    )
    return LossOutput(result.loss, _depth_metrics(result.loss, result.correct, row_depth, counts, num_depths))


def _in_vocab_targets(loss_mask: torch.Tensor, teacher: Teacher, teacher_rows: torch.Tensor) -> torch.Tensor:
    """`loss_mask` without the positions whose greedy token the drafter's vocabulary lacks: they teach
    nothing a draft can win."""
    where = torch.nonzero(loss_mask).flatten()
    keep = torch.zeros_like(loss_mask)
    keep[where] = teacher.top1_in_draft_vocab(teacher_rows[where]).to(loss_mask.dtype)
    return keep


def _empty_loss(lm_head_weight: torch.Tensor, num_depths: int) -> LossOutput:
    # Zero, yet part of the graph: backward runs on it as on any segment's loss.
    zero = lm_head_weight.sum() * 0.0
    names = ["loss"] + [f"{m}_{d}" for m in ("acc", "positions") for d in range(num_depths)]
    return LossOutput(zero, {name: zero.detach() for name in names})


def _depth_metrics(
    loss: torch.Tensor, correct: torch.Tensor, row_depth: torch.Tensor, counts: torch.Tensor, num_depths: int
) -> dict[str, torch.Tensor]:
    """The loss, and per depth the accuracy (over the whole batch's `counts`) and this segment's positions."""
    metrics: dict[str, torch.Tensor] = {"loss": loss.detach()}
    seg_counts = torch.bincount(row_depth, minlength=num_depths)
    seg_correct = torch.bincount(row_depth, weights=correct.float(), minlength=num_depths)
    for d in range(num_depths):
        metrics[f"acc_{d}"] = seg_correct[d] / counts[d].clamp_min(1)
        metrics[f"positions_{d}"] = seg_counts[d]
    return metrics
