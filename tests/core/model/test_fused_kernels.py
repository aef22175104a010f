"""The CPU fast path against its references: the fused flash-attention kernel against dense attention
(forward and gradients, on every layout training builds; its backward's C++ steps against their PyTorch ops), and the loss kernels (C++, compiled, eager) against the
unfused loss (forward and gradients), in fp32 and under bf16 autocast."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from peagle_core.model import kl_rows_native
from peagle_core.model import loss as loss_module
from peagle_core.model.attention import AttentionLayout, parallel_group_attention
from peagle_core.model.cod import sample_cod_indices
from peagle_core.model.loss import fused_kl_loss, reference_kl_loss
from peagle_core.model.objective import segment_rows


def _cod_layout(docs: torch.Tensor, depths: int, seed: int, ratio: float = 0.8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(docs.numel(), generator=g) < 0.75).long() * (docs >= 0)
    anchor, depth = sample_cod_indices(docs.numel(), mask, depths, ratio, 0.3, generator=g, document_ids=docs)
    return anchor, depth, docs


def _documents(*lengths: int, pad: int = 0) -> torch.Tensor:
    parts = [torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)]
    return torch.cat(parts)


LAYOUTS = {
    # one document, depth 0 only: plain causal attention
    "causal": lambda: (torch.arange(40), torch.zeros(40, dtype=torch.long), _documents(40)),
    # packed documents of mixed lengths with trailing padding, COD chains to depth 5
    "packed_cod": lambda: _cod_layout(_documents(17, 9, 33, 5, pad=6), depths=5, seed=1),
    # long COD chains in few documents (many deep rows per anchor)
    "deep_chains": lambda: _cod_layout(_documents(70, 50), depths=8, seed=2, ratio=0.95),
}


def _segment(case: tuple[torch.Tensor, ...], s: int, num_segments: int) -> tuple[torch.Tensor, ...]:
    anchor, depth, docs = case
    seg_anchor, seg_depth = segment_rows((anchor, depth), docs, s, num_segments)
    return seg_anchor, seg_depth, docs


def _attention_grads(layout: AttentionLayout, backend: str, dtype: torch.dtype, seed: int = 0):
    n = layout.anchor_pos.numel()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 6, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(n, 2, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(n, 2, 16, generator=g).to(dtype).requires_grad_()
    probe = torch.randn(n, 6, 16, generator=g)
    out = parallel_group_attention(q, k, v, layout, backend)
    grads = torch.autograd.grad((out.float() * probe).sum(), (q, k, v))
    return [out.float(), *(x.float() for x in grads)]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("segment", [None, (0, 2), (1, 2), (2, 3)], ids=["whole", "s0of2", "s1of2", "s2of3"])
def test_fused_attention_equals_dense_forward_and_gradients(
    name: str, segment: tuple[int, int] | None
) -> None:
    case = LAYOUTS[name]()
    if segment is not None:
        case = _segment(case, *segment)
    layout = AttentionLayout.build(*case, num_heads=6)
    fused = _attention_grads(layout, "fused", torch.float32)
    dense = _attention_grads(layout, "dense", torch.float32)
    for what, a, b in zip(("out", "dq", "dk", "dv"), fused, dense, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=what)


def test_fused_attention_with_many_small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import peagle_core.model.attention as attention

    monkeypatch.setattr(attention, "_CHUNK_SCORE_BYTES", 512)  # chunks split every depth group
    layout = AttentionLayout.build(*LAYOUTS["packed_cod"](), num_heads=6)
    assert len(layout.chunks) > len(layout.depth.unique())
    for a, b in zip(
        _attention_grads(layout, "fused", torch.float32),
        _attention_grads(layout, "dense", torch.float32),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_fused_attention_backward_in_cpp_equals_its_pytorch_steps(
    name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The backward's probabilities and softmax gradient run in C++ on CPU (csrc/attention_rows.cpp);
    # the PyTorch ops they replace (where the C++ does not build) are their reference. Small chunks:
    # chunk edges cut through documents and chains.
    import peagle_core.model.attention as attention

    assert attention.attention_row_kernels() is not None  # it built
    monkeypatch.setattr(attention, "_CHUNK_SCORE_BYTES", 2048)
    layout = AttentionLayout.build(*LAYOUTS[name](), num_heads=6)
    native = _attention_grads(layout, "fused", dtype)
    monkeypatch.setattr(attention, "attention_row_kernels", lambda: None)
    steps = _attention_grads(layout, "fused", dtype)
    tol = {"atol": 2e-6, "rtol": 2e-6} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    for what, a, b in zip(("out", "dq", "dk", "dv"), native, steps, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=what)


def _assert_aligned(fused: tuple[torch.Tensor, ...], dense: tuple[torch.Tensor, ...]) -> None:
    """Output and gradients point the same way (cosine > 0.999): bf16's rounding, not a wrong algorithm."""
    for what, a, b in zip(("out", "dq", "dk", "dv"), fused, dense, strict=True):
        cos = torch.nn.functional.cosine_similarity(a.detach().flatten(), b.detach().flatten(), dim=0)
        assert float(cos) > 0.999, what


