"""The loss's teacher and drafter row kernels in C++ for CPU (`csrc/kl_rows.cpp`, built by `cpp_kernels`);
where that build fails, the loss keeps its compiled kernels.

Inductor's versions of the same functions make a pass over the whole [rows, V] chunk per reduction and
take two exps per logit; these take one pass per row, the row in cache, and one exp: at SmolLM2's [1024,
8192] bf16 chunk on 2 AMX cores the teacher's kernel runs 1.1 ms against 4.4 and the drafter's 2.6 against
8.6 (docs/decisions.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from peagle_core.model.cpp_kernels import load

_TEACHER_ARGS = ("const void*", "int64_t", "float*", "float*", "int64_t*", "int64_t", "int64_t")
_DRAFT_ARGS = (
    "const void*", "int64_t", "const float*", "const float*", "const int64_t*", "const float*", "float*",
    "int64_t*", "void*", "int64_t", "int64_t", "int64_t",
)  # fmt: skip
_DTYPES = (torch.float32, torch.bfloat16)

TeacherKernel = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
DraftKernel = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _built() -> tuple[Callable[..., None], ...] | None:
    return load("kl_rows.cpp", (("KL_ROWS_TEACHER", _TEACHER_ARGS), ("KL_ROWS_DRAFT", _DRAFT_ARGS)))


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2 or x.dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(f"{name} must be a 2-D fp32 or bf16 CPU tensor, got {x.dtype} {tuple(x.shape)}")
    return x.contiguous()


def native_teacher_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`peagle_core.model.loss.teacher_stats` in one pass per row."""
    kernels = _built()
    assert kernels is not None, "native_row_kernels() said whether they built"
    logits = _rows(logits, "logits")
    u, v = logits.shape
    p = torch.empty(u, v, dtype=torch.float32)
    neg_entropy = torch.empty(u, dtype=torch.float32)
    argmax = torch.empty(u, dtype=torch.long)
    kernels[0](logits, int(logits.dtype == torch.bfloat16), p, neg_entropy, argmax, u, v)
    return p, neg_entropy, argmax


def native_draft_stats(
    logits: torch.Tensor,
    p: torch.Tensor,
    neg_entropy: torch.Tensor,
    inverse: torch.Tensor,
    row_weight: torch.Tensor,
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`peagle_core.model.loss.draft_stats` without the TV term, in one pass per row."""
    kernels = _built()
    assert kernels is not None, "native_row_kernels() said whether they built"
    logits = _rows(logits, "logits")
    c, v = logits.shape
    if p.dtype != torch.float32 or p.dim() != 2 or p.shape[1] != v:
        raise ValueError(f"p must be fp32 [u, {v}], got {p.dtype} {tuple(p.shape)}")
    if grad_dtype not in _DTYPES:
        raise ValueError(f"grad_dtype must be fp32 or bf16, got {grad_dtype}")
    if inverse.shape != (c,) or row_weight.shape != (c,) or neg_entropy.shape != (p.shape[0],):
        raise ValueError("inverse and row_weight need one entry per logits row, neg_entropy one per p row")
    if c and (int(inverse.min()) < 0 or int(inverse.max()) >= p.shape[0]):
        raise ValueError("inverse indexes past p's rows")
    loss = torch.empty(c, dtype=torch.float32)
    argmax = torch.empty(c, dtype=torch.long)
    grad = torch.empty(c, v, dtype=grad_dtype)
    kernels[1](
        logits, int(logits.dtype == torch.bfloat16), p.contiguous(), neg_entropy.float().contiguous(),
        inverse.long().contiguous(), row_weight.float().contiguous(), loss, argmax, grad,
        int(grad_dtype == torch.bfloat16), c, v,
    )  # fmt: skip
    return loss, argmax, grad


def native_row_kernels() -> tuple[TeacherKernel, DraftKernel] | None:
    """The two kernels, built on first use (a few seconds, then cached on disk); None where that fails."""
    return (native_teacher_stats, native_draft_stats) if _built() is not None else None
