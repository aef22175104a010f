"""`bench/vs_reference.py --dry-run` end to end on the toy verifier: both trainers train on the same cache,
the reference's weights export through our exporter, and every drafter gets the same measurement row."""

from __future__ import annotations

import pytest
import torch

from tests.bench.scripts import dry_run


@pytest.mark.slow
def test_dry_run_trains_both_trainers_and_measures_every_drafter(tmp_path) -> None:
    work = tmp_path / "work"
    lines = dry_run("vs_reference.py", work, timeout=600)
    rows = {r["drafter"]: r for r in lines if "drafter" in r}
    assert set(rows) == {
        "ours, equal tokens, seed 0",
        "reference, equal tokens",
        "ours, equal time (= equal tokens, seed 0)",
        "reference, equal time",
    }
    for row in rows.values():  # our evaluator scored each drafter at K=2: one accepted token at least
        assert 1.0 <= row["ours_acceptance_length"] <= 3.0, row
        assert len(row["ours_rate_per_position"]) == 2
    reference_steps = [r for r in lines if r.get("trainer") == "reference-tokens"]
    assert [r["step"] for r in reference_steps] == [1, 2] and all(r["loss"] > 0 for r in reference_steps)

    # The reference's export is a checkpoint of ours, trained away from its start: our drafter reads it.
    from peagle_core.model.drafter import PEagleDraftModel

    ours = PEagleDraftModel.from_pretrained(rows["ours, equal tokens, seed 0"]["export"])
    theirs = PEagleDraftModel.from_pretrained(rows["reference, equal tokens"]["export"])
    assert theirs.config.num_depths == ours.config.num_depths == 2
    assert torch.equal(theirs.d2t, ours.d2t), "both trainers use the same draft vocabulary"
    assert not torch.equal(theirs.fc.weight, ours.fc.weight)
    table = next(r["table"] for r in lines if "table" in r)
    assert table.count("\n") == 5  # header, rule and the four drafters
