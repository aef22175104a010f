"""Token alignment and sequence packing: whole documents packed into fixed-length rows for the drafter.

`align_document` is the one place the drafter's shift convention lives (docs/interfaces.md, Token alignment);
`pack_bins` groups samples into rows deterministically, `step_shards` deals each optimizer step's rows out to
the ranks, and `collate` builds the `PackedBatch`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from peagle_core.errors import DataError


@dataclass
class AlignedDocument:
    """One document in the drafter's aligned layout, length `n-1`."""

    hidden_states: torch.Tensor  # [n-1, 3H]  aux_t
    input_ids: torch.Tensor  # [n-1]  x_{t+1}
    verifier_last_hidden_states: torch.Tensor  # [n-1, H]  last_{t+1}
    loss_mask: torch.Tensor  # [n-1]  m_{t+2}, 0 at the end
    position_ids: torch.Tensor  # [n-1]  t


def align_document(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor, last: torch.Tensor
) -> AlignedDocument:
    """Shift one unaligned document (tokens x, mask m, hidden states) into the aligned layout."""
    n = input_ids.shape[0]
    if n < 2:
        raise DataError(f"a document needs at least 2 tokens to align, got {n}")
    if loss_mask.shape[0] != n or aux.shape[0] != n or last.shape[0] != n:
        raise DataError(
            f"document length mismatch: {n} tokens, {loss_mask.shape[0]} mask entries, "
            f"{aux.shape[0]} aux rows, {last.shape[0]} last rows"
        )
    mask = torch.zeros(n - 1, dtype=torch.long)
    mask[: n - 2] = loss_mask[2:].long()
    return AlignedDocument(
        hidden_states=aux[:-1],
        input_ids=input_ids[1:].long(),
        verifier_last_hidden_states=last[1:],
        loss_mask=mask,
        position_ids=torch.arange(n - 1, dtype=torch.long),
    )


def _first_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """First fit over items in the given order: each goes into the lowest-numbered bin with room.

    A max segment tree over bins' free space finds that bin in O(log n); untouched bins have full room,
    so "open a new bin" is just the leftmost empty one.
    """
    leaves = 1
    while leaves < max(1, len(sizes)):
        leaves *= 2
    free = [capacity] * (2 * leaves)
    bins: list[list[int]] = []
    for item, size in enumerate(sizes):
        node = 1
        while node < leaves:
            node = 2 * node if free[2 * node] >= size else 2 * node + 1
        b = node - leaves
        if b == len(bins):
            bins.append([])
        bins[b].append(item)
        free[node] -= size
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


def pack_bins(lengths: Sequence[int], total_seq_len: int, seed: int, epoch: int) -> list[list[int]]:
    """Group sample indices into rows whose aligned lengths (`n-1`) sum to at most `total_seq_len`.

    First-fit-decreasing over a shuffle seeded by (seed, epoch), then the bins themselves are shuffled so a
    row's size does not follow its position in the epoch. The order is the same at every world size:
    `step_shards` deals it out to the ranks.
    """
    if total_seq_len < 1:
        raise ValueError("total_seq_len must be >= 1")
    too_long = [i for i, n in enumerate(lengths) if n - 1 > total_seq_len]
    if too_long:
        i = too_long[0]
        raise DataError(
            f"sample {i} has {lengths[i] - 1} aligned tokens, more than total_seq_len={total_seq_len}; "
            "raise training.total_seq_len to at least dataset.seq_len - 1",
            param="training.total_seq_len",
        )
    rng = random.Random(f"{seed}:{epoch}")
    order = [i for i in range(len(lengths)) if lengths[i] >= 2]  # a 1-token sample has nothing to align
    rng.shuffle(order)
    order.sort(key=lambda i: lengths[i], reverse=True)  # stable: ties keep the shuffled order
    bins = [[order[j] for j in b] for b in _first_fit([lengths[i] - 1 for i in order], total_seq_len)]
    rng.shuffle(bins)
    return bins


@dataclass(frozen=True)
class StepShard:
    """One rank's share of one optimizer step: positions in the epoch's bin order, and which are real.

    A pad (`real` False) repeats a bin of the step at zero weight, so a rank short of a bin still runs the
    forward/backward its collectives need; it consumes nothing.
    """

    bins: tuple[int, ...]
    real: tuple[bool, ...]
    step_bins: int  # real bins the whole step consumes, over all ranks

    @property
    def consumed(self) -> list[int]:
        return [b for b, r in zip(self.bins, self.real, strict=True) if r]


