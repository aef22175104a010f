"""Parallel-group attention over COD rows: the visibility rule, its dense and FlexAttention masks, and kernels.

A query row (anchor a, depth d) sees key row (a', d') iff both lie in the same packed document, the
query is not padding (document id -1), and either (d' = 0 and a' <= a) or (a' = a and d' <= d).

Every query therefore sees a causal, in-document prefix of depth-0 keys plus at most d keys of its own
chain. The CPU path exploits that: a chunked, memory-efficient attention over the depth-0 prefix (no
N x N tensor, float or bool) merged by log-sum-exp with a tiny per-chain term. `fused` (CPU default)
runs each chunk's forward through ATen's CPU flash-attention kernel and its backward as batched
matmuls with the elementwise steps between them in C++ (`csrc/attention_rows.cpp`); `chunked` is the
same computation in plain PyTorch ops. CUDA uses FlexAttention with a
block mask built from the same rule; `parallel_group_mask` is the dense reference.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

from peagle_core.model.cpp_kernels import load
from peagle_core.model.loss import compile_enabled
from peagle_core.model.precision import has_amx

Backend = Literal["auto", "fused", "chunked", "flex", "dense"]
log = logging.getLogger(__name__)

# Bytes of attention scores one chunk may hold (fp32): bounds transient memory independent of length.
# Small chunks also stay in cache; 8 MiB measured fastest and leanest on a 2-core CPU (bench/cod_memory.py).
_CHUNK_SCORE_BYTES = 8 * 2**20


def parallel_group_mask_mod(anchor_pos: torch.Tensor, depth: torch.Tensor, row_doc: torch.Tensor) -> Any:
    """The visibility rule as a FlexAttention `mask_mod(b, h, q_idx, kv_idx)` over row indices.

    `row_doc[i]` is the document id of row i's anchor (-1 for padding). Pure tensor ops, so it can also
    be evaluated densely by broadcasting index grids.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        q_anchor, k_anchor = anchor_pos[q_idx], anchor_pos[kv_idx]
        q_depth, k_depth = depth[q_idx], depth[kv_idx]
        q_doc, k_doc = row_doc[q_idx], row_doc[kv_idx]
        same_doc = (q_doc == k_doc) & (q_doc >= 0)
        prefix = (k_depth == 0) & (k_anchor <= q_anchor)
        own_chain = (k_anchor == q_anchor) & (k_depth <= q_depth)
        return same_doc & (prefix | own_chain)

    return mask_mod


def parallel_group_mask(
    anchor_pos: torch.Tensor, depth: torch.Tensor, document_ids: torch.Tensor
) -> torch.Tensor:
    """Dense BoolTensor[N, N], True where query row i may attend key row j.

    `document_ids` is per aligned position (shape [seq_len] or [1, seq_len]); a row's document is
    that of its anchor.
    """
    row_doc = document_ids.reshape(-1)[anchor_pos]
    n = anchor_pos.numel()
    idx = torch.arange(n, device=anchor_pos.device)
    return parallel_group_mask_mod(anchor_pos, depth, row_doc)(None, None, idx[:, None], idx[None, :])


def run_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """For every position, the index where its document's run begins (the last change of document id)."""
    docs = document_ids.reshape(-1)
    pos = torch.arange(docs.numel(), device=docs.device)
    changed = torch.ones_like(docs, dtype=torch.bool)
    changed[1:] = docs[1:] != docs[:-1]
    return torch.cummax(torch.where(changed, pos, 0), dim=0).values


def flex_block_mask(anchor_pos: torch.Tensor, depth: torch.Tensor, row_doc: torch.Tensor) -> Any:
    """FlexAttention BlockMask for the rule (built on the rows' device; used on CUDA).

    On CUDA a compiled `create_block_mask` builds it block by block. The eager one evaluates the rule on
    the whole N x N grid: about 7 GB of transient memory for the 27k rows of one 8192-token row at K=8,
    four times that at 16k tokens. If the compiled builder fails, the eager one takes over (logged once).
    """
    global _compiled_mask_failed
    from torch.nn.attention.flex_attention import create_block_mask

    n = anchor_pos.numel()
    mask_mod = parallel_group_mask_mod(anchor_pos, depth, row_doc)
    if anchor_pos.is_cuda and not _compiled_mask_failed:
        try:
            return _compiled_create_block_mask()(
                mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=anchor_pos.device
            )
        except Exception:
            log.warning("compiled create_block_mask failed; building block masks eagerly", exc_info=True)
            _compiled_mask_failed = True
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=anchor_pos.device)


