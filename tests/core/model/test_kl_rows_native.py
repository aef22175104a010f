"""The loss's C++ row kernels (`kl_rows_native`) against the functions they replace (`loss.teacher_stats`,
`loss.draft_stats`, run eagerly): every logits and gradient dtype, vocabularies off the vector width,
tied maxima, repeated and skipped teacher rows."""

from __future__ import annotations

import pytest
import torch

from peagle_core.model import kl_rows_native
from peagle_core.model.loss import draft_stats, teacher_stats

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert kl_rows_native.native_row_kernels() is not None


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = 4 * torch.randn(rows, vocab, generator=g)
    x[0] = 0.0  # a row of ties: argmax is the first index
    x[1, [3, vocab - 1]] = x[1].max() + 1  # two tied maxima, far apart
    return x.to(dtype)


@pytest.mark.parametrize("vocab", [8192, 1000, 37])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_teacher_stats_equal_the_reference(dtype: torch.dtype, vocab: int) -> None:
    logits = _logits(70, vocab, dtype, seed=vocab)
    p, neg_entropy, argmax = kl_rows_native.native_teacher_stats(logits)
    p_want, neg_want, argmax_want = teacher_stats(logits)
    torch.testing.assert_close(p, p_want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(neg_entropy, neg_want, rtol=1e-5, atol=5e-5)  # fp32 sums of 8k terms
    assert torch.equal(argmax, argmax_want)
    assert argmax[0] == 0 and argmax[1] == 3


@pytest.mark.parametrize("vocab", [8192, 1000, 37])
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=["grad_fp32", "grad_bf16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_draft_stats_equal_the_reference(dtype: torch.dtype, grad_dtype: torch.dtype, vocab: int) -> None:
    teacher = _logits(40, vocab, dtype, seed=1)
    p, neg_entropy, _ = teacher_stats(teacher)
    logits = _logits(90, vocab, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    # sorted and repeated, some teacher rows unused, as a loss chunk's `inverse` is
    inverse = torch.sort(torch.randint(0, 40, (90,), generator=g)).values
    row_weight = torch.rand(90, generator=g)
    row_weight[5] = 0.0
    got = kl_rows_native.native_draft_stats(logits, p, neg_entropy, inverse, row_weight, grad_dtype)
    want = draft_stats(logits, p, neg_entropy, inverse, row_weight, grad_dtype)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=2e-5)  # KL per row
    assert torch.equal(got[1], want[1])  # argmax, ties included
    assert got[2].dtype == grad_dtype
    tol = {"rtol": 1e-2, "atol": 1e-6} if grad_dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(got[2], want[2], **tol)  # the weighted gradient w.r.t. the logits
    assert torch.equal(got[2][5], torch.zeros_like(got[2][5]))


def test_draft_stats_refuse_mismatched_inputs() -> None:
    p, neg_entropy, _ = teacher_stats(torch.randn(4, 16))
    logits, weight = torch.randn(6, 16), torch.ones(6)
    with pytest.raises(ValueError, match="inverse indexes past p"):
        kl_rows_native.native_draft_stats(logits, p, neg_entropy, torch.full((6,), 4), weight, torch.float32)
    with pytest.raises(ValueError, match=r"p must be fp32 \[u, 16\]"):
        kl_rows_native.native_draft_stats(logits, p[:, :8], neg_entropy, torch.zeros(6, dtype=torch.long), weight,
                                   torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match="logits must be a 2-D"):
        kl_rows_native.native_teacher_stats(torch.randn(16, dtype=torch.float64))
