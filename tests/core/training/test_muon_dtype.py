"""Our Muon is torch's Muon with the Newton-Schulz iterations in a chosen dtype: in bf16 it steps exactly as
torch's does; in fp32 (CPUs without fast bf16) it lands within bf16's rounding of it."""

from __future__ import annotations

import pytest
import torch

from peagle_core.training.muon import Muon, MuonAdamW


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(48, 24), (24, 48), (32, 32)]  # wide, tall (transposed inside) and square
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _run(opt_cls, ns_dtype=None, *, nesterov: bool = True, steps: int = 3) -> list[torch.Tensor]:
    params = _params(0)
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov, "adjust_lr_fn": "match_rms_adamw"}
    opt = opt_cls(params, **kwargs) if ns_dtype is None else opt_cls(params, ns_dtype=ns_dtype, **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("nesterov", [True, False])
def test_bf16_iterations_step_exactly_as_torch_muon(nesterov: bool) -> None:
    ours = _run(Muon, torch.bfloat16, nesterov=nesterov)
    theirs = _run(torch.optim.Muon, nesterov=nesterov)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_fp32_iterations_stay_within_bf16_rounding_of_torch_muon() -> None:
    start = _params(0)
    ours, theirs = _run(Muon, torch.float32), _run(torch.optim.Muon)
    for a, b, p0 in zip(ours, theirs, start, strict=True):
        moved = (b - p0.detach()).abs().max()
        assert (a - b).abs().max() < 0.02 * moved  # the update's own size, not the weights', sets the scale
        assert not torch.equal(a, b)  # it really ran in fp32


def test_muon_adamw_picks_fp32_iterations_where_bf16_is_slow(monkeypatch) -> None:
    import peagle_core.training.muon as muon_module

    for fast, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(muon_module, "has_fast_bf16", lambda _device, fast=fast: fast)
        opt = MuonAdamW([{"params": _params(0)}], [{"params": [torch.nn.Parameter(torch.zeros(4))]}], lr=1e-3)
        assert opt._inner["muon"].ns_dtype == want


def test_fp32_iterations_leave_the_momentum_buffer_as_it_is() -> None:
    # Without Nesterov the update is the momentum buffer itself; in fp32 the orthogonalization must work
    # on a copy, or it would scale the buffer that the next step reads.
    params = _params(0)
    opt = Muon(params, ns_dtype=torch.float32, lr=0.02, nesterov=False, momentum=0.9)
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params)]
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad.clone()
    opt.step()
    for p, grad in zip(params, grads, strict=True):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], 0.1 * grad)
