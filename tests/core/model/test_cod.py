"""COD sampling: counts, nesting, targets, determinism and bad settings."""

from __future__ import annotations

import math

import pytest
import torch

from peagle_core.model.cod import sample_cod_indices


def _by_depth(anchor: torch.Tensor, depth: torch.Tensor) -> dict[int, list[int]]:
    return {int(d): anchor[depth == d].tolist() for d in depth.unique()}


@pytest.mark.parametrize("seed", range(6))
def test_cod_properties_on_random_masks(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    seq_len = int(torch.randint(20, 300, (1,), generator=g))
    mask = (torch.rand(seq_len, generator=g) < 0.6).long()
    mask[0] = 1  # a loss position at 0 must not create a negative anchor
    num_depths, r, r_min = 6, 0.7, 0.2
    anchor, depth = sample_cod_indices(seq_len, mask, num_depths, r, r_min, generator=g)

    assert anchor.dtype == depth.dtype == torch.long and anchor.shape == depth.shape
    assert bool((torch.diff(depth) >= 0).all()), "grouped by depth ascending"
    assert bool((anchor >= 0).all())
    groups = _by_depth(anchor, depth)
    assert groups[0] == list(range(seq_len)), "depth 0 is every position in order"
    n_anchor = int(mask.sum())
    for d in range(1, num_depths):
        chains = groups.get(d, [])
        assert chains == sorted(set(chains)), "sorted and unique"
        assert set(chains) <= set(groups[d - 1]), "nested in depth d-1"
        assert all(a + d < seq_len and mask[a + d] == 1 for a in chains), "targets are loss positions"
        survivors = [a for a in groups[d - 1] if a + d < seq_len and mask[a + d] == 1]
        budget = math.floor((n_anchor - d) * max(r**d, r_min))
        assert len(chains) == min(budget, len(survivors))


def test_max_anchors_caps_every_depth() -> None:
    mask = torch.ones(500, dtype=torch.long)
    _, depth = sample_cod_indices(500, mask, 5, 1.0, 1.0, max_anchors=40)
    for d in range(1, 5):
        assert int((depth == d).sum()) == 40 - d


def test_generator_gives_determinism() -> None:
    mask = (torch.rand(400, generator=torch.Generator().manual_seed(3)) < 0.5).long()
    runs = [sample_cod_indices(400, mask, 5, generator=torch.Generator().manual_seed(11)) for _ in range(2)]
    other = sample_cod_indices(400, mask, 5, generator=torch.Generator().manual_seed(12))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], other[0])


def test_naive_expansion_keeps_every_surviving_chain() -> None:
    mask = torch.ones(64, dtype=torch.long)
    anchor, depth = sample_cod_indices(64, mask, 4, 1.0, 1.0)
    for d in range(1, 4):
        assert anchor[depth == d].tolist() == list(range(64 - d))


def test_chains_never_cross_documents() -> None:
    docs = torch.tensor([0] * 10 + [1] * 10 + [-1] * 4)
    mask = torch.ones(24, dtype=torch.long)
    mask[20:] = 0
    anchor, depth = sample_cod_indices(24, mask, 4, 1.0, 1.0, document_ids=docs)
    deep = depth > 0
    assert bool((docs[anchor[deep]] == docs[anchor[deep] + depth[deep]]).all())
    assert 9 not in anchor[depth == 1].tolist()


def test_edge_cases() -> None:
    anchor, depth = sample_cod_indices(30, torch.zeros(30), 4)
    assert anchor.tolist() == list(range(30)) and depth.tolist() == [0] * 30
    anchor, depth = sample_cod_indices(1, torch.ones(1), 4)
    assert anchor.tolist() == [0] and depth.tolist() == [0]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"down_sample_ratio": 0.0}, "down_sample_ratio"),
        ({"down_sample_ratio": 1.5}, "down_sample_ratio"),
        ({"down_sample_ratio_min": -0.1}, "down_sample_ratio_min"),
        ({"down_sample_ratio_min": 1.1}, "down_sample_ratio_min"),
        ({"num_depths": 0}, "num_depths"),
        ({"seq_len": 9}, "loss_mask"),
    ],
)
def test_bad_settings_name_the_parameter(kwargs: dict, name: str) -> None:
    args = {"seq_len": 10, "loss_mask": torch.ones(10), "num_depths": 3} | kwargs
    with pytest.raises(ValueError, match=name):
        sample_cod_indices(**args)
