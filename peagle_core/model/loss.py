"""Distillation loss: KL(verifier ‖ drafter) over the draft vocabulary, plus an optional total-variation
term aimed at acceptance, fused with the lm_head and chunked.

Neither the drafter's nor the teacher's [N, V] logits are ever held whole: each chunk of rows computes
both distributions, the loss and its gradients (w.r.t. the hidden rows and the lm_head weight), then
drops the logits. Teacher logits are computed once per distinct target position, not once per row.

Per chunk, everything between the matmuls (softmax statistics, KL, argmax, the logits' gradient) is two
row-wise kernels over the [rows, V] logits. On CPU they run as C++ (`kl_rows_native`: one pass per row),
or compiled by TorchInductor where that does not build (a few passes over the chunk; eager PyTorch makes
about a dozen, which cost as much as the matmuls); the same functions run eagerly where compiling is off
or fails. The matmuls run in `compute_dtype`
(bf16 under autocast); statistics, the loss and the gradient accumulators are fp32.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from peagle_core.model.kl_rows_native import native_row_kernels
from peagle_core.model.row_buckets import ROW_BUCKET, pad_index

log = logging.getLogger(__name__)

# Bytes of one [rows, V] fp32 buffer per chunk; a chunk holds a handful of these.
_CHUNK_LOGIT_BYTES = 32 * 2**20


@dataclass
class KLResult:
    """`loss` = sum_i weight_i * (KL_i + tv_weight * TV_i) (differentiable); `kl` (that row
    loss) and `correct` (draft argmax == teacher argmax) per row are detached, for metrics."""

    loss: torch.Tensor
    kl: torch.Tensor
    correct: torch.Tensor


def teacher_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher rows [u, V] -> (p fp32 [u, V], sum_v p log p [u], argmax [u])."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    return p, (p * logp).sum(-1), logp.argmax(-1)


def draft_stats(
    logits: torch.Tensor,
    p: torch.Tensor,
    neg_entropy: torch.Tensor,
    inverse: torch.Tensor,
    row_weight: torch.Tensor,
    grad_dtype: torch.dtype,
    tv_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drafter rows [c, V] against teacher rows `p[inverse]` -> (the row loss [c], argmax [c], the weighted
    gradient of the loss w.r.t. the logits, in `grad_dtype`).

    The row loss is KL(p ‖ q) + tv_weight * TV(p, q), TV = 1/2 sum_v |q_v - p_v| (1 - TV is the chance
    that a sampled draft token is accepted). Gradients w.r.t. the logits z: KL gives q - p; TV gives
    1/2 q_j (s_j - sum_v s_v q_v), s = sign(q - p).
    """
    logq = torch.log_softmax(logits.float(), dim=-1)
    q = logq.exp()
    pe = p[inverse]
    loss = neg_entropy[inverse] - (pe * logq).sum(-1)
    grad = q - pe
    if tv_weight:
        sign = torch.sign(q - pe)
        loss = loss + tv_weight * 0.5 * (q - pe).abs().sum(-1)
        grad = grad + (0.5 * tv_weight) * q * (sign - (sign * q).sum(-1, keepdim=True))
    return loss, logq.argmax(-1), (grad * row_weight[:, None]).to(grad_dtype)


def transposed_cast(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor]:
    """[V, H] -> its [H, V] transpose in `dtype`, contiguous (eager: ~3.5 ms at [8192, 576] on 2 AMX
    cores; compiled: ~0.7)."""
    return (weight.T.to(dtype).contiguous(),)


def accumulate(total: torch.Tensor, part: torch.Tensor) -> tuple[torch.Tensor]:
    """Adds `part` to `total` in place, in `total`'s dtype (the fp32 sum of a gradient's bf16 chunk
    products; eager casts, then adds: ~1.2 ms per [576, 8192] chunk on 2 AMX cores, ~0.5 compiled)."""
    total.add_(part.to(total.dtype))
    return (total,)


