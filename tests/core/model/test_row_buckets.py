"""Bucketed row counts (`peagle_core.model.row_buckets`): the padding changes no result of the drafter or the
loss, forward or gradients, on packed documents with COD rows, in fp32 and under bf16 autocast."""

from __future__ import annotations

import pytest
import torch

from peagle_core.model import row_buckets
from peagle_core.model.loss import fused_kl_loss
from peagle_core.model.row_buckets import ROW_BUCKET, pad_index, pad_rows, padded_rows
from tests.core.model.test_model import H, packed_batch, run, tiny_model

CPU = torch.device("cpu")


def test_counts_round_up_on_cpu_only() -> None:
    assert [padded_rows(n, CPU) for n in (1, ROW_BUCKET, ROW_BUCKET + 1)] == [
        ROW_BUCKET,
        ROW_BUCKET,
        2 * ROW_BUCKET,
    ]
    assert padded_rows(ROW_BUCKET + 1, torch.device("cuda")) == ROW_BUCKET + 1


def test_padding_appends_zero_rows_and_repeats_the_last_index() -> None:
    x = torch.randn(5, 3, requires_grad=True)
    padded = pad_rows(x)
    assert padded.shape == (ROW_BUCKET, 3)
    assert torch.equal(padded[:5], x) and not padded[5:].any()
    (padded * torch.arange(ROW_BUCKET)[:, None]).sum().backward()
    assert torch.equal(x.grad, torch.arange(5.0)[:, None].expand(5, 3))
    index = pad_index(torch.tensor([4, 1, 7]))
    assert index.shape == (ROW_BUCKET,) and index[:3].tolist() == [4, 1, 7] and set(index[3:].tolist()) == {7}
    full = torch.arange(ROW_BUCKET)
    assert pad_index(full) is full


def _drafter_run(bucket: int, autocast: bool, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(row_buckets, "ROW_BUCKET", bucket)
    model, teacher = tiny_model(seed=3, num_layers=2, num_depths=3)
    batch = packed_batch(seed=5, lengths=(31, 9, 44), pad=3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = run(model, teacher, batch, torch.Generator().manual_seed(7))
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_drafter_loss_and_gradients_do_not_depend_on_the_padding(
    autocast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    exact_loss, exact = _drafter_run(1, autocast, monkeypatch)
    padded_loss, padded = _drafter_run(ROW_BUCKET, autocast, monkeypatch)
    tol = {"rtol": 2e-2, "atol": 2e-3} if autocast else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(padded_loss, exact_loss, **tol)
    assert padded.keys() == exact.keys() and len(exact) > 10
    for name, grad in exact.items():
        torch.testing.assert_close(padded[name], grad, **tol, msg=name)


def _loss_run(bucket: int, autocast: bool, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(row_buckets, "ROW_BUCKET", bucket)
    g = torch.Generator().manual_seed(11)
    # 8,192 columns make 1,024-row chunks: two whole chunks and a tail of 300, each with its teacher rows
    rows, vocab, targets = 2348, 8192, 700
    hidden = torch.randn(rows + 50, H, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, H, generator=g)).requires_grad_()
    teacher_hidden = torch.randn(targets, H, generator=g)
    teacher_weight = 0.3 * torch.randn(vocab, H, generator=g)
    target_index = torch.randint(0, targets, (rows,), generator=g)
    row_weight = torch.rand(rows, generator=g)
    hidden_rows = torch.randperm(rows + 50, generator=g)[:rows]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fused_kl_loss(
            hidden, weight, teacher_hidden, teacher_weight, target_index, row_weight, hidden_rows=hidden_rows
        )
    out.loss.backward()
    return out.loss.detach(), out.kl, out.correct, hidden.grad, weight.grad


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_loss_does_not_depend_on_the_padding(autocast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    exact = _loss_run(1, autocast, monkeypatch)
    padded = _loss_run(ROW_BUCKET, autocast, monkeypatch)
    tol = {"rtol": 1e-2, "atol": 1e-3} if autocast else {"rtol": 1e-5, "atol": 1e-6}
    for got, want, name in zip(
        padded, exact, ("loss", "kl", "correct", "grad_hidden", "grad_weight"), strict=True
    ):
        if name == "correct":
            assert (got == want).float().mean() > 0.99
        else:
            torch.testing.assert_close(got, want, **tol, msg=name)