_compiled_mask_failed = False


@cache
def _compiled_create_block_mask() -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    # dynamic: one graph for every row count (each step samples a different number of COD rows)
    return torch.compile(create_block_mask, dynamic=True)


@dataclass
class AttentionLayout:
    """Row bookkeeping shared by every layer of one forward pass.

    Rows are ordered depth-major. The first `num_prefix` rows are depth-0 rows for the contiguous
    anchors `prefix_start .. prefix_start + num_prefix - 1`; they are the only depth-0 keys.
    """

    anchor_pos: torch.Tensor  # [N] int64
    depth: torch.Tensor  # [N] int64
    row_doc: torch.Tensor  # [N] int64, -1 = padding
    prefix_start: int
    num_prefix: int
    key_lo: torch.Tensor  # [N] first visible depth-0 key (index into the prefix rows)
    key_hi: torch.Tensor  # [N] last visible depth-0 key, inclusive (< key_lo when none)
    chain_rows: (
        torch.Tensor
    )  # [N - num_prefix, max_depth] rows of depths 1..max_depth of the chain, -1 = none
    chunks: list[tuple[int, int, int, int]] = field(default_factory=list)  # (row0, row1, key0, key1)
    _block_mask: Any = None

    @classmethod
    @torch.compiler.disable  # a compiled drafter forward leaves the layout's data-dependent plan to eager
    def build(
        cls,
        anchor_pos: torch.Tensor,
        depth: torch.Tensor,
        document_ids: torch.Tensor,
        num_heads: int = 1,
    ) -> AttentionLayout:
        """Precompute key ranges, chain tables and query chunks for `(anchor_pos, depth)` rows.

        `document_ids` is per aligned position; documents must be contiguous runs (as packing makes
        them). Depth-0 rows must come first and cover a contiguous anchor range.
        """
        device = anchor_pos.device
        docs = document_ids.reshape(-1).to(device)
        num_prefix = int((depth == 0).sum())
        if num_prefix == 0 or bool((depth[:num_prefix] != 0).any()):
            raise ValueError("depth-0 rows must come first")
        prefix_start = int(anchor_pos[0])
        expected = torch.arange(prefix_start, prefix_start + num_prefix, device=device)
        if not torch.equal(anchor_pos[:num_prefix], expected):
            raise ValueError("depth-0 rows must cover a contiguous, ascending anchor range")

        row_doc = docs[anchor_pos]
        key_lo = (run_starts(docs)[anchor_pos] - prefix_start).clamp_min(0)
        key_hi = anchor_pos - prefix_start
        key_hi = torch.where(row_doc >= 0, key_hi, key_lo - 1)  # padding queries see nothing
        if bool((key_hi >= num_prefix).any()):
            raise ValueError("a row's anchor lies beyond the depth-0 rows")

        chain_rows = _chain_table(anchor_pos, depth, num_prefix)
        layout = cls(
            anchor_pos=anchor_pos,
            depth=depth,
            row_doc=row_doc,
            prefix_start=prefix_start,
            num_prefix=num_prefix,
            key_lo=key_lo,
            key_hi=key_hi,
            chain_rows=chain_rows,
        )
        layout.chunks = _plan_chunks(depth, key_lo, key_hi, num_heads)
        return layout

    def dense_mask(self) -> torch.Tensor:
        idx = torch.arange(self.anchor_pos.numel(), device=self.anchor_pos.device)
        mod = parallel_group_mask_mod(self.anchor_pos, self.depth, self.row_doc)
        return mod(None, None, idx[:, None], idx[None, :])

    def block_mask(self) -> Any:
        if self._block_mask is None:
            self._block_mask = flex_block_mask(self.anchor_pos, self.depth, self.row_doc)
        return self._block_mask