def test_fused_attention_in_bf16_tracks_fp32_dense() -> None:
    # bf16 inputs (what autocast hands the kernel): errors of bf16 rounding, not of the algorithm.
    layout = AttentionLayout.build(*LAYOUTS["packed_cod"](), num_heads=6)
    fused = _attention_grads(layout, "fused", torch.bfloat16)
    dense = _attention_grads(layout, "dense", torch.float32)
    _assert_aligned(fused, dense)


def test_fused_attention_under_bf16_autocast_tracks_fp32_dense() -> None:
    # Training's path: the projections hand fp32 or bf16 rows in, and the backward runs under autocast too.
    layout = AttentionLayout.build(*LAYOUTS["packed_cod"](), num_heads=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _attention_grads(layout, "fused", torch.float32)
    dense = _attention_grads(layout, "dense", torch.float32)
    _assert_aligned(fused, dense)


def test_padding_rows_get_zeros_and_no_gradient() -> None:
    layout = AttentionLayout.build(*LAYOUTS["packed_cod"](), num_heads=6)
    out, dq, _, _ = _attention_grads(layout, "fused", torch.float32)
    pad = layout.row_doc < 0
    assert bool(pad.any())
    assert bool((out[pad] == 0).all()) and bool((dq[pad] == 0).all())


# ------------------------------------------------------------------------------------------------ loss


def _loss_case(n: int = 300, targets: int = 90, hidden: int = 24, vocab: int = 1000, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).requires_grad_()
    w = (0.3 * torch.randn(vocab, hidden, generator=g)).requires_grad_()
    th, tw = torch.randn(targets, hidden, generator=g), 0.3 * torch.randn(vocab, hidden, generator=g)
    # repeated targets, as every depth of a chain shares its anchor's next positions
    target = torch.randint(0, targets, (n,), generator=g)
    row_w = torch.rand(n, generator=g)
    return h, w, th, tw, target, row_w


@pytest.fixture(params=["native", "compiled", "eager"])
def loss_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """native: the C++ row kernels (the CPU default); compiled: Inductor's, as where C++ does not build."""
    monkeypatch.setenv("PEAGLE_COMPILE", "0" if request.param == "eager" else "1")
    monkeypatch.setattr(loss_module, "_CHUNK_LOGIT_BYTES", 4 * 1000 * 64)  # 64-row chunks: several per call
    if request.param == "compiled":
        monkeypatch.setattr(loss_module, "native_row_kernels", lambda: None)
    loss_module._compiled_kernels.cache_clear()
    if request.param == "native":
        assert loss_module._compiled_kernels()[0] is kl_rows_native.native_teacher_stats  # it built
    yield request.param
    loss_module._compiled_kernels.cache_clear()


def test_fused_loss_equals_reference_forward_and_gradients(loss_kernels: str) -> None:
    h, w, th, tw, target, row_w = _loss_case()
    got = fused_kl_loss(h, w, th, tw, target, row_w)
    want = reference_kl_loss(h, w, th, tw, target, row_w)
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-5)
    g_got = torch.autograd.grad(got.loss * 3.0, (h, w))
    g_want = torch.autograd.grad(want * 3.0, (h, w))
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # per-row KL and accuracy against a direct computation
    logq = torch.log_softmax(h.detach() @ w.detach().T, -1)
    logp = torch.log_softmax(th[target] @ tw.T, -1)
    torch.testing.assert_close(got.kl, (logp.exp() * (logp - logq)).sum(-1), rtol=1e-4, atol=1e-5)
    assert torch.equal(got.correct, logq.argmax(-1) == logp.argmax(-1))


def test_fused_loss_under_bf16_autocast_tracks_fp32(loss_kernels: str) -> None:
    # CUDA training runs under bf16 autocast: the loss's matmuls come back in bf16, its accumulators and
    # the gradients it returns must stay fp32 (this raised "Index put requires the source and destination
    # dtypes match" before).
    h, w, th, tw, target, row_w = _loss_case(seed=1)
    want = reference_kl_loss(h, w, th, tw, target, row_w)
    g_want = torch.autograd.grad(want, (h, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_kl_loss(h, w, th, tw, target, row_w)
    g_got = torch.autograd.grad(got.loss, (h, w))
    torch.testing.assert_close(got.loss, want, rtol=0.02, atol=0.01)
    for a, b in zip(g_got, g_want, strict=True):
        assert a.dtype == torch.float32  # gradients of the fp32 master tensors stay fp32
        assert float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)) > 0.995


