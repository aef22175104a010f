"""The P-EAGLE drafter: an EAGLE-3 drafter (Llama or Qwen3 layers) that predicts all parallel depths at once,
or, with `method: eagle3`, the same body drafting one token per pass (its forward: peagle_core.model.eagle3).

The math follows vLLM's `llama_eagle3.py` and `qwen3_eagle3.py` (layer 0 attends over [norm(embedding);
hidden_norm(fc(aux))], fused add+norm residuals) so a checkpoint serves as-is; parameter names are the
checkpoint's names.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from peagle_core.model.attention import AttentionLayout, Backend, CachedLayout, parallel_group_attention
from peagle_core.model.config import PEagleConfig
from peagle_core.model.eagle3 import unrolled_forward
from peagle_core.model.layers import (
    MLP,
    RMSNorm,
    TokenEmbedding,
    apply_rotary,
    repeat_last_row,
    rotary_embedding,
)
from peagle_core.model.row_buckets import pad_rows
from peagle_core.model.speculators import read_checkpoint


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
        if config.layer_type == "qwen3":  # Qwen3 attention: RMSNorm over each head of q and k, before RoPE
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: AttentionLayout | CachedLayout,
        backend: Backend,
        expand: int | None = None,
    ) -> torch.Tensor:
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if expand is not None:  # rows with identical inputs were projected once: `expand` rows in all
            q, k, v = (repeat_last_row(t, expand) for t in (q, k, v))
        q, k = apply_rotary(q, k, cos, sin, unsqueeze_dim=1)
        out = parallel_group_attention(q, k, v, layout, backend).flatten(-2)
        # the row count changes every step (COD): o_proj runs on a bucketed count (row_buckets)
        return self.o_proj(pad_rows(out))[: out.shape[0]]


class PEagleDecoderLayer(nn.Module):
    """A Llama decoder layer; layer 0 takes [input_layernorm(embeds); hidden_norm(hidden)] (2H)."""

    def __init__(self, config: PEagleConfig, layer_idx: int):
        super().__init__()
        self.is_first = layer_idx == 0
        self.norm_before_residual = config.norm_before_residual
        h = config.hidden_size
        self.self_attn = PEagleAttention(config, 2 * h if self.is_first else h)
        self.mlp = MLP(h, config.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, eps=config.rms_norm_eps)
        if self.is_first:
            self.hidden_norm = RMSNorm(h, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: AttentionLayout | CachedLayout,
        backend: Backend,
        embeds: torch.Tensor | None = None,
        expand: int | None = None,
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
                residual = repeat_last_row(residual, expand)
        else:
            residual = hidden + residual
            attn = self.self_attn(self.input_layernorm(residual), cos, sin, layout, backend)
        residual = attn + residual
        rows = residual.shape[0]
        return self.mlp(self.post_attention_layernorm(pad_rows(residual)))[:rows], residual


class PEagleDraftModel(nn.Module):
    """P-EAGLE drafter. Persistent tensors are exactly the checkpoint's tensors (docs/architecture.md,
    Checkpoint contract); `forward` returns final-normed hidden states, the objective lives in
    `peagle_core.model.objective`."""

    def __init__(self, config: PEagleConfig):
        super().__init__()
        self.config = config
        h, v, vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        self.embed_tokens = TokenEmbedding(v, h)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.layers = nn.ModuleList(PEagleDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, vd, bias=False)
        # Parallel drafting's input for depths >= 1; EAGLE-3 has none (and vLLM loads none for it).
        self.mask_hidden = nn.Parameter(torch.empty(1, 1, 3 * h)) if config.method == "peagle" else None
        # A full draft vocabulary keeps the identity map, which checkpoints leave out (vLLM has no tensor for it).
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long), persistent=vd != v)
        self.register_buffer("t2d", torch.zeros(v, dtype=torch.bool), persistent=vd != v)
        self.rotary_emb = rotary_embedding(
            config.head_dim, dict(config.rope_parameters), config.to_llama_config
        )
        self.attention_backend: Backend = "auto"
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=std)
        if self.mask_hidden is not None:
            nn.init.normal_(self.mask_hidden, std=std)
        self.d2t.zero_()  # identity map until the data's vocab map is set
        self.t2d.zero_()
        self.t2d[: self.config.draft_vocab_size] = True

    # ------------------------------------------------------------------ setup from the data and verifier

    @torch.no_grad()
    def set_vocab_map(self, t2d: torch.Tensor, d2t: torch.Tensor) -> None:
        """Set the draft vocabulary: draft id i is verifier id `i + d2t[i]`; `t2d` marks those ids."""
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        if d2t.numel() != vd or t2d.numel() != v:
            raise ValueError(f"vocab map sizes d2t={d2t.numel()}, t2d={t2d.numel()}; expected {vd}, {v}")
        self.d2t.copy_(d2t.to(torch.long))
        self.t2d.copy_(t2d.to(torch.bool))

    def verifier_ids(self) -> torch.Tensor:
        """The verifier id of every draft id, [draft_vocab_size]."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def init_embeddings(self, verifier_embed_weight: torch.Tensor) -> None:
        """Start the (trainable) token embeddings from the verifier's."""
        if tuple(verifier_embed_weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"verifier embedding shape {tuple(verifier_embed_weight.shape)} != "
                f"{tuple(self.embed_tokens.weight.shape)}"
            )
        self.embed_tokens.weight.copy_(verifier_embed_weight)

    @torch.no_grad()
    def init_lm_head(self, verifier_lm_head_weight: torch.Tensor) -> None:
        """Start the lm_head from the verifier's lm_head rows of the draft vocabulary (set the map first)."""
        ids = self.verifier_ids().to(verifier_lm_head_weight.device)
        self.lm_head.weight.copy_(verifier_lm_head_weight.detach()[ids])

    # ------------------------------------------------------------------ the forward pass

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        anchor_pos: torch.Tensor,
        depth: torch.Tensor,
    ) -> torch.Tensor:
        """Final-normed hidden states [N, H] of rows (anchor_pos, depth) of one flat sequence.

        hidden_states [T, 3H], input_ids/position_ids/document_ids [T]. Depth-0 rows come first and
        cover a contiguous anchor range; they see the real token and hidden state, deeper rows the
        mask token and `mask_hidden`, at rotary position `position_ids[anchor] + depth`. With method eagle3,
        depth is the training-time-test step (`peagle_core.model.eagle3.unrolled_forward`).
        """
        if self.mask_hidden is None:
            return unrolled_forward(
                self, hidden_states, input_ids, position_ids, document_ids, anchor_pos, depth
            )
        layout = AttentionLayout.build(anchor_pos, depth, document_ids, self.config.num_attention_heads)
        start, count = layout.prefix_start, layout.num_prefix
        real = slice(start, start + count)
        mask_id = torch.tensor([self.config.mask_token_id], device=input_ids.device)
        # Every deeper row has the same inputs: embed and project them once, expand inside layer 0.
        embeds = self.embed_tokens(torch.cat([input_ids[real], mask_id]))
        hidden = self.fc(
            torch.cat([hidden_states[real], self.mask_hidden.view(1, -1).to(hidden_states.dtype)])
        )
        expand = depth.numel()  # the deeper rows repeat the last projected row

        positions = position_ids[anchor_pos] + depth
        cos, sin = self.rotary_emb(hidden, positions[None])
        cos, sin = cos[0], sin[0]

        backend = self.attention_backend
        hidden, residual = self.layers[0](
            hidden, None, cos, sin, layout, backend, embeds=embeds, expand=expand
        )
        for layer in self.layers[1:]:
            hidden, residual = layer(hidden, residual, cos, sin, layout, backend)
        return self.norm(hidden + residual)

    # ------------------------------------------------------------------ inference

    @torch.no_grad()
    def draft(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        k: int | None = None,
    ) -> torch.Tensor:
        """Propose k tokens per sequence in one pass (verifier vocabulary), like vLLM's parallel drafting;
        with method eagle3, in k passes, each reading the previous draft, like vLLM's EAGLE-3 drafting.

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
        inputs = (hidden_states.reshape(flat, -1), input_ids.flatten(), positions, docs, anchor_pos, depth)
        out = (
            self(*inputs) if self.mask_hidden is not None else unrolled_forward(self, *inputs, feed="greedy")
        )
        rows = torch.cat([last, flat + torch.arange((k - 1) * batch, device=device)])
        draft_ids = self.lm_head(out[rows]).argmax(-1).view(k, batch).T
        return self.verifier_ids()[draft_ids]

    # ------------------------------------------------------------------ checkpoints

    @classmethod
    def from_pretrained(cls, path: str | Path) -> PEagleDraftModel:
        """Load a speculators checkpoint directory (names and shapes checked; CheckpointError if wrong)."""
        config, state = read_checkpoint(path)
        model = cls(config)
        model.load_state_dict(state)
        return model