def _chain_table(anchor_pos: torch.Tensor, depth: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """For each depth>=1 row, the row indices of its chain at depths 1..max_depth (-1 beyond its own)."""
    n = anchor_pos.numel()
    device = anchor_pos.device
    max_depth = int(depth.max()) if n > num_prefix else 0
    q_anchor, q_depth = anchor_pos[num_prefix:], depth[num_prefix:]
    table = torch.full((n - num_prefix, max_depth), -1, dtype=torch.long, device=device)
    for d in range(1, max_depth + 1):
        rows = torch.nonzero(depth == d).flatten()
        if rows.numel() == 0:
            continue
        anchors = anchor_pos[rows]
        slot = torch.searchsorted(anchors, q_anchor).clamp_max(rows.numel() - 1)
        hit = (q_depth >= d) & (anchors[slot] == q_anchor)
        table[:, d - 1] = torch.where(hit, rows[slot], table[:, d - 1])
    return table


def _plan_chunks(
    depth: torch.Tensor, key_lo: torch.Tensor, key_hi: torch.Tensor, num_heads: int
) -> list[tuple[int, int, int, int]]:
    """Split rows into query chunks within each depth group, each with the key range it needs.

    Anchors ascend within a depth, so a chunk's key range is narrow and causal blocks are skipped.
    """
    chunks: list[tuple[int, int, int, int]] = []
    bounds = [*torch.nonzero(torch.diff(depth, prepend=depth[:1] - 1)).flatten().tolist(), depth.numel()]
    lo_all, hi_all = key_lo.tolist(), key_hi.tolist()
    for g0, g1 in itertools.pairwise(bounds):
        span = max(hi_all[g1 - 1] + 1 - lo_all[g0], 1)
        rows = max(16, _CHUNK_SCORE_BYTES // (4 * num_heads * span))
        for r0 in range(g0, g1, rows):
            r1 = min(r0 + rows, g1)
            k0 = min(lo_all[r0:r1])
            k1 = max(max(hi_all[r0:r1]) + 1, k0)
            chunks.append((r0, r1, k0, k1))
    return chunks


class _PrefixAttention(torch.autograd.Function):
    """Attention of every row over its visible depth-0 keys; returns (out, lse), O(N) saved memory.

    Shapes: q [hkv, g, N, dh]; k, v [hkv, P, dh] (the P depth-0 rows). The backward recomputes the
    scores per chunk (flash-attention style) and accepts a gradient for lse, which the log-sum-exp
    merge with the chain term needs.
    """

    @staticmethod
    def forward(ctx, q, k, v, key_lo, key_hi, chunks, scale):
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for r0, r1, k0, k1 in chunks:
            if k1 <= k0:
                continue
            p, lse_c = _chunk_probs(q[:, :, r0:r1], k[:, k0:k1], key_lo[r0:r1], key_hi[r0:r1], k0, scale)
            out[:, :, r0:r1] = (p.to(v.dtype) @ v[:, k0:k1].unsqueeze(1)).to(q.dtype)
            lse[:, :, r0:r1] = lse_c
        ctx.save_for_backward(q, k, v, out, lse, key_lo, key_hi)
        ctx.chunks, ctx.scale = chunks, scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, key_lo, key_hi = ctx.saved_tensors
        scale = ctx.scale
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if grad_lse is None:
            grad_lse = torch.zeros_like(lse)
        finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        for r0, r1, k0, k1 in ctx.chunks:
            if k1 <= k0:
                continue
            qc, kc, vc = q[:, :, r0:r1], k[:, k0:k1].unsqueeze(1), v[:, k0:k1].unsqueeze(1)
            scores = _chunk_scores(qc, kc, key_lo[r0:r1], key_hi[r0:r1], k0, scale)
            p = torch.exp(scores - finite_lse[:, :, r0:r1, None])
            go = grad_out[:, :, r0:r1].float()
            dp = go @ vc.float().transpose(-1, -2)
            delta = (go * out[:, :, r0:r1].float()).sum(-1, keepdim=True) - grad_lse[:, :, r0:r1, None]
            ds = p * (dp - delta) * scale
            dq[:, :, r0:r1] = (ds @ kc.float()).to(q.dtype)
            dk[:, k0:k1] += (ds.transpose(-1, -2) @ qc.float()).sum(1).to(k.dtype)
            dv[:, k0:k1] += (p.transpose(-1, -2) @ go).sum(1).to(v.dtype)
        return dq, dk, dv, None, None, None, None


def _chunk_scores(qc, kc, lo, hi, k0, scale):
    scores = (qc.float() @ kc.float().transpose(-1, -2)) * scale  # [hkv, g, c, R]
    keys = torch.arange(k0, k0 + kc.shape[-2], device=qc.device)
    visible = (keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None])
    return scores.masked_fill(~visible, float("-inf"))


def _chunk_probs(qc, kc, lo, hi, k0, scale):
    scores = _chunk_scores(qc, kc.unsqueeze(1), lo, hi, k0, scale)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return p, lse


class _FusedPrefixAttention(torch.autograd.Function):
    """`_PrefixAttention` with ATen's CPU flash-attention kernel as its forward (one fused call per chunk,
    in the inputs' dtype, bf16 under autocast, with fp32 accumulation and log-sum-exp) and batched fp32
    matmuls as its backward.

    The kernel's own backward loses to the matmuls: ~4.5x slower than its forward with AMX (in bf16 and
    fp32 alike, where even plain-op attention made the step faster: 2.38 s against 2.74 s), and equal or
    slower without (AVX2 EPYC, fp32, one step's attention backward at the SmolLM2 shape: kernel 0.41-0.54 s,
    matmuls 0.41-0.48 s, `bench/attention_kernels.py`). Its lack of an input for lse's gradient goes too.
    """

    @staticmethod
    def forward(ctx, q, k, v, key_lo, key_hi, chunks, scale):
        hkv, g, _, dh = q.shape
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kernel_lse = torch.zeros_like(lse)  # as the kernel returned it (0 on rows that see nothing)
        for r0, r1, k0, k1 in chunks:
            if k1 <= k0:
                continue
            mask = _chunk_bias(key_lo[r0:r1], key_hi[r0:r1], k0, k1, q.dtype)
            kc = k[:, None, k0:k1].expand(hkv, g, k1 - k0, dh)
            vc = v[:, None, k0:k1].expand(hkv, g, k1 - k0, dh)
            o, lse_c = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, r0:r1], kc, vc, attn_mask=mask, scale=scale
            )
            out[:, :, r0:r1] = o
            kernel_lse[:, :, r0:r1] = lse_c
            seen = (key_hi[r0:r1] >= key_lo[r0:r1])[None, None]
            lse[:, :, r0:r1] = torch.where(seen, lse_c, float("-inf"))
        # Masks are rebuilt in the backward: saving them would hold O(N x span) memory.
        ctx.save_for_backward(q, k, v, out, kernel_lse, key_lo, key_hi)
        ctx.chunks, ctx.scale = chunks, scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, kernel_lse, key_lo, key_hi = ctx.saved_tensors
        # The backward runs under the forward's autocast; its matmuls are fp32 by design.
        with torch.autocast(q.device.type, enabled=False):
            grads = _matmul_backward(ctx, q, k, v, out, kernel_lse, key_lo, key_hi, grad_out, grad_lse)
        return (*grads, None, None, None, None)


