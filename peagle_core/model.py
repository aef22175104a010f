"""The P-EAGLE drafter: an EAGLE-3 Llama drafter that predicts all parallel depths in one pass.

The math follows vLLM's `llama_eagle3.py` (layer 0 attends over [norm(embedding); hidden_norm(fc(aux))],
fused add+norm residuals) so a checkpoint serves as-is; parameter names are the checkpoint's names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from peagle_core.attention import AttentionLayout, Backend, parallel_group_attention
from peagle_core.cod import sample_cod_indices
from peagle_core.loss import fused_kl_loss
from peagle_core.spec import default_layer_ids


class PEagleConfig(BaseModel):
    """Shape of the drafter (from the verifier) plus the P-EAGLE settings."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    intermediate_size: int = Field(ge=1)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope_parameters: dict[str, Any] = Field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    max_position_embeddings: int = Field(default=8192, ge=1)
    vocab_size: int = Field(ge=2)
    draft_vocab_size: int = Field(ge=2)
    num_layers: int = Field(default=4, ge=1)
    num_depths: int = Field(default=4, ge=1)
    down_sample_ratio: float = Field(default=0.7, gt=0, le=1)
    down_sample_ratio_min: float = Field(default=0.2, ge=0, le=1)
    max_anchors: int | None = Field(default=None, ge=1)
    aux_layer_ids: list[int] = Field(default_factory=list)
    mask_token_id: int = Field(ge=0)
    norm_before_residual: bool = True
    verifier_name_or_path: str | None = None
    verifier_architectures: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> PEagleConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError("draft_vocab_size must not exceed vocab_size")
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary ({self.vocab_size})"
            )
        if "rope_type" not in self.rope_parameters or "rope_theta" not in self.rope_parameters:
            raise ValueError("rope_parameters needs 'rope_type' and 'rope_theta'")
        return self

    @classmethod
    def from_verifier(cls, hf_config: Any, **overrides: Any) -> PEagleConfig:
        """Shape from a verifier's HF config (text part); P-EAGLE settings from `overrides`.

        Defaults: aux layers [2, L//2, L-3], draft vocab min(32000, vocab), mask token = the pad token
        (else the last id) — the data pipeline normally passes the one it reserved.
        """
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        hidden = text.hidden_size
        heads = text.num_attention_heads
        num_layers = text.num_hidden_layers
        rope = getattr(text, "rope_parameters", None)
        if not rope:
            rope = dict(getattr(text, "rope_scaling", None) or {})
            rope.setdefault("rope_type", rope.pop("type", "default"))
            rope.setdefault("rope_theta", getattr(text, "rope_theta", 10000.0))
        pad = getattr(text, "pad_token_id", None)
        values: dict[str, Any] = {
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
            "head_dim": getattr(text, "head_dim", None) or hidden // heads,
            "intermediate_size": text.intermediate_size,
            "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
            "rope_parameters": dict(rope),
            "max_position_embeddings": getattr(text, "max_position_embeddings", 8192),
            "vocab_size": text.vocab_size,
            "draft_vocab_size": min(32000, text.vocab_size),
            "aux_layer_ids": default_layer_ids(num_layers),
            "mask_token_id": pad if pad is not None else text.vocab_size - 1,
            "verifier_name_or_path": getattr(text, "_name_or_path", None) or None,
            "verifier_architectures": list(getattr(hf_config, "architectures", None) or []),
        }
        values.update(overrides)
        if values["draft_vocab_size"] is None:  # null means the full vocabulary
            values["draft_vocab_size"] = text.vocab_size
        values["draft_vocab_size"] = min(values["draft_vocab_size"], text.vocab_size)
        return cls(**values)

    def to_llama_config(self) -> LlamaConfig:
        """The Llama config of the drafter's decoder layers (also the checkpoint's transformer_layer_config)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=self.num_layers,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
        )


@dataclass
class DraftOutput:
    """`loss` (scalar, differentiable) and `metrics` (0-dim tensors: loss, acc_{d}, positions_{d}).

    With `return_logits=True`, `logits` [N, draft_vocab] for every row with its `anchor_pos`/`depth`.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    logits: torch.Tensor | None = None
    anchor_pos: torch.Tensor | None = None
    depth: torch.Tensor | None = None


class PEagleAttention(nn.Module):
    """GQA self-attention with RoPE over parallel-group rows; layer 0 reads a 2H input."""

    def __init__(self, config: PEagleConfig, input_size: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: AttentionLayout,
        backend: Backend,
        expand: torch.Tensor | None = None,
    ) -> torch.Tensor:
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if expand is not None:  # rows with identical inputs were projected once
            q, k, v = q[expand], k[expand], v[expand]
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        out = parallel_group_attention(q, k, v, layout, backend)
        return self.o_proj(out.flatten(-2))


