"""Token alignment, bin packing and collation into PackedBatch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from peagle_core.data import PreparedDataset
from peagle_core.data.packing import align_document, collate, pack_bins, step_shards
from peagle_core.errors import DataError


class Record:
    def __init__(self, aux: torch.Tensor, last: torch.Tensor):
        self.aux, self.last = aux, last


def _doc(n: int, base: int) -> tuple[tuple[torch.Tensor, torch.Tensor], Record]:
    ids = torch.arange(base, base + n)
    mask = torch.tensor([(base + i) % 3 != 0 for i in range(n)], dtype=torch.long)
    aux = torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 6) + base
    last = -torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 2) - base
    return (ids, mask), Record(aux, last)


def test_align_document_shifts() -> None:
    x = torch.tensor([10, 11, 12, 13, 14, 15])
    m = torch.tensor([0, 0, 1, 1, 0, 1])
    aux = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 3)
    last = 100 + torch.arange(6, dtype=torch.float32)[:, None]
    d = align_document(x, m, aux, last)
    assert d.input_ids.tolist() == [11, 12, 13, 14, 15]  # x_{t+1}
    assert d.loss_mask.tolist() == [1, 1, 0, 1, 0]  # m_{t+2}, 0 past the end
    assert d.hidden_states[:, 0].tolist() == [0, 1, 2, 3, 4]  # aux_t
    assert d.verifier_last_hidden_states[:, 0].tolist() == [101, 102, 103, 104, 105]  # last_{t+1}
    assert d.position_ids.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(DataError):
        align_document(x[:1], m[:1], aux[:1], last[:1])
    with pytest.raises(DataError, match="length mismatch"):
        align_document(x, m, aux[:5], last)


def test_pack_bins_fills_without_overflow_and_is_deterministic() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(2, 60) for _ in range(300)]
    bins = pack_bins(lengths, 128, seed=1, epoch=0)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] - 1 for i in b) <= 128 for b in bins)
    # first-fit-decreasing is near optimal here: within a couple of bins of the volume bound
    assert len(bins) <= sum(n - 1 for n in lengths) / 128 + 2
    assert bins == pack_bins(lengths, 128, seed=1, epoch=0)
    assert bins != pack_bins(lengths, 128, seed=1, epoch=1)
    with pytest.raises(DataError, match="total_seq_len"):
        pack_bins([10, 200], 128, seed=0, epoch=0)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_step_shards_deal_each_step_out_to_any_world_size(world_size: int) -> None:
    num_bins, per_step, start = 23, 6, 12  # resuming two steps in; the last step has 5 rows
    shards = [step_shards(num_bins, start, per_step, r, world_size) for r in range(world_size)]
    # Every rank runs the same number of steps, each with as many rows as the busiest rank.
    assert len({len(s) for s in shards}) == 1
    for step in zip(*shards, strict=True):
        assert len({len(s.bins) for s in step}) == 1
        consumed = sorted(b for s in step for b in s.consumed)
        first = start + per_step * (shards[0].index(step[0]))
        assert consumed == list(range(first, min(first + per_step, num_bins)))  # the same at any W
        assert {s.step_bins for s in step} == {len(consumed)}
        for s in step:  # pads repeat a row of the step
            assert all(b in consumed for b, real in zip(s.bins, s.real, strict=True) if not real)
    everything = sorted(b for s in shards for shard in s for b in shard.consumed)
    assert everything == list(range(start, num_bins))  # each remaining row once


def test_collate_packs_documents_with_ids_positions_and_padding() -> None:
    docs = [_doc(5, 0), _doc(3, 50), _doc(4, 90)]
    batch = collate([d[0] for d in docs], [d[1] for d in docs], total_seq_len=12, sample_indices=[7, 3, 9])
    assert batch.input_ids.shape == (1, 12) and batch.hidden_states.shape == (1, 12, 6)
    assert batch.verifier_last_hidden_states.shape == (1, 12, 2)
    assert batch.document_ids[0].tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, -1, -1, -1]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 0, 0, 0]
    assert batch.input_ids[0].tolist() == [1, 2, 3, 4, 51, 52, 91, 92, 93, 0, 0, 0]
    assert batch.hidden_states[0, :9, 0].tolist() == [0, 1, 2, 3, 50, 51, 90, 91, 92]
    assert batch.verifier_last_hidden_states[0, :9, 0].tolist() == [-1, -2, -3, -4, -51, -52, -91, -92, -93]
    expected_mask = torch.cat([align_document(*d[0], d[1].aux, d[1].last).loss_mask for d in docs])
    assert batch.loss_mask[0, :9].tolist() == expected_mask.tolist()
    assert batch.loss_mask[0, 9:].tolist() == [0, 0, 0]
    assert batch.num_tokens == 9 and batch.num_loss_tokens == int(expected_mask.sum())
    assert batch.sample_indices == [7, 3, 9]
    assert batch.to("cpu").input_ids.data_ptr() == batch.input_ids.data_ptr()
    with pytest.raises(DataError, match="do not fit"):
        collate([d[0] for d in docs], [d[1] for d in docs], total_seq_len=8)


def test_packed_teacher_predicts_the_next_next_token(toy_verifier, prepared_dataset: Path) -> None:
    """With real verifier states: norm+lm_head of verifier_last_hidden_states[t] is the verifier's
    prediction at token t+1, i.e. of x_{t+2}, the token loss_mask[t] refers to."""
    ds = PreparedDataset.open(prepared_dataset)
    indices = pack_bins(ds.lengths, 300, seed=0, epoch=0)[0]
    samples = [ds[i] for i in indices]
    records = []
    expected = []
    for ids, _ in samples:
        aux, last = toy_verifier.hidden_states(ids[None])
        records.append(Record(aux[0], last[0]))
        logits, _ = toy_verifier.logits(ids[None])
        expected.append(logits[0, 1:])  # the verifier's prediction at token t+1, for aligned t
    batch = collate(samples, records, 300, sample_indices=indices)
    real = batch.document_ids[0] >= 0
    with torch.inference_mode():
        teacher = (
            toy_verifier.final_norm(batch.verifier_last_hidden_states[0, real])
            @ toy_verifier.lm_head_weight.T
        )
    torch.testing.assert_close(teacher, torch.cat(expected), rtol=1e-4, atol=1e-4)
    assert batch.num_tokens == sum(ds.lengths[i] - 1 for i in indices)
