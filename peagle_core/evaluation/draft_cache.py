"""Incremental parallel drafting: the drafter's depth-0 K/V cached across speculative steps (`extend` also
starts each EAGLE-3 drafting round, peagle_core.evaluation.autoregressive).

A depth-0 row (hidden state of token t beside the id of token t+1) only ever sees earlier depth-0 rows,
and it exists only once both tokens are accepted, so its keys and values never change: each step
computes the newly accepted rows and the K-1 mask rows, and attends over the cache plus those.
Same layers and same visibility rule as `PEagleDraftModel.draft` (peagle_core.model.attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from peagle_core.model.drafter import PEagleDraftModel


class DraftCache:
    """Per layer, K/V [B, hkv, L, dh] (after RoPE) of every sequence's depth-0 rows, with the [B, L]
    mask of real entries (steps append left-padded rows) and each sequence's row count."""

    def __init__(self, num_layers: int, batch: int, device: torch.device):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.mask = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the sequences `rows` (finished ones leave the batch)."""
        self.keys = [t[rows] if t is not None else None for t in self.keys]
        self.values = [t[rows] if t is not None else None for t in self.values]
        self.mask, self.lengths = self.mask[rows], self.lengths[rows]


class _StepLayout:
    """One layer's attention in one step: queries [new depth-0 rows; mask rows] over cache + themselves.

    Implements `peagle_core.model.attention.CachedLayout`; the new depth-0 rows' K/V join the cache after
    the step (`commit`), the mask rows' never do.
    """

    def __init__(self, cache: DraftCache, layer: int, batch: int, num_new: int, mask: torch.Tensor):
        self.cache, self.layer = cache, layer
        self.batch, self.num_new = batch, num_new
        self.mask = mask  # [B, 1, Q, L + Q]
        self.new_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, heads, head_dim = q.shape
        q, k, v = (
            t.view(self.batch, n // self.batch, t.shape[1], head_dim).transpose(1, 2) for t in (q, k, v)
        )
        self.new_kv = (k[:, :, : self.num_new], v[:, :, : self.num_new])
        past_k, past_v = self.cache.keys[self.layer], self.cache.values[self.layer]
        if past_k is not None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(n, heads, head_dim)


def _step_mask(cache_mask: torch.Tensor, real: torch.Tensor, k: int) -> torch.Tensor:
    """[B, 1, Q, L+Q] visibility of the step's Q = R + k-1 queries (R new depth-0 rows, left-padded, then
    depths 1..k-1 anchored at the last one) over the L cached rows and the Q rows themselves."""
    batch, num_new = real.shape
    q = num_new + k - 1
    idx = torch.arange(q, device=real.device)
    is_new = idx < num_new
    # depth-0 query j sees new depth-0 rows <= j; mask rows see every new depth-0 row and their chain
    own = torch.where(
        is_new[:, None],
        is_new[None, :] & (idx[None, :] <= idx[:, None]),
        is_new[None, :] | (idx[None, :] <= idx[:, None]),
    )
    key_real = torch.cat([real, torch.ones(batch, k - 1, dtype=torch.bool, device=real.device)], dim=1)
    own = own[None] & key_real[:, None, :]
    own = own | torch.eye(q, dtype=torch.bool, device=real.device)  # padding rows see themselves: no NaN
    past = cache_mask[:, None, :].expand(batch, q, cache_mask.shape[1])
    return torch.cat([past, own], dim=-1)[:, None]


@torch.no_grad()
def draft_step(
    drafter: PEagleDraftModel,
    cache: DraftCache,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    real: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """Propose k tokens per sequence (verifier ids, [B, k]) after adding its newly accepted depth-0 rows.

    hidden_states [B, R, 3H] and input_ids [B, R] are those rows, aligned and left-padded (`real` [B, R]
    marks them; every sequence has at least one). Updates `cache` in place.
    """
    out, _ = extend(drafter, cache, hidden_states, input_ids, real, k)
    draft_ids = drafter.lm_head(out[:, input_ids.shape[1] - 1 :]).argmax(-1)
    return drafter.verifier_ids()[draft_ids]


def extend(
    drafter: PEagleDraftModel,
    cache: DraftCache,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    real: torch.Tensor,
    k: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the newly accepted depth-0 rows (and, for k > 1, the K-1 mask rows after each sequence's last)
    over the cache, add the depth-0 rows' K/V to it, and return the rows' final-normed and pre-norm hidden
    states, [B, R + k - 1, H] each (left-padded as the input)."""
    cfg = drafter.config
    batch, num_new = input_ids.shape
    device = input_ids.device
    real = real.to(torch.bool)
    counts = real.sum(-1)
    # positions continue each sequence's cached rows; padding gets the first one (it is never seen)
    col = torch.arange(num_new, device=device)
    positions = cache.lengths[:, None] + (col[None, :] - (num_new - counts)[:, None]).clamp_min(0)
    last = cache.lengths + counts - 1
    positions = torch.cat([positions, last[:, None] + torch.arange(1, k, device=device)], dim=1)

    ids, hidden = input_ids, hidden_states
    if k > 1:  # P-EAGLE's mask rows (an EAGLE-3 drafter, which has no mask_hidden, extends with k = 1)
        mask_ids = input_ids.new_full((batch, k - 1), cfg.mask_token_id)
        mask_hidden = drafter.mask_hidden.to(hidden_states.dtype).expand(batch, k - 1, -1)
        ids, hidden = torch.cat([input_ids, mask_ids], dim=1), torch.cat([hidden_states, mask_hidden], dim=1)
    embeds = drafter.embed_tokens(ids).flatten(0, 1)
    hidden = drafter.fc(hidden).flatten(0, 1)
    cos, sin = drafter.rotary_emb(hidden, positions.view(1, -1))
    cos, sin = cos[0], sin[0]

    mask = _step_mask(cache.mask, real, k)
    steps = [_StepLayout(cache, i, batch, num_new, mask) for i in range(len(drafter.layers))]
    hidden, residual = drafter.layers[0](hidden, None, cos, sin, steps[0], "auto", embeds=embeds)
    for layer, step in zip(drafter.layers[1:], steps[1:], strict=True):
        hidden, residual = layer(hidden, residual, cos, sin, step, "auto")
    prenorm = hidden + residual
    out = drafter.norm(prenorm)

    for i, step in enumerate(steps):
        new_k, new_v = step.new_kv  # type: ignore[misc]
        old_k, old_v = cache.keys[i], cache.values[i]
        cache.keys[i] = new_k if old_k is None else torch.cat([old_k, new_k], dim=2)
        cache.values[i] = new_v if old_v is None else torch.cat([old_v, new_v], dim=2)
    cache.mask = torch.cat([cache.mask, real], dim=1)
    cache.lengths = cache.lengths + counts
    return out.view(batch, num_new + k - 1, -1), prenorm.view(batch, num_new + k - 1, -1)
