"""Batched greedy speculative decoding with a KV-cached verifier: the engine behind `evaluate`.

Same decisions as the one-prompt reference (`evaluate.speculative_decode`), at the cost of the new tokens
only: prompts decode together (left-padded), the verifier keeps one KV cache cropped back to the longest
accepted prefix after each pass, and the drafter's aux hidden states come from those cached passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from peagle_core.evaluation.autoregressive import eagle3_draft_step
from peagle_core.evaluation.draft_cache import DraftCache, draft_step

if TYPE_CHECKING:
    from peagle_core.hidden_states.verifier import Verifier
    from peagle_core.model.drafter import PEagleDraftModel


@dataclass
class _Row:
    """One prompt in flight: its tokens (the last one, the bonus, not yet in the cache) and results."""

    index: int
    ids: list[int]
    aux: list[torch.Tensor]  # aux hidden states [n, 3H] of ids[:-1], in order
    fed: int = 0  # chunks of `aux` (and their aligned rows) already in the drafter's cache
    out: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


def _done(row: _Row, max_new_tokens: int, eos_token_id: int | None) -> bool:
    return len(row.out) >= max_new_tokens or row.out[-1] == eos_token_id


def _left_pad(seqs: Sequence[torch.Tensor], pad: float | int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack [n_i, ...] tensors into [B, max n, ...] padded on the left, with the [B, max n] real mask."""
    width = max(len(s) for s in seqs)
    first = seqs[0]
    out = first.new_full((len(seqs), width, *first.shape[1:]), pad)
    mask = torch.zeros(len(seqs), width, dtype=torch.long, device=first.device)
    for b, s in enumerate(seqs):
        out[b, width - len(s) :] = s
        mask[b, width - len(s) :] = 1
    return out, mask


@torch.no_grad()
def _decode_batch(
    drafter: PEagleDraftModel,
    verifier: Verifier,
    rows: list[_Row],
    k: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    drafter_cache: bool,
) -> None:
    """Decode `rows` to completion, filling each row's `out` and `accepted`."""
    from transformers import DynamicCache

    vdev = verifier.device
    ddev = next(drafter.parameters()).device
    cache = DynamicCache()
    mask, pos = _prefill(verifier, rows, cache)
    dcache = DraftCache(len(drafter.layers), len(rows), ddev) if drafter_cache else None
    live = [b for b, r in enumerate(rows) if not _done(r, max_new_tokens, eos_token_id)]
    active = rows
    while True:
        if len(live) < len(active):
            if not live:
                break
            mask, pos = _keep_rows(live, cache, dcache, mask, pos)
            active = [active[b] for b in live]

        drafts = _draft(drafter, dcache, active, k).to(vdev)

        # Verify [bonus, drafts] after each row's cached prefix.
        bonus = torch.tensor([r.ids[-1] for r in active], dtype=torch.long, device=vdev)
        step_ids = torch.cat([bonus[:, None], drafts], dim=1)  # [B, k+1]
        step_mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
        step_pos = pos[:, None] + torch.arange(k + 1, device=vdev)
        logits, aux = verifier.extend(step_ids, step_mask, step_pos, cache)
        greedy = logits.argmax(-1)  # greedy[:, j]: the verifier's choice after step_ids[:, j]
        # accepted drafts: the length of the agreeing prefix
        n_ok = (drafts == greedy[:, :k]).long().cumprod(-1).sum(-1)

        longest = int(n_ok.max())
        # Keep the KV of the bonus and accepted drafts: crop what no row accepted, mask the rest per row.
        cache.crop(-(k - longest))
        kept = torch.arange(longest + 1, device=vdev)[None, :] <= n_ok[:, None]
        mask = torch.cat([mask, kept.long()], dim=1)
        pos = pos + n_ok + 1
        _accept(active, drafts, greedy, n_ok, aux, max_new_tokens, eos_token_id)

        live = [b for b, r in enumerate(active) if not _done(r, max_new_tokens, eos_token_id)]


