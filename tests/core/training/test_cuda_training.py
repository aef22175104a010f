"""The CUDA training path against the CPU: the drafter's loss and gradients (FlexAttention against the
chunked kernel), a bf16 autocast step, and FlexAttention at Llama-3.1-8B's head shape. Skipped without a
GPU; bench/gpu_suite.py runs them on one."""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from peagle_core.model.objective import distillation_loss, sample_rows
from peagle_core.training.builders import build_optimizer
from peagle_core.training.loop import forward_backward
from tests.core.model.test_model import packed_batch, tiny_model

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")


def _to(batch: SimpleNamespace, device: torch.device) -> SimpleNamespace:
    return SimpleNamespace(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in vars(batch).items()})


def _loss_and_grads(model, teacher, batch, rows, autocast: Any = None) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    with autocast if autocast is not None else contextlib.nullcontext():
        out = distillation_loss(model, teacher, batch, rows)
    out.loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().float().cpu(), grads


def test_loss_and_gradients_on_cuda_match_the_cpu() -> None:
    # head_dim 16: FlexAttention's smallest; fp32 throughout, so only the kernels differ.
    model, teacher = tiny_model(seed=3, head_dim=16)
    batch = packed_batch(seed=3, lengths=(23, 17), pad=5)
    rows = sample_rows(model.config, batch, torch.Generator().manual_seed(3))
    assert int(rows[1].max()) >= 2
    cpu_loss, cpu_grads = _loss_and_grads(model, teacher, batch, rows)

    gpu_model = copy.deepcopy(model).to(CUDA)
    assert gpu_model.attention_backend == "auto"  # FlexAttention on CUDA
    gpu_loss, gpu_grads = _loss_and_grads(gpu_model, copy.deepcopy(teacher).to(CUDA), _to(batch, CUDA), rows)

    torch.testing.assert_close(gpu_loss, cpu_loss, rtol=1e-4, atol=1e-5)
    assert gpu_grads.keys() == cpu_grads.keys() and len(cpu_grads) == len(list(model.parameters()))
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(gpu_grads[name], grad, rtol=2e-3, atol=2e-4, msg=name)


def test_bf16_autocast_step_tracks_fp32_and_learns() -> None:
    model, teacher = tiny_model(seed=4, head_dim=16)
    model, teacher = model.to(CUDA), teacher.to(CUDA)
    batch = _to(packed_batch(seed=4, lengths=(30,), pad=2), CUDA)
    rows = sample_rows(model.config, batch, torch.Generator().manual_seed(4))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)

    fp32_loss, fp32_grads = _loss_and_grads(model, teacher, batch, rows)
    bf16_loss, bf16_grads = _loss_and_grads(model, teacher, batch, rows, autocast)
    torch.testing.assert_close(bf16_loss, fp32_loss, rtol=5e-2, atol=1e-2)
    for name, p in model.named_parameters():  # master weights and their gradients stay fp32
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
    flat32 = torch.cat([g.flatten() for g in fp32_grads.values()])
    flat16 = torch.cat([bf16_grads[n].flatten() for n in fp32_grads])
    assert bool(torch.isfinite(flat16).all())
    assert float(torch.nn.functional.cosine_similarity(flat16, flat32, dim=0)) > 0.99

    optimizer = build_optimizer(model, 1e-2, 0.0)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        metrics = forward_backward(
            model, teacher, batch, num_segments=1, generator=generator, scale=1.0, autocast=autocast
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0], losses


def test_flex_matches_chunked_at_the_llama_8b_head_shape_in_bf16() -> None:
    # The real run's attention shape: 32 query heads over 8 KV heads of 128, bf16, packed documents.
    from peagle_core.model.attention import AttentionLayout, parallel_group_attention
    from peagle_core.model.cod import sample_cod_indices

    g = torch.Generator().manual_seed(0)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate((300, 150, 40))] + [torch.full((22,), -1)])
    mask = (docs >= 0).long()
    anchor, depth = sample_cod_indices(docs.numel(), mask, 8, 0.7, 0.2, generator=g, document_ids=docs)
    layout = AttentionLayout.build(anchor.to(CUDA), depth.to(CUDA), docs.to(CUDA), num_heads=32)
    n = anchor.numel()
    q = torch.randn(n, 32, 128, device=CUDA).bfloat16().requires_grad_()
    k = torch.randn(n, 8, 128, device=CUDA).bfloat16().requires_grad_()
    v = torch.randn(n, 8, 128, device=CUDA).bfloat16().requires_grad_()
    probe = torch.randn(n, 32, 128, device=CUDA)
    results = {}
    for backend, inputs in (("flex", (q, k, v)), ("chunked", tuple(t.float() for t in (q, k, v)))):
        out = parallel_group_attention(*inputs, layout, backend)
        results[backend] = (out.float(), *torch.autograd.grad((out.float() * probe).sum(), (q, k, v)))
    for got, want in zip(results["flex"], results["chunked"], strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_compiled_block_mask_on_cuda_equals_the_eager_one() -> None:
    # CUDA builds block masks with a compiled create_block_mask (no N x N grid); same mask, any row count.
    from torch.nn.attention.flex_attention import create_block_mask

    import peagle_core.model.attention as attention
    from peagle_core.model.cod import sample_cod_indices

    for seed, lengths in ((0, (200, 90)), (1, (333, 40, 17))):
        g = torch.Generator().manual_seed(seed)
        docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((9,), -1)])
        mask = (docs >= 0).long()
        anchor, depth = sample_cod_indices(docs.numel(), mask, 8, 0.7, 0.2, generator=g, document_ids=docs)
        rows = [t.to(CUDA) for t in (anchor, depth, docs[anchor])]
        compiled = attention.flex_block_mask(*rows)
        n = anchor.numel()
        eager = create_block_mask(attention.parallel_group_mask_mod(*rows), None, None, n, n, device=CUDA)
        assert not attention._compiled_mask_failed
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(compiled, name), getattr(eager, name)), (seed, name)