def gather_rows(
    x: torch.Tensor, index: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `index` of `x` in `dtype`, and their transpose, contiguous (the matmuls' two layouts)."""
    rows = x[index].to(dtype)
    return rows, rows.T.contiguous()


def put_rows(dest: torch.Tensor, index: torch.Tensor, part: torch.Tensor) -> tuple[torch.Tensor]:
    """Writes `part` [c, H] (a transposed view, as the matmul leaves it) into rows `index` of `dest` [n, H],
    in `dest`'s dtype."""
    dest.index_copy_(0, index, part.to(dest.dtype))
    return (dest,)


Kernels = tuple[Callable[..., tuple[torch.Tensor, ...]], ...]  # the functions above, compiled or not
EAGER_KERNELS: Kernels = (teacher_stats, draft_stats, transposed_cast, accumulate, gather_rows, put_rows)
_compile_failed = False


def compile_enabled() -> bool:
    """Compiled loss kernels unless PEAGLE_COMPILE=0 (debugging, or a machine without a C++ compiler)."""
    return os.environ.get("PEAGLE_COMPILE", "1") != "0" and not _compile_failed


def _rows_dynamic(kernel: Callable[..., tuple[torch.Tensor, ...]]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """`kernel` compiled with the row count dynamic and the vocabulary static: one graph for every chunk
    and teacher-row count, one per vocabulary size. A static vocabulary lets Inductor vectorise the row
    reductions: 3x faster than `dynamic=True` at SmolLM2's [1024, 8192] chunk in bf16 on AMX (25.5 -> 8.4
    ms for the draft kernel; docs/decisions.md)."""
    compiled = torch.compile(kernel, dynamic=None)

    def run(*args: object) -> tuple[torch.Tensor, ...]:
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return compiled(*args)

    return run


@cache
def _compiled_kernels() -> Kernels:
    compiled = tuple(_rows_dynamic(kernel) for kernel in EAGER_KERNELS)
    native = native_row_kernels()
    if native is None:
        return compiled
    native_teacher, native_draft = native

    def draft(*args: object) -> tuple[torch.Tensor, ...]:
        *stats_args, tv_weight = args
        if tv_weight:  # the TV term has no C++ kernel
            return compiled[1](*args)
        return native_draft(*stats_args)

    return (native_teacher, draft, *compiled[2:])


def loss_kernels(device: torch.device) -> Kernels:
    """The row kernels and helpers for `device`: compiled on CPU (see the module docstring), eager elsewhere.

    CUDA keeps eager kernels: its chunks are bandwidth-cheap next to its matmuls, and a compiled
    variant there has not been measured on a GPU yet.
    """
    if device.type == "cpu" and compile_enabled():
        return _compiled_kernels()
    return EAGER_KERNELS


def _run_kernel(kernels: Kernels, index: int, *args: object) -> tuple[torch.Tensor, ...]:
    """Call a compiled kernel, falling back to eager for good (logged once) if compiling fails."""
    global _compile_failed
    try:
        return kernels[index](*args)
    except Exception:
        if kernels[index] is EAGER_KERNELS[index]:
            raise
        log.warning("compiling the loss kernels failed; using eager kernels", exc_info=True)
        _compile_failed = True
        return EAGER_KERNELS[index](*args)


class _FusedLinearKL(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        teacher_hidden,
        teacher_weight,
        target_index,
        row_weight,
        hidden_rows,
        chunk_rows,
        compute_dtype,
        tv_weight,
    ):
        n = target_index.shape[0]
        kernels = loss_kernels(hidden.device)
        # One cast-and-transpose of the weight serves both of its matmuls. The gradient matmuls reduce
        # over the vocabulary (grad_hidden) and over the rows (grad_weight); oneDNN runs both about 2x
        # faster with the [H, *] operand on the left than in the textbook layout (bf16 on AMX at
        # [1024, 8192] x [8192, 576]: 7.6 -> 4.3 ms and 6.3 -> 3.5 ms), so the weight's gradient is
        # accumulated transposed.
        (w_t,) = _run_kernel(kernels, 2, weight.detach(), compute_dtype)
        tw_t = teacher_weight.detach().T.to(compute_dtype)
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32)
        grad_weight_t = (
            torch.zeros(weight.shape[::-1], dtype=torch.float32, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        kl = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        correct = torch.zeros(n, dtype=torch.bool, device=hidden.device)
        # Rows sorted by target so a chunk shares teacher rows: the teacher runs once per target.
        order = torch.argsort(target_index, stable=True)
        source = order if hidden_rows is None else hidden_rows[order]
        for c0 in range(0, n, chunk_rows):
            rows, src = order[c0 : c0 + chunk_rows], source[c0 : c0 + chunk_rows]
            uniq, inverse = torch.unique_consecutive(target_index[rows], return_inverse=True)
            # The teacher's and the last chunk's row counts change every step: their matmuls run on
            # bucketed counts (row_buckets), the extra rows repeated, then dropped or given zero weight.
            p, neg_entropy, teacher_argmax = _run_kernel(
                kernels, 0, (teacher_hidden[pad_index(uniq)].detach().to(compute_dtype) @ tw_t)[: len(uniq)]
            )
            c, src_p, inverse_p = len(rows), pad_index(src), pad_index(inverse)
            weight = F.pad(row_weight[rows], (0, len(src_p) - c))
            h, h_t = _run_kernel(kernels, 4, hidden.detach(), src_p, compute_dtype)
            kl_c, argmax_c, grad_logits = _run_kernel(
                kernels, 1, h @ w_t, p, neg_entropy, inverse_p, weight, compute_dtype, tv_weight
            )
            kl[rows] = kl_c[:c]
            correct[rows] = argmax_c[:c] == teacher_argmax[inverse]
            _run_kernel(kernels, 5, grad_hidden, src, (w_t @ grad_logits.T).T[:c])
            if grad_weight_t is not None:
                (grad_weight_t,) = _run_kernel(kernels, 3, grad_weight_t, h_t @ grad_logits)
        # Contiguous like the weight: autograd would otherwise copy a transposed gradient to the weight's
        # layout in eager (~10 ms at [8192, 576]).
        grad_weight = (
            _run_kernel(kernels, 2, grad_weight_t, torch.float32)[0] if grad_weight_t is not None else None
        )
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
        return gh, gw, None, None, None, None, None, None, None, None


def fused_kl_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target_index: torch.Tensor,
    row_weight: torch.Tensor,
    tv_weight: float = 0.0,
    hidden_rows: torch.Tensor | None = None,
) -> KLResult:
    """KL(teacher ‖ draft) (+ tv_weight * TV) per row, weighted and summed.

    hidden [n, H]: the drafter's final-normed rows, or with `hidden_rows` [m] the rows among hidden's
    that score (gathered chunk by chunk: no [m, H] copy, and no scatter in its backward);
    lm_head_weight [Vd, H];
    teacher_hidden [T, H]: verifier last hidden states after the verifier's final norm;
    teacher_weight [Vd, H]: the verifier lm_head restricted to the draft vocabulary;
    target_index [n] (or [m]): which teacher row each scored row is compared with; row_weight likewise.
    The matmuls run in the autocast dtype when autocast is on for the rows' device, else in fp32.
    """
    vocab = lm_head_weight.shape[0]
    chunk_rows = max(16, _CHUNK_LOGIT_BYTES // (4 * vocab))
    if chunk_rows >= ROW_BUCKET:  # whole chunks need no padding on CPU (row_buckets)
        chunk_rows -= chunk_rows % ROW_BUCKET
    device_type = hidden.device.type
    compute_dtype = (
        torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else torch.float32
    )
    with torch.autocast(device_type, enabled=False):
        loss, kl, correct = _FusedLinearKL.apply(
            hidden,
            lm_head_weight,
            teacher_hidden,
            teacher_weight,
            target_index,
            row_weight.float(),
            hidden_rows,
            chunk_rows,
            compute_dtype,
            float(tv_weight),
        )
    return KLResult(loss=loss, kl=kl, correct=correct)


def reference_kl_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target_index: torch.Tensor,
    row_weight: torch.Tensor,
    tv_weight: float = 0.0,
) -> torch.Tensor:
    """Unfused, unchunked version of `fused_kl_loss` (materialises [n, V]; autograd differentiates the
    TV term itself); for tests only."""
    teacher_logp = F.log_softmax(teacher_hidden[target_index] @ teacher_weight.T, dim=-1)
    logq = F.log_softmax(hidden @ lm_head_weight.T, dim=-1)
    kl = F.kl_div(logq, teacher_logp, log_target=True, reduction="none").sum(-1)
    tv = 0.5 * (logq.exp() - teacher_logp.exp()).abs().sum(-1)
    return ((kl + tv_weight * tv) * row_weight).sum()
