"""The compiled drafter forward (`training.compile`): the same rows, loss and gradients as the eager forward
on packed documents with COD rows, in fp32 and under bf16 autocast, one graph for every row count; and
when a run compiles it."""

from __future__ import annotations

import pytest
import torch

from peagle_core.model.objective import distillation_loss, sample_rows
from peagle_core.training.compiled_forward import CPU_COMPILE_MIN_STEPS, CompiledForward, should_compile
from tests.core.model.test_model import packed_batch, tiny_model

CPU = torch.device("cpu")


def _loss_and_grads(module: torch.nn.Module, drafter: torch.nn.Module, teacher, batch, rows, autocast: bool):
    drafter.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = distillation_loss(module, teacher, batch, rows)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_compiled_forward_equals_eager_loss_and_gradients(autocast: bool) -> None:
    torch._dynamo.reset()
    drafter, teacher = tiny_model(num_layers=2, num_depths=3)
    compiled = CompiledForward(drafter)
    # two batches of different lengths and COD draws: dynamic row counts, one graph
    for seed, lengths in ((0, (23, 17)), (1, (31, 9, 12))):
        batch = packed_batch(seed, lengths=lengths)
        rows = sample_rows(drafter.config, batch, torch.Generator().manual_seed(seed))
        eager, g_eager = _loss_and_grads(drafter, drafter, teacher, batch, rows, autocast)
        got, g_got = _loss_and_grads(compiled, drafter, teacher, batch, rows, autocast)
        assert not compiled._failed  # it really ran compiled
        tol = {"rtol": 2e-2, "atol": 2e-3} if autocast else {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(got.loss, eager.loss, **tol)
        for key in ("acc_0", "positions_0", "positions_2"):
            torch.testing.assert_close(got.metrics[key], eager.metrics[key])
        assert g_got.keys() == g_eager.keys() and "embed_tokens.weight" in g_got
        for name, grad in g_eager.items():
            if autocast:  # bf16 rounds where the fused graph does not: direction, not bits
                cos = torch.nn.functional.cosine_similarity(g_got[name].flatten(), grad.flatten(), dim=0)
                assert float(cos) > 0.99, name
            else:
                torch.testing.assert_close(g_got[name], grad, **tol, msg=name)

    # COD draws a different number of rows every step; a recompile per step would cost seconds each.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, lengths in ((2, (40, 3)), (3, (5, 6, 7, 8)), (4, (60,))):
            batch = packed_batch(seed, lengths=lengths)
            rows = sample_rows(drafter.config, batch, torch.Generator().manual_seed(seed))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = distillation_loss(compiled, teacher, batch, rows)
            out.loss.backward()
    assert not compiled._failed


def test_when_a_run_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")
    long = CPU_COMPILE_MIN_STEPS
    assert should_compile("auto", CPU, False, "peagle", long)
    assert not should_compile("auto", CPU, False, "peagle", long - 1)  # too short to pay ~25 s back
    assert not should_compile("auto", CPU, False, "eagle3", long)  # its unrolled forward is not compiled
    assert not should_compile("auto", CPU, True, "peagle", long)  # DDP and FSDP run eagerly
    assert not should_compile("auto", cuda, False, "peagle", long)  # not measured on a GPU
    assert should_compile("on", cuda, False, "peagle", 1) and should_compile("on", CPU, False, "eagle3", 1)
    assert not should_compile("off", CPU, False, "peagle", long)
    monkeypatch.setenv("PEAGLE_COMPILE", "0")
    assert not should_compile("on", CPU, False, "peagle", long)
