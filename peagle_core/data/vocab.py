"""The draft vocabulary: the most frequent target tokens, mapped to verifier ids (d2t offsets, t2d mask).

Convention (docs/architecture.md, Checkpoint contract): draft id i is verifier id `i + d2t[i]`; `t2d[v]`
says verifier id v is in the draft vocabulary. Draft ids are assigned in ascending verifier-id order.
"""

from __future__ import annotations

import torch


def token_counts(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each verifier id occurs at a loss position (the tokens the drafter must predict)."""
    targets = input_ids[loss_mask.bool()].long()
    return torch.bincount(targets, minlength=vocab_size)[:vocab_size]


def build_draft_vocab(
    counts: torch.Tensor, draft_vocab_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d2t int64 [draft], t2d bool [vocab])` keeping the `draft_vocab_size` most frequent ids.

    Ties (including never-seen ids when the data has fewer distinct targets) go to the lower id, so the
    result is deterministic. `None` or a size >= the vocabulary gives the identity mapping.
    """
    vocab_size = counts.numel()
    if draft_vocab_size is None or draft_vocab_size >= vocab_size:
        return torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool)
    if draft_vocab_size < 1:
        raise ValueError("draft_vocab_size must be >= 1")
    ids = torch.arange(vocab_size, dtype=torch.int64)
    # a stable sort on descending count keeps ascending ids among ties
    order = torch.sort(-counts.long(), stable=True).indices
    kept = torch.sort(ids[order[:draft_vocab_size]]).values
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d
