"""The drafter's Llama building blocks (token embedding, RMSNorm, SwiGLU MLP, rotary embedding), written out so that
importing the model costs torch alone, not transformers (issue 24: 4,164 modules, +336 MB per process).

They compute exactly what transformers' `modeling_llama` computes, parameter names included, so
checkpoints and vLLM see the same weights (tests/core/model/test_layers.py compares them). A rotary scaling
other than the default (llama3, yarn, ...) takes transformers' own implementation, imported only then.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)  # the variance in fp32 whatever the activations' dtype
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


@torch.library.custom_op("peagle::embedding", mutates_args=())
def _embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


@_embedding.register_fake
def _(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return weight.new_empty((*ids.shape, weight.shape[1]))


@torch.library.custom_op("peagle::embedding_backward", mutates_args=())
def _embedding_backward(grad: torch.Tensor, ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    return torch.ops.aten.embedding_dense_backward(grad, ids, num_embeddings, -1, False)


@_embedding_backward.register_fake
def _(grad: torch.Tensor, ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    return grad.new_empty((num_embeddings, grad.shape[-1]))


def _embedding_setup(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    weight, ids = inputs
    ctx.save_for_backward(ids)
    ctx.num_embeddings = weight.shape[0]


def _embedding_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    (ids,) = ctx.saved_tensors
    return _embedding_backward(grad, ids, ctx.num_embeddings), None


_embedding.register_autograd(_embedding_grad, setup_context=_embedding_setup)


class TokenEmbedding(nn.Embedding):
    """nn.Embedding whose weight gradient is ATen's dense kernel even inside a compiled forward.

    Inductor decomposes that gradient into a scatter of atomic float adds over the rows' ids, so a
    compiled training step summed a repeated id's rows in a different order on every run (20 distinct
    gradients in 20 identical calls). ATen's kernel sums them in a fixed order, and is faster: 5.7 ms
    against 9.9 ms for lookup and gradient at SmolLM2's shape on 2 cores. As custom ops, the lookup and
    its gradient stay opaque to the compiler."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _embedding(self.weight, ids)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    """cos/sin of the default RoPE for `position_ids` (the inverse frequencies are not saved)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(
            x.dtype
        )


def rotary_embedding(head_dim: int, rope_parameters: dict[str, Any], llama_config: Any) -> nn.Module:
    """Ours for the default RoPE; transformers' for a scaled one (`llama_config()` builds its config)."""
    if rope_parameters.get("rope_type", "default") == "default":
        return RotaryEmbedding(head_dim, float(rope_parameters["rope_theta"]))
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(llama_config())


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class _RepeatLastRow(torch.autograd.Function):
    """Rows [0, c) as they are, then row c repeated `rows - c` times; the backward sums the repeats'
    gradients into row c. Indexing with `[0..c-1, c, c, ...]` computes the same, but its backward is an
    accumulating scatter (sort and all): ~30 ms of a SmolLM2 step on 2 AMX cores against ~3 ms here."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int) -> torch.Tensor:
        c = x.shape[0] - 1
        ctx.last = c
        return torch.cat([x[:c], x[c:].expand(rows - c, *x.shape[1:])])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        c = ctx.last
        return torch.cat([grad[:c], grad[c:].sum(0, keepdim=True, dtype=torch.float32).to(grad.dtype)]), None


def repeat_last_row(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` [c + 1, ...] -> [rows, ...]: its first c rows, then its last row `rows - c` times (layer 0's
    deeper rows, whose inputs are all the same mask token and hidden state, projected once)."""
    if rows < x.shape[0] - 1:
        raise ValueError(f"repeat_last_row: {rows} rows from {x.shape[0]}")
    return _RepeatLastRow.apply(x, rows)
