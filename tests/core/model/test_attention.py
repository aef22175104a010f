"""Parallel-group attention: the mask against a brute-force reading of the rule, and the backends agree."""

from __future__ import annotations

import warnings

import pytest
import torch

from peagle_core.model.attention import AttentionLayout, parallel_group_attention, parallel_group_mask
from peagle_core.model.cod import sample_cod_indices


def _packed_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    docs = torch.tensor([0] * 17 + [1] * 9 + [2] * 21 + [-1] * 6)
    mask = (torch.rand(docs.numel(), generator=g) < 0.7).long() * (docs >= 0)
    anchor, depth = sample_cod_indices(docs.numel(), mask, 5, 0.8, 0.3, generator=g, document_ids=docs)
    return anchor, depth, docs


def _brute_force_mask(anchor: torch.Tensor, depth: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    n = anchor.numel()
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        a, d, doc = int(anchor[i]), int(depth[i]), int(docs[anchor[i]])
        for j in range(n):
            a2, d2, doc2 = int(anchor[j]), int(depth[j]), int(docs[anchor[j]])
            if doc == -1 or doc != doc2:
                continue
            out[i, j] = (d2 == 0 and a2 <= a) or (a2 == a and d2 <= d)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_dense_mask_matches_brute_force(seed: int) -> None:
    anchor, depth, docs = _packed_case(seed)
    assert int(depth.max()) >= 3 and bool((docs[anchor] == -1).any())
    expected = _brute_force_mask(anchor, depth, docs)
    assert torch.equal(parallel_group_mask(anchor, depth, docs), expected)
    assert torch.equal(AttentionLayout.build(anchor, depth, docs).dense_mask(), expected)


def test_flex_block_mask_agrees_with_dense_on_cpu() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    anchor, depth, docs = _packed_case(2)
    layout = AttentionLayout.build(anchor, depth, docs, num_heads=4)
    n = anchor.numel()
    q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused
        flex = flex_attention(
            *(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=layout.block_mask(), enable_gqa=True
        )[0].transpose(0, 1)
    dense = parallel_group_attention(q, k, v, layout, "dense")
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def _compare_backends(layout: AttentionLayout, other: str, atol: float = 1e-5) -> None:
    n = layout.anchor_pos.numel()
    torch.manual_seed(0)
    device = layout.anchor_pos.device
    q = torch.randn(n, 4, 16, device=device, requires_grad=True)
    k = torch.randn(n, 2, 16, device=device, requires_grad=True)
    v = torch.randn(n, 2, 16, device=device, requires_grad=True)
    probe = torch.randn(n, 4, 16, device=device)
    results = {}
    for backend in ("chunked", other):
        out = parallel_group_attention(q, k, v, layout, backend)
        grads = torch.autograd.grad((out * probe).sum(), (q, k, v))
        results[backend] = (out, *grads)
    for a, b in zip(results["chunked"], results[other], strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=atol)


def test_chunked_matches_dense_forward_and_backward() -> None:
    anchor, depth, docs = _packed_case(3)
    _compare_backends(AttentionLayout.build(anchor, depth, docs, num_heads=4), "dense")


def test_chunked_matches_dense_with_small_chunks_and_offset_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    import peagle_core.model.attention as attention

    monkeypatch.setattr(attention, "_CHUNK_SCORE_BYTES", 256)  # force many chunks per depth
    anchor, depth, docs = _packed_case(4)
    # A segment-like row set: depth-0 rows start at document 1's first anchor.
    keep = (anchor >= 17) & ((depth == 0) | (anchor >= 30))
    layout = AttentionLayout.build(anchor[keep], depth[keep], docs, num_heads=4)
    assert layout.prefix_start == 17 and len(layout.chunks) > len(layout.depth.unique())
    _compare_backends(layout, "dense")


@pytest.mark.cuda
def test_flex_matches_chunked_on_cuda() -> None:
    anchor, depth, docs = _packed_case(5)
    device = torch.device("cuda")
    layout = AttentionLayout.build(anchor.to(device), depth.to(device), docs.to(device), num_heads=4)
    _compare_backends(layout, "flex", atol=2e-3)