class PEagleDecoderLayer(nn.Module):
    """A Llama decoder layer; layer 0 takes [input_layernorm(embeds); hidden_norm(hidden)] (2H)."""

    def __init__(self, config: PEagleConfig, layer_idx: int):
        super().__init__()
        self.is_first = layer_idx == 0
        self.norm_before_residual = config.norm_before_residual
        h = config.hidden_size
        self.self_attn = PEagleAttention(config, 2 * h if self.is_first else h)
        self.mlp = LlamaMLP(config.to_llama_config())
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        if self.is_first:
            self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: AttentionLayout,
        backend: Backend,
        embeds: torch.Tensor | None = None,
        expand: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_first:
            embeds = self.input_layernorm(embeds)
            if self.norm_before_residual:
                hidden = self.hidden_norm(hidden)
                residual = hidden
            else:
                residual = hidden
                hidden = self.hidden_norm(hidden)
            x = torch.cat([embeds, hidden], dim=-1)
            attn = self.self_attn(x, cos, sin, layout, backend, expand=expand)
            if expand is not None:
                residual = residual[expand]
        else:
            residual = hidden + residual
            attn = self.self_attn(self.input_layernorm(residual), cos, sin, layout, backend)
        residual = attn + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


class PEagleDraftModel(nn.Module):
    """P-EAGLE drafter. Persistent tensors are exactly the §6 checkpoint tensors."""

    def __init__(self, config: PEagleConfig):
        super().__init__()
        self.config = config
        h, v, vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        self.embed_tokens = nn.Embedding(v, h)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.layers = nn.ModuleList(PEagleDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.mask_hidden = nn.Parameter(torch.empty(1, 1, 3 * h))
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(v, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(config.to_llama_config())
        # The verifier's frozen final norm and lm_head rows of the draft vocab: the teacher. Not saved.
        self.register_buffer("verifier_norm_weight", torch.ones(h), persistent=False)
        self.register_buffer("verifier_lm_head", torch.zeros(vd, h), persistent=False)
        self.verifier_norm_eps = config.rms_norm_eps
        self.has_verifier_head = False
        self.attention_backend: Backend = "auto"
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=std)
        nn.init.normal_(self.mask_hidden, std=std)
        self.d2t.zero_()  # identity map until the data's vocab map is loaded
        self.t2d.zero_()
        self.t2d[: self.config.draft_vocab_size] = True

    # ------------------------------------------------------------------ setup from the verifier

    @torch.no_grad()
    def load_verifier_head(
        self,
        final_norm: nn.Module,
        lm_head_weight: torch.Tensor,
        t2d: torch.Tensor,
        d2t: torch.Tensor,
        init_lm_head: bool = False,
    ) -> None:
        """Copy the verifier's final RMSNorm and the draft-vocab rows of its lm_head (frozen teacher),
        and set the vocab map. `init_lm_head` also starts the drafter's lm_head from those rows."""
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        if d2t.numel() != vd or t2d.numel() != v:
            raise ValueError(f"vocab map sizes d2t={d2t.numel()}, t2d={t2d.numel()}; expected {vd}, {v}")
        weight = getattr(final_norm, "weight", None)
        if weight is None:
            raise ValueError("the verifier's final norm has no 'weight'")
        eps = getattr(final_norm, "variance_epsilon", None) or getattr(final_norm, "eps", None)
        self.verifier_norm_eps = float(eps or self.config.rms_norm_eps)
        self.d2t.copy_(d2t.to(torch.long))
        self.t2d.copy_(t2d.to(torch.bool))
        target_ids = torch.arange(vd, device=d2t.device) + d2t.to(torch.long)
        rows = lm_head_weight.detach()[target_ids.to(lm_head_weight.device)]
        self.verifier_norm_weight.copy_(weight.detach().float())
        self.verifier_lm_head.copy_(rows.float())
        if init_lm_head:
            self.lm_head.weight.copy_(rows)
        self.has_verifier_head = True

    @torch.no_grad()
    def init_embeddings(self, verifier_embed_weight: torch.Tensor) -> None:
        """Start the (trainable) token embeddings from the verifier's."""
        if tuple(verifier_embed_weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"verifier embedding shape {tuple(verifier_embed_weight.shape)} != "
                f"{tuple(self.embed_tokens.weight.shape)}"
            )
        self.embed_tokens.weight.copy_(verifier_embed_weight)

    # ------------------------------------------------------------------ the shared trunk

    def _trunk(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        anchor_pos: torch.Tensor,
        depth: torch.Tensor,
    ) -> torch.Tensor:
        """Pre-final-norm output for rows (anchor_pos, depth) of one flat sequence.

        hidden_states [T, 3H], input_ids/position_ids/document_ids [T]. Depth-0 rows come first and
        cover a contiguous anchor range; they see the real token and hidden state, deeper rows the
        mask token and `mask_hidden`.
        """
        layout = AttentionLayout.build(anchor_pos, depth, document_ids, self.config.num_attention_heads)
        start, count = layout.prefix_start, layout.num_prefix
        real = slice(start, start + count)
        mask_id = torch.tensor([self.config.mask_token_id], device=input_ids.device)
        # Every deeper row has the same inputs: embed and project them once, expand inside layer 0.
        embeds = self.embed_tokens(torch.cat([input_ids[real], mask_id]))
        hidden = self.fc(
            torch.cat([hidden_states[real], self.mask_hidden.view(1, -1).to(hidden_states.dtype)])
        )
        expand = torch.cat(
            [torch.arange(count, device=depth.device), depth.new_full((depth.numel() - count,), count)]
        )

        positions = position_ids[anchor_pos] + depth
        cos, sin = self.rotary_emb(hidden, positions[None])
        cos, sin = cos[0], sin[0]

        backend = self.attention_backend
        hidden, residual = self.layers[0](
            hidden, None, cos, sin, layout, backend, embeds=embeds, expand=expand
        )
        for layer in self.layers[1:]:
            hidden, residual = layer(hidden, residual, cos, sin, layout, backend)
        return hidden + residual

    # ------------------------------------------------------------------ training

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        verifier_last_hidden_states: torch.Tensor,
        loss_mask: torch.Tensor,
        document_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        cod: tuple[torch.Tensor, torch.Tensor] | None = None,
        segment: tuple[int, int] | None = None,
        return_logits: bool = False,
    ) -> DraftOutput:
        """Loss and metrics on one packed, aligned batch ([1, T] fields; see docs/interfaces.md).

        `cod` reuses precomputed `(anchor_pos, depth)`; `segment=(s, S)` runs only anchors in the s-th
        of S contiguous ranges, weighted so the S segment losses (and metrics) sum to the whole's.
        """
        if input_ids.shape[0] != 1:
            raise ValueError(f"training batches are packed to batch size 1, got {input_ids.shape[0]}")
        if not self.has_verifier_head:
            raise RuntimeError("call load_verifier_head() before training: the teacher head is missing")
        seq_len = input_ids.shape[1]
        device = input_ids.device
        docs = document_ids[0].to(torch.long)
        loss_mask = loss_mask[0].to(torch.long) * (docs >= 0)
        positions = _default_positions(docs) if position_ids is None else position_ids[0].to(torch.long)
        cfg = self.config
        if cod is None:
            cod = sample_cod_indices(
                seq_len,
                loss_mask,
                cfg.num_depths,
                cfg.down_sample_ratio,
                cfg.down_sample_ratio_min,
                cfg.max_anchors,
                generator=generator,
                document_ids=docs,
            )
        anchor_pos, depth = cod[0].to(device), cod[1].to(device)
        target = anchor_pos + depth
        counts = torch.bincount(depth[_is_loss_target(loss_mask, target)], minlength=cfg.num_depths)
        active_depths = (counts > 0).sum().clamp_min(1)

        if segment is not None:
            anchor_pos, depth = _segment_rows(anchor_pos, depth, docs, *segment)
            target = anchor_pos + depth
            lo, hi = _segment_bounds(seq_len, *segment)
            in_segment = (anchor_pos >= lo) & (anchor_pos < hi)
        else:
            in_segment = torch.ones_like(anchor_pos, dtype=torch.bool)

        if anchor_pos.numel() == 0:  # an empty segment contributes nothing
            zero = self.lm_head.weight.sum() * 0.0
            empty = {"loss": zero.detach()} | {
                f"{m}_{d}": zero.detach() for m in ("acc", "positions") for d in range(cfg.num_depths)
            }
            return DraftOutput(zero, empty, None, anchor_pos, depth)
        out = self._trunk(hidden_states[0], input_ids[0], positions, docs, anchor_pos, depth)
        is_loss = in_segment & _is_loss_target(loss_mask, target)
        rows = torch.nonzero(is_loss).flatten()
        row_depth = depth[rows]
        # Each depth weighs the same: mean KL per depth (global counts), averaged over depths.
        weight = 1.0 / (counts[row_depth].float() * active_depths)
        teacher = _rms_norm(verifier_last_hidden_states[0], self.verifier_norm_weight, self.verifier_norm_eps)
        result = fused_kl_loss(
            self.norm(out[rows]), self.lm_head.weight, teacher, self.verifier_lm_head, target[rows], weight
        )

        metrics: dict[str, torch.Tensor] = {"loss": result.loss.detach()}
        seg_counts = torch.bincount(row_depth, minlength=cfg.num_depths)
        seg_correct = torch.bincount(row_depth, weights=result.correct.float(), minlength=cfg.num_depths)
        for d in range(cfg.num_depths):
            metrics[f"acc_{d}"] = seg_correct[d] / counts[d].clamp_min(1)
            metrics[f"positions_{d}"] = seg_counts[d]
        logits = self.lm_head(self.norm(out)) if return_logits else None
        return DraftOutput(result.loss, metrics, logits, anchor_pos, depth)

    # ------------------------------------------------------------------ inference

    @torch.no_grad()
    def draft(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        k: int | None = None,
    ) -> torch.Tensor:
        """Propose k tokens per sequence in one pass (verifier vocabulary), like vLLM's parallel drafting.

        hidden_states [B, T, 3H], input_ids [B, T] aligned; depth 0 sits at each row's last real position,
        depths 1..k-1 are mask positions continuing its positions. Sequences are packed as documents.
        """
        k = self.config.num_depths if k is None else int(k)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        batch, seq_len = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        real = attention_mask.to(torch.bool)
        if not bool(real.any(-1).all()):
            raise ValueError("every sequence needs at least one real position")
        docs = torch.where(real, torch.arange(batch, device=device)[:, None], -1).flatten()
        positions = (real.long().cumsum(-1) - 1).clamp_min(0).flatten()
        idx = torch.arange(seq_len, device=device)
        last = torch.where(real, idx, -1).amax(-1) + idx.new_tensor(seq_len) * torch.arange(
            batch, device=device
        )

        flat = batch * seq_len
        anchor_pos = torch.cat([torch.arange(flat, device=device), last.repeat(k - 1)])
        depth = torch.cat([idx.new_zeros(flat), torch.arange(1, k, device=device).repeat_interleave(batch)])
        out = self._trunk(
            hidden_states.reshape(flat, -1), input_ids.flatten(), positions, docs, anchor_pos, depth
        )
        rows = torch.cat([last, flat + torch.arange((k - 1) * batch, device=device)])
        draft_ids = self.lm_head(self.norm(out[rows])).argmax(-1).view(k, batch).T
        return draft_ids + self.d2t[draft_ids]

    # ------------------------------------------------------------------ checkpoints

    def save_pretrained(self, out_dir: str | Path, extra_config: dict[str, Any] | None = None) -> Path:
        """Write the §6 checkpoint directory (atomically; via peagle_core.export)."""
        from peagle_core.export import write_pretrained

        return write_pretrained(self, out_dir, extra_config=extra_config)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> PEagleDraftModel:
        """Load a §6 directory written by `save_pretrained` (validated first)."""
        from peagle_core.export import config_kwargs, read_pretrained

        cfg, state = read_pretrained(path)
        model = cls(PEagleConfig(**config_kwargs(cfg)))
        model.load_state_dict(state)
        return model


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * weight.float()).to(weight.dtype)


