"""Distillation loss: KL(verifier ‖ drafter) over the draft vocabulary, fused with the lm_head and chunked.

Neither the drafter's nor the teacher's [N, V] logits are ever held whole: each chunk of rows computes
both distributions, the loss and its gradients (w.r.t. the hidden rows and the lm_head weight), then
drops the logits. Teacher logits are computed once per distinct target position, not once per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Bytes of one [rows, V] fp32 buffer per chunk; a chunk holds a handful of these.
_CHUNK_LOGIT_BYTES = 32 * 2**20


@dataclass
class KLResult:
    """`loss` = sum_i weight_i * KL_i (differentiable); `kl` per row and `correct` (draft argmax ==
    teacher argmax) per row are detached, for metrics."""

    loss: torch.Tensor
    kl: torch.Tensor
    correct: torch.Tensor


class _FusedLinearKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, target_index, row_weight, chunk_rows):
        n = hidden.shape[0]
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        kl = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        correct = torch.zeros(n, dtype=torch.bool, device=hidden.device)
        # Rows sorted by target so a chunk shares teacher rows: the teacher runs once per target.
        order = torch.argsort(target_index, stable=True)
        for c0 in range(0, n, chunk_rows):
            rows = order[c0 : c0 + chunk_rows]
            uniq, inverse = torch.unique_consecutive(target_index[rows], return_inverse=True)
            with torch.no_grad():
                teacher_logp = F.log_softmax((teacher_hidden[uniq] @ teacher_weight.T).float(), dim=-1)
            teacher_logp = teacher_logp[inverse]
            h = hidden[rows]
            logits = (h @ weight.T).float()
            logq = F.log_softmax(logits, dim=-1)
            p = teacher_logp.exp()
            kl[rows] = (p * (teacher_logp - logq)).sum(-1)
            correct[rows] = logits.argmax(-1) == teacher_logp.argmax(-1)
            grad_logits = (logq.exp() - p) * row_weight[rows, None]
            # Under autocast the matmul comes back in bf16; the accumulators stay fp32.
            grad_hidden[rows] = (grad_logits @ weight.float()).to(grad_hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h.float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(kl, correct)
        loss = (kl * row_weight).sum()
        return loss, kl, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl, _grad_correct):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        gh = (grad_hidden * grad_loss).to(hidden_dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_weight * grad_loss).to(weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None, None, None


def fused_kl_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target_index: torch.Tensor,
    row_weight: torch.Tensor,
) -> KLResult:
    """KL(teacher ‖ draft) per row, weighted and summed.

    hidden [n, H]: the drafter's final-normed rows; lm_head_weight [Vd, H];
    teacher_hidden [T, H]: verifier last hidden states after the verifier's final norm;
    teacher_weight [Vd, H]: the verifier lm_head restricted to the draft vocabulary;
    target_index [n]: which teacher row each drafter row is compared with; row_weight [n].
    """
    vocab = lm_head_weight.shape[0]
    chunk_rows = max(16, _CHUNK_LOGIT_BYTES // (4 * vocab))
    loss, kl, correct = _FusedLinearKL.apply(
        hidden, lm_head_weight, teacher_hidden, teacher_weight, target_index, row_weight.float(), chunk_rows
    )
    return KLResult(loss=loss, kl=kl, correct=correct)


def reference_kl_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target_index: torch.Tensor,
    row_weight: torch.Tensor,
) -> torch.Tensor:
    """Unfused, unchunked version of `fused_kl_loss` (materialises [n, V]); for tests only."""
    teacher_logp = F.log_softmax(teacher_hidden[target_index] @ teacher_weight.T, dim=-1)
    logq = F.log_softmax(hidden @ lm_head_weight.T, dim=-1)
    kl = F.kl_div(logq, teacher_logp, log_target=True, reduction="none").sum(-1)
    return (kl * row_weight).sum()