def _matmul_backward(ctx, q, k, v, out, lse, key_lo, key_hi, grad_out, grad_lse):
    """The flash backward as five batched fp32 matmuls per chunk, a KV group's query heads stacked as rows.

    Probabilities are recomputed from the forward's lse. Rows are laid out [hkv, N, g] once, so a chunk's
    stacked rows are a view, and dk and dv are one matmul each instead of a matmul and a sum over heads.
    """
    hkv, g, _, dh = q.shape
    f32 = torch.float32

    def rows(x: torch.Tensor) -> torch.Tensor:  # [hkv, g, N, ...] -> [hkv, N, g, ...], fp32
        return x.to(f32).transpose(1, 2).contiguous()

    q_r, go_r = rows(q), rows(grad_out)
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    # delta = rowsum(dO * O) - d lse: the softmax backward's row term, with lse's own gradient folded in.
    delta_r = rows((grad_out.to(f32) * out.to(f32)).sum(-1) - grad_lse)
    lse_r = rows(lse)
    k32, v32 = k.to(f32), v.to(f32)
    dq_r = torch.zeros_like(q_r)
    dk, dv = torch.zeros_like(k32), torch.zeros_like(v32)
    native = attention_row_kernels() if q.device.type == "cpu" and compile_enabled() else None
    key_lo, key_hi = key_lo.contiguous(), key_hi.contiguous()
    for r0, r1, k0, k1 in ctx.chunks:
        if k1 <= k0:
            continue
        c, span = (r1 - r0) * g, k1 - k0
        qc, go = q_r[:, r0:r1].view(hkv, c, dh), go_r[:, r0:r1].view(hkv, c, dh)
        kc, vc = k32[:, k0:k1], v32[:, k0:k1]
        p = torch.bmm(qc, kc.transpose(1, 2))
        ds = torch.bmm(go, vc.transpose(1, 2))
        if native is not None:  # the same two steps, one pass each (csrc/attention_rows.cpp)
            lo, hi, stride = key_lo[r0:r1], key_hi[r0:r1], lse_r.stride(0)
            native[0](p, lse_r[:, r0:r1], lo, hi, hkv, r1 - r0, g, span, stride, k0, ctx.scale)
            native[1](ds, p, delta_r[:, r0:r1], lo, hi, hkv, r1 - r0, g, span, stride, k0)
        else:
            p.mul_(ctx.scale)
            hidden = ~_chunk_visible(key_lo[r0:r1], key_hi[r0:r1], k0, k1)
            p.view(hkv, r1 - r0, g, span).masked_fill_(hidden[None, :, None, :], float("-inf"))
            p.sub_(lse_r[:, r0:r1].reshape(hkv, c, 1)).exp_()
            ds.sub_(delta_r[:, r0:r1].reshape(hkv, c, 1)).mul_(p)
        torch.bmm(ds, kc, out=dq_r[:, r0:r1].view(hkv, c, dh))
        dk[:, k0:k1] += torch.bmm(ds.transpose(1, 2), qc)
        dv[:, k0:k1] += torch.bmm(p.transpose(1, 2), go)
    dq = dq_r.mul_(ctx.scale).transpose(1, 2)
    return dq.to(q.dtype), dk.mul_(ctx.scale).to(k.dtype), dv.to(v.dtype)