def _prefill(verifier: Verifier, rows: list[_Row], cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompts, left-padded, into `cache`; append each row's first token and prompt aux states.
    Returns the attention mask and each row's next position (that of its bonus token, which has no KV yet)."""
    ids, mask = _left_pad([torch.tensor(r.ids, dtype=torch.long) for r in rows])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    logits, aux = verifier.extend(ids, mask, positions, cache, logits_to_keep=1)
    first = logits[:, -1].argmax(-1).tolist()
    for b, r in enumerate(rows):
        r.aux.append(aux[b, mask.shape[1] - len(r.ids) :])
        r.ids.append(first[b])
        r.out.append(first[b])
    pos = torch.tensor([len(r.ids) - 1 for r in rows], device=verifier.device)
    return mask.to(verifier.device), pos


def _keep_rows(
    live: list[int], cache: Any, dcache: DraftCache | None, mask: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Narrow both caches, the mask and the positions to the `live` rows; returns (mask, pos)."""
    sel = torch.tensor(live, device=mask.device)
    cache.batch_select_indices(sel)
    mask, pos = mask[live], pos[live]
    # columns no remaining row uses (left padding, rejected drafts of finished rows)
    start = int(mask.any(0).long().argmax())
    if start:
        _drop_leading(cache, start)
        mask = mask[:, start:]
    if dcache is not None:
        dcache.select(sel.to(dcache.lengths.device))
    return mask, pos


def _draft(drafter: PEagleDraftModel, dcache: DraftCache | None, rows: list[_Row], k: int) -> torch.Tensor:
    """K drafts per row [B, k], from the aligned layout: hidden state of token t beside the id of token t+1.

    Without a drafter cache, from each row's whole sequence; with one, from the rows accepted since the
    last step only."""
    param = next(drafter.parameters())
    ddev, ddtype = param.device, param.dtype
    if dcache is None:
        hidden, real = _left_pad([torch.cat(r.aux) for r in rows])
        draft_ids, _ = _left_pad([torch.tensor(r.ids[1:], dtype=torch.long) for r in rows])
        return drafter.draft(hidden.to(device=ddev, dtype=ddtype), draft_ids.to(ddev), real.to(ddev), k=k)
    new_aux = [torch.cat(r.aux[r.fed :]) for r in rows]
    hidden, real = _left_pad(new_aux)
    fresh = [
        torch.tensor(r.ids[len(r.ids) - len(a) :], dtype=torch.long)
        for r, a in zip(rows, new_aux, strict=True)
    ]
    draft_ids, _ = _left_pad(fresh)
    step = eagle3_draft_step if drafter.mask_hidden is None else draft_step  # one pass per token, or all
    drafts = step(drafter, dcache, hidden.to(device=ddev, dtype=ddtype), draft_ids.to(ddev), real.to(ddev), k)
    for r in rows:
        r.fed = len(r.aux)
    return drafts


def _accept(
    rows: list[_Row],
    drafts: torch.Tensor,
    greedy: torch.Tensor,
    n_ok: torch.Tensor,
    aux: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | None,
) -> None:
    """Append each row's step: its accepted drafts and the verifier's next token (cut after EOS and at
    `max_new_tokens`), and the aux states of the tokens the verifier has now seen."""
    n_ok_list, greedy_list, drafts_list = n_ok.tolist(), greedy.tolist(), drafts.tolist()
    for b, r in enumerate(rows):
        n = n_ok_list[b]
        r.accepted.append(n)
        r.aux.append(aux[b, : n + 1])
        new = [*drafts_list[b][:n], greedy_list[b][n]]
        if eos_token_id is not None and eos_token_id in new:
            new = new[: new.index(eos_token_id) + 1]
        new = new[: max_new_tokens - len(r.out)]
        r.out += new
        r.ids += new


def _drop_leading(cache: object, n: int) -> None:
    """Drop the first `n` entries of every layer of a DynamicCache (keys/values [B, h, L, dh])."""
    for layer in cache.layers:  # type: ignore[attr-defined]
        layer.keys = layer.keys[..., n:, :]
        layer.values = layer.values[..., n:, :]


def speculative_decode_batch(
    drafter: PEagleDraftModel,
    verifier: Verifier,
    prompts: Sequence[torch.Tensor],
    k: int,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    batch_size: int = 16,
    drafter_cache: bool = True,
) -> list[tuple[list[int], list[int]]]:
    """Greedy speculative decoding of every prompt: `(generated tokens, accepted drafts per step)` each,
    in prompt order, as `evaluate.speculative_decode` returns them one prompt at a time.

    Prompts are grouped by length into batches of `batch_size` to keep padding short. `drafter_cache`
    False recomputes the drafter over each whole sequence every step (`PEagleDraftModel.draft`).
    """
    if k < 1:
        raise ValueError("k must be >= 1")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    rows = [_Row(index=i, ids=p.tolist(), aux=[]) for i, p in enumerate(prompts)]
    if any(not r.ids for r in rows):
        raise ValueError("every prompt needs at least one token")
    by_length = sorted(rows, key=lambda r: len(r.ids))
    for start in range(0, len(by_length), batch_size):
        batch = by_length[start : start + batch_size]
        _decode_batch(drafter, verifier, batch, k, max_new_tokens, eos_token_id, drafter_cache)
    return [(r.out, r.accepted) for r in rows]
