"""A hidden-state build asked to stop ends between batches, keeps what it computed, and a rerun finishes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle_core.errors import StopRequested
from peagle_core.hidden_states.build import ComputeBackend, build_cache, verify_cache
from peagle_core.hidden_states.cache import HiddenStateCache
from tests.core.hidden_states.test_cache import FP, SyntheticTokens, synthetic_compute


def test_a_stopped_build_keeps_its_batches_and_resumes(tmp_path: Path) -> None:
    ds = SyntheticTokens(20)
    compute = synthetic_compute(ds)
    calls: list[int] = []

    def counted(indices: list[int]):
        calls.append(len(indices))
        return compute(indices)

    asked = iter([False, False, True])  # stop before the third batch
    with pytest.raises(StopRequested, match="hidden-state build stopped"):
        build_cache(
            tmp_path / "c", ds, ComputeBackend(counted), FP, batch_size=4, should_stop=lambda: next(asked)
        )
    assert calls == [4, 4]
    assert len(HiddenStateCache.open(tmp_path / "c", FP)) == 8  # both batches committed, none half-written

    report = build_cache(
        tmp_path / "c", ds, ComputeBackend(counted), FP, batch_size=4, should_stop=lambda: False
    )
    assert (report.skipped, report.computed) == (8, 12)
    assert verify_cache(tmp_path / "c", ds) == []