_PROBS_ARGS = ("float*", "const float*", "const int64_t*", "const int64_t*", *("int64_t",) * 6, "float")
_DSOFTMAX_ARGS = (
    "float*",
    "const float*",
    "const float*",
    "const int64_t*",
    "const int64_t*",
    *("int64_t",) * 6,
)


def attention_row_kernels() -> tuple[Callable[..., None], ...] | None:
    """The backward's per-chunk probabilities and softmax gradient in C++ (`csrc/attention_rows.cpp`), or
    None where they do not build."""
    return load("attention_rows.cpp", (("ATTN_PROBS", _PROBS_ARGS), ("ATTN_DSOFTMAX", _DSOFTMAX_ARGS)))


def _chunk_visible(lo: torch.Tensor, hi: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
    """[rows, k1 - k0]: whether key k0 + j lies in the row's [lo, hi]."""
    keys = torch.arange(k0, k1, device=lo.device)
    return (keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None])


def _chunk_bias(lo: torch.Tensor, hi: torch.Tensor, k0: int, k1: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, rows, k1 - k0]: 0 where key k0 + j lies in the row's [lo, hi], else -inf."""
    visible = _chunk_visible(lo, hi, k0, k1)
    bias = torch.zeros(visible.shape, dtype=dtype, device=lo.device)
    return bias.masked_fill_(~visible, float("-inf"))[None, None]


