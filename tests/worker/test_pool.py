"""GPU assignment for the worker pool: each worker gets whole, disjoint GPU sets."""

from __future__ import annotations

from worker.pool import group_gpus, visible_gpus


def test_gpu_groups_give_each_worker_whole_multi_gpu_sets() -> None:
    assert group_gpus(["0", "1", "2", "3"], 1) == ["0", "1", "2", "3"]
    assert group_gpus(["0", "1", "2", "3"], 2) == ["0,1", "2,3"]
    assert group_gpus(["0", "1", "2"], 2) == ["0,1"]  # a leftover GPU gets no worker that would refuse jobs
    assert group_gpus(["0"], 2) == []


def test_requested_gpus_accept_repeats_and_commas() -> None:
    assert visible_gpus(["0,1", "3"]) == ["0", "1", "3"]