def _is_loss_target(loss_mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Rows whose target lies inside the sequence on a loss position (rows past the end never count)."""
    inside = target < loss_mask.numel()
    return inside & (loss_mask[target.clamp_max(loss_mask.numel() - 1)] == 1)


def _run_starts(docs: torch.Tensor) -> torch.Tensor:
    """For every position, the index where its document run begins."""
    pos = torch.arange(docs.numel(), device=docs.device)
    changed = torch.ones_like(docs, dtype=torch.bool)
    changed[1:] = docs[1:] != docs[:-1]
    return torch.cummax(torch.where(changed, pos, 0), dim=0).values


def _default_positions(docs: torch.Tensor) -> torch.Tensor:
    """Rotary positions restarting at 0 at every document boundary."""
    return torch.arange(docs.numel(), device=docs.device) - _run_starts(docs)


def _segment_bounds(seq_len: int, s: int, num_segments: int) -> tuple[int, int]:
    if not 0 <= s < num_segments:
        raise ValueError(f"segment index {s} outside 0..{num_segments - 1}")
    return s * seq_len // num_segments, (s + 1) * seq_len // num_segments


def _segment_rows(
    anchor_pos: torch.Tensor, depth: torch.Tensor, docs: torch.Tensor, s: int, num_segments: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of segment s: its deeper rows, plus depth-0 rows from its first anchor's document start
    (the keys its queries need, recomputed with grad) up to its end."""
    lo, hi = _segment_bounds(docs.numel(), s, num_segments)
    first = int(_run_starts(docs)[lo]) if lo < hi else hi
    keep = torch.where(
        depth == 0, (anchor_pos >= first) & (anchor_pos < hi), (anchor_pos >= lo) & (anchor_pos < hi)
    )
    return anchor_pos[keep], depth[keep]