def step_shards(
    num_bins: int, start: int, bins_per_step: int, rank: int = 0, world_size: int = 1
) -> list[StepShard]:
    """Rank `rank`'s shares of the steps left in an epoch of `num_bins` bins, from global position `start`.

    Step s consumes bins [start + s*B, start + (s+1)*B) (fewer at the epoch's end) whatever the world size;
    rank r takes every `world_size`-th of them from the r-th, and every rank runs as many micro-batches as
    the busiest one (padding with zero-weight repeats), so DDP/FSDP collectives line up.
    """
    if bins_per_step < 1:
        raise ValueError("bins_per_step must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    shards = []
    for first in range(start, num_bins, bins_per_step):
        block = range(first, min(first + bins_per_step, num_bins))
        mine = list(block[rank::world_size])
        rounds = math.ceil(len(block) / world_size)
        pads = [block[0]] * (rounds - len(mine))
        shards.append(StepShard(tuple(mine + pads), (True,) * len(mine) + (False,) * len(pads), len(block)))
    return shards


@dataclass
class PackedBatch:
    """One packed row (batch dimension 1) ready for `PEagleDraftModel`'s training forward."""

    input_ids: torch.Tensor  # [1, T] long
    loss_mask: torch.Tensor  # [1, T] long
    document_ids: torch.Tensor  # [1, T] long, -1 on padding
    position_ids: torch.Tensor  # [1, T] long, restarting at 0 per document
    hidden_states: torch.Tensor  # [1, T, 3H]
    verifier_last_hidden_states: torch.Tensor  # [1, T, H]
    num_tokens: int
    num_loss_tokens: int
    sample_indices: list[int]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        moved: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device, non_blocking=non_blocking) if torch.is_tensor(value) else value
        return PackedBatch(**moved)


def collate(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    records: Sequence[Any],
    total_seq_len: int,
    sample_indices: Sequence[int] | None = None,
) -> PackedBatch:
    """Pack whole samples (unaligned `(input_ids, loss_mask)` with their `HiddenRecord`s) into one row.

    Documents are aligned, laid end to end, and the row is padded to `total_seq_len`.
    `sample_indices` defaults to the samples' positions in this call.
    """
    if len(samples) != len(records):
        raise ValueError(f"{len(samples)} samples but {len(records)} hidden-state records")
    docs = [
        align_document(ids, mask, rec.aux, rec.last)
        for (ids, mask), rec in zip(samples, records, strict=True)
    ]
    used = sum(d.input_ids.shape[0] for d in docs)
    if used > total_seq_len:
        raise DataError(f"{used} aligned tokens do not fit total_seq_len={total_seq_len}")
    if not docs:
        raise ValueError("collate needs at least one sample")
    dtype = docs[0].hidden_states.dtype
    h3, h = docs[0].hidden_states.shape[-1], docs[0].verifier_last_hidden_states.shape[-1]
    T = total_seq_len
    input_ids = torch.zeros(T, dtype=torch.long)
    loss_mask = torch.zeros(T, dtype=torch.long)
    document_ids = torch.full((T,), -1, dtype=torch.long)
    position_ids = torch.zeros(T, dtype=torch.long)
    hidden = torch.zeros(T, h3, dtype=dtype)
    last = torch.zeros(T, h, dtype=dtype)
    start = 0
    for doc_id, d in enumerate(docs):
        end = start + d.input_ids.shape[0]
        input_ids[start:end] = d.input_ids
        loss_mask[start:end] = d.loss_mask
        document_ids[start:end] = doc_id
        position_ids[start:end] = d.position_ids
        hidden[start:end] = d.hidden_states
        last[start:end] = d.verifier_last_hidden_states
        start = end
    return PackedBatch(
        input_ids=input_ids[None],
        loss_mask=loss_mask[None],
        document_ids=document_ids[None],
        position_ids=position_ids[None],
        hidden_states=hidden[None],
        verifier_last_hidden_states=last[None],
        num_tokens=used,
        num_loss_tokens=int(loss_mask.sum()),
        sample_indices=list(sample_indices) if sample_indices is not None else list(range(len(samples))),
    )