def _chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, fused: bool = False
) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    scale = 1.0 / math.sqrt(head_dim)
    p = layout.num_prefix

    q_g = q.view(n, num_kv, group, head_dim).permute(1, 2, 0, 3)  # [hkv, g, N, dh]
    k0 = k[:p].transpose(0, 1)  # [hkv, P, dh]
    v0 = v[:p].transpose(0, 1)
    if fused:
        # bf16's flash kernel only beats fp32 with AMX (measured: without it, equal forward and a
        # slower backward), so elsewhere the kernel runs on fp32 copies of q, k, v (O(N) memory).
        amx = has_amx(q.device)
        dtype = q.dtype if q.dtype == torch.float32 or amx else torch.float32
        out, lse = _FusedPrefixAttention.apply(
            q_g.to(dtype), k0.to(dtype), v0.to(dtype), layout.key_lo, layout.key_hi, layout.chunks, scale
        )
        out = out.to(q.dtype)
    else:
        out, lse = _PrefixAttention.apply(q_g, k0, v0, layout.key_lo, layout.key_hi, layout.chunks, scale)
    out = out.permute(2, 0, 1, 3)  # [N, hkv, g, dh]
    if n == p:
        return out.reshape(n, num_heads, head_dim)

    # Own-chain term for depth>=1 rows: at most max_depth keys each, merged by log-sum-exp.
    table = layout.chain_rows
    valid = table >= 0  # [M, D]
    idx = table.clamp_min(0)
    kc, vc = k[idx], v[idx]  # [M, D, hkv, dh]
    qm = q[p:].view(n - p, num_kv, group, head_dim)
    s = torch.einsum("mkgd,mjkd->mkgj", qm.float(), kc.float()) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse_c = torch.logsumexp(s, dim=-1)  # finite: every depth>=1 row sees itself
    out_c = torch.einsum("mkgj,mjkd->mkgd", torch.softmax(s, dim=-1), vc.float())

    lse_a = lse[:, :, p:].permute(2, 0, 1)  # [M, hkv, g]
    w_a = torch.sigmoid(lse_a - lse_c)[..., None]  # = exp(lse_a - logaddexp(lse_a, lse_c)); safe at -inf
    merged = w_a * out[p:].float() + (1 - w_a) * out_c
    return torch.cat([out[:p], merged.to(q.dtype)]).reshape(n, num_heads, head_dim)


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout
) -> torch.Tensor:
    mask = layout.dense_mask()
    # Rows that see nothing (padding) attend to themselves and are zeroed, to keep SDPA free of NaN.
    empty = ~mask.any(-1)
    mask = mask | torch.diag(empty)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=True,
    )[0].transpose(0, 1)
    return out.masked_fill(empty[:, None, None], 0.0)


@cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def _flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout
) -> torch.Tensor:
    out = _compiled_flex()(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=layout.block_mask(),
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


class CachedLayout(Protocol):
    """The rows of one incremental drafting step, whose keys also include K/V cached by earlier steps
    (`peagle_core.evaluation.draft_cache`): it attends itself, the backend does not apply."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@torch.compiler.disable  # kernels fused by hand, chunked by the layout's plan: a compiled forward calls them
def parallel_group_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout | CachedLayout,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Attention of rows q [N, h, dh] over k, v [N, hkv, dh] under the parallel-group rule.

    `auto` picks FlexAttention on CUDA and the fused flash kernel elsewhere; `chunked` is the fused
    kernel's computation in plain ops; `dense` (SDPA with the full boolean mask) is the reference.
    Padding queries get zeros.
    """
    if not isinstance(layout, AttentionLayout):
        return layout.attend(q, k, v)
    if backend == "auto":
        backend = "flex" if q.is_cuda else "fused"
    if backend == "fused":
        return _chunked_attention(q, k, v, layout, fused=True)
    if backend == "flex":
        return _flex_attention(q, k, v, layout)
    if backend == "dense":
        return _dense_attention(q, k, v, layout)
    if backend == "chunked":
        return _chunked_attention(q, k, v, layout)
    raise ValueError(f"unknown attention backend {backend!r}")