def test_fused_loss_without_lm_head_gradient(loss_kernels: str) -> None:
    h, w, th, tw, target, row_w = _loss_case(seed=2)
    frozen = w.detach()
    got = fused_kl_loss(h, frozen, th, tw, target, row_w)
    (g,) = torch.autograd.grad(got.loss, (h,))
    (g_want,) = torch.autograd.grad(reference_kl_loss(h, frozen, th, tw, target, row_w), (h,))
    torch.testing.assert_close(g, g_want, rtol=1e-5, atol=1e-6)


def test_compiled_loss_kernels_compile_once_for_every_row_count() -> None:
    # Chunks and teacher-row counts change every step; the kernels (and the loss's gather, scatter and
    # accumulation helpers) keep one graph for all of them (a recompile per shape would cost seconds a
    # step, and past dynamo's cache limit fall back to eager).
    torch._dynamo.reset()
    loss_module._compiled_kernels.cache_clear()
    g = torch.Generator().manual_seed(3)
    w, tw = torch.randn(40, 96, generator=g, requires_grad=True), torch.randn(40, 96, generator=g)

    def call(rows: int, chosen: int, targets: int) -> None:
        h = torch.randn(rows, 96, generator=g, requires_grad=True)
        picked = torch.sort(torch.randperm(rows, generator=g)[:chosen]).values
        target = torch.randint(0, targets, (chosen,), generator=g)
        th = torch.randn(targets, 96, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fused_kl_loss(h, w, th, tw, target, torch.ones(chosen), hidden_rows=picked)
        out.loss.backward()

    call(64, 50, 40)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows, chosen, targets in ((37, 20, 11), (5, 3, 3), (300, 280, 90)):
            call(rows, chosen, targets)
    assert loss_module.compile_enabled()  # nothing fell back to eager


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_fused_loss_over_chosen_rows_equals_it_over_their_copy(loss_kernels: str, autocast: bool) -> None:
    # Training scores only the loss rows among the drafter's: `hidden_rows` picks them chunk by chunk.
    # Forward, per-row outputs and gradients must equal the loss over the gathered copy, and rows left
    # out must get a zero gradient.
    h, w, th, tw, target, row_w = _loss_case(seed=4)
    g = torch.Generator().manual_seed(5)
    chosen = torch.sort(torch.randperm(h.shape[0], generator=g)[: h.shape[0] * 2 // 3]).values
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = fused_kl_loss(h, w, th, tw, target[chosen], row_w[chosen], hidden_rows=chosen)
        want = fused_kl_loss(h[chosen], w, th, tw, target[chosen], row_w[chosen])
    g_got = torch.autograd.grad(got.loss, (h, w))
    g_want = torch.autograd.grad(want.loss, (h, w))
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(got.kl, want.kl)
    assert torch.equal(got.correct, want.correct)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b)
    left_out = torch.ones(h.shape[0], dtype=torch.bool)
    left_out[chosen] = False
    assert left_out.any() and torch.equal(g_got[0][left_out], torch.zeros_like(g_got[0][left_out]))
    if not autocast:  # and the gathered loss is the reference's
        torch.testing.assert_close(
            got.loss,
            reference_kl_loss(h[chosen], w, th, tw, target[chosen], row_w[chosen]),
            rtol=1e-5,
            atol=1e-5,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extra", [0, 1, 37])
def test_repeat_last_row_equals_indexing_forward_and_gradients(dtype: torch.dtype, extra: int) -> None:
    # Layer 0 projects the deeper rows' shared input once and repeats it; the repeat's backward (a sum
    # into the last row) must equal what indexing's accumulating scatter gives.
    from peagle_core.model.layers import repeat_last_row

    g = torch.Generator().manual_seed(6)
    x = torch.randn(12, 3, 5, generator=g).to(dtype).requires_grad_()
    rows = 11 + extra
    index = torch.cat([torch.arange(11), torch.full((extra,), 11)])
    probe = torch.randn(rows, 3, 5, generator=g).to(dtype)
    got = repeat_last_row(x, rows)
    want = x[index]
    assert torch.equal(got, want)
    (g_got,) = torch.autograd.grad((got * probe).sum(), (x,))
    # the exact gradient in fp32 (indexing's own scatter would accumulate bf16 repeats in bf16)
    x32 = x.detach().float().requires_grad_()
    (g_want,) = torch.autograd.grad((x32[index] * probe.float()).sum(), (x32,))
    tol = {"rtol": 8e-3, "atol": 1e-5} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(g_got.float(), g_want, **tol)
    with pytest.raises(ValueError, match="repeat_last_row"):
        repeat_last_row(x, 10)
