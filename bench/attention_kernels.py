"""Parallel-group attention alone: forward and backward seconds per kernel and backward, at a real shape.

`fused` (the flash kernel's forward, batched-matmul backward) next to the plain-op `chunked` path, one JSON
line per (backend, dtype); rows come from COD sampling as training samples them.

    python bench/attention_kernels.py --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import emit

from peagle_core.model.attention import AttentionLayout, parallel_group_attention
from peagle_core.model.cod import sample_cod_indices
from peagle_core.model.precision import cpu_flags

BACKENDS = ("fused", "chunked")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=8, help="packed documents")
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--depths", type=int, default=4)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    parser.add_argument("--repeats", type=int, default=4, help="timed passes; the fastest is reported")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    docs = torch.arange(args.docs).repeat_interleave(args.doc_len)
    anchor, depth = sample_cod_indices(
        docs.numel(), torch.ones_like(docs), args.depths, 0.7, 0.2, generator=g, document_ids=docs
    )
    layout = AttentionLayout.build(anchor, depth, docs, args.heads)
    n = anchor.numel()
    flags = cpu_flags()
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        q = torch.randn(n, args.heads, args.head_dim, generator=g).to(dtype).requires_grad_()
        k = torch.randn(n, args.kv_heads, args.head_dim, generator=g).to(dtype).requires_grad_()
        v = torch.randn(n, args.kv_heads, args.head_dim, generator=g).to(dtype).requires_grad_()
        probe = torch.randn(n, args.heads, args.head_dim, generator=g)
        for backend in BACKENDS:
            forward_s, backward_s = [], []
            for i in range(args.repeats + 1):  # the first pass warms caches and is dropped
                t0 = time.perf_counter()
                out = parallel_group_attention(q, k, v, layout, backend)
                t1 = time.perf_counter()
                torch.autograd.grad((out.float() * probe).sum(), (q, k, v))
                t2 = time.perf_counter()
                if i:
                    forward_s.append(t1 - t0)
                    backward_s.append(t2 - t1)
            emit(
                metric="attention_kernel",
                backend=backend,
                dtype=dtype_name,
                rows=n,
                chunks=len(layout.chunks),
                forward_s=round(min(forward_s), 4),
                backward_s=round(min(backward_s), 4),
                amx="amx_bf16" in flags,
                avx512_bf16="avx512_bf16" in flags,
            )


if __name__ == "__main__":
    main()
