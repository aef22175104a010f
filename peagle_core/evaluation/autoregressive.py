"""Incremental EAGLE-3 drafting, as vLLM drafts with an EAGLE-3 checkpoint: one pass per token.

Each round first extends the drafter's cache with the newly accepted rows (`draft_cache.extend`); the
last row's output gives draft 1. Draft j + 1 then reads draft j's token and the pre-norm output of
draft j's pass, one position further on, attending over the cache and the round's earlier drafts. The
drafts' K/V are dropped after the round: the verifier decides which tokens become cached rows.
Same rule as training-time test (peagle_core.model.eagle3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from peagle_core.evaluation.draft_cache import DraftCache, extend

if TYPE_CHECKING:
    from peagle_core.model.drafter import PEagleDraftModel


class _DraftLayout:
    """One layer's attention for one draft pass: one query per sequence over the cache (its real rows),
    the round's earlier drafts and itself (`peagle_core.model.attention.CachedLayout`)."""

    def __init__(self, cache: DraftCache, layer: int, drafts: list[tuple[torch.Tensor, torch.Tensor]]):
        self.cache, self.layer, self.drafts = cache, layer, drafts

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, heads, head_dim = q.shape
        q, k, v = (t.view(batch, 1, t.shape[1], head_dim).transpose(1, 2) for t in (q, k, v))
        self.drafts.append((k, v))
        keys = torch.cat([self.cache.keys[self.layer], *(d[0] for d in self.drafts)], dim=2)
        values = torch.cat([self.cache.values[self.layer], *(d[1] for d in self.drafts)], dim=2)
        own = torch.ones(batch, len(self.drafts), dtype=torch.bool, device=q.device)
        mask = torch.cat([self.cache.mask, own], dim=1)[:, None, None, :]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(batch, heads, head_dim)


@torch.no_grad()
def eagle3_draft_step(
    drafter: PEagleDraftModel,
    cache: DraftCache,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    real: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """Propose k tokens per sequence (verifier ids, [B, k]) after adding its newly accepted rows, one
    pass per token; arguments as `draft_cache.draft_step`. Updates `cache` in place (accepted rows only)."""
    normed, prenorm = extend(drafter, cache, hidden_states, input_ids, real)
    normed, hidden = normed[:, -1], prenorm[:, -1]  # left-padded: the last column is every row's last
    last = cache.lengths - 1  # the position of each sequence's last cached row
    drafts = [drafter.verifier_ids()[drafter.lm_head(normed).argmax(-1)]]
    per_layer: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in drafter.layers]
    for j in range(1, k):
        cos, sin = drafter.rotary_emb(hidden, (last + j).view(1, -1))
        cos, sin = cos[0], sin[0]
        layouts = [_DraftLayout(cache, i, per_layer[i]) for i in range(len(drafter.layers))]
        h, residual = drafter.layers[0](
            hidden, None, cos, sin, layouts[0], "auto", embeds=drafter.embed_tokens(drafts[-1])
        )
        for layer, layout in zip(drafter.layers[1:], layouts[1:], strict=True):
            h, residual = layer(h, residual, cos, sin, layout, "auto")
        hidden = h + residual
        drafts.append(drafter.verifier_ids()[drafter.lm_head(drafter.norm(hidden)).argmax(-1)])
    return torch.stack(drafts, dim=1)
