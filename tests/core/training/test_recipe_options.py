"""Recipe options through the real trainer: Muon (grouping, schedule, resume through checkpoints), a frozen
lm_head, and the loss options together on the toy verifier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peagle_core.data import PreparedDataset
from peagle_core.events import CallbackReporter
from peagle_core.training.builders import build_model, build_optimizer
from peagle_core.training.loop import train
from peagle_core.training.muon import MuonAdamW
from peagle_core.training.schedule import build_scheduler
from tests.core.helpers import assert_same_weights, final_weights, make_spec

RECIPE = {
    "optimizer": "muon",
    "depth_weights": "count",
    "tv_weight": 0.3,
    "in_vocab_targets_only": True,
}


@pytest.fixture
def dataset(prepared_dataset: Path) -> PreparedDataset:
    return PreparedDataset.open(prepared_dataset)


def test_muon_takes_the_decoder_matrices_and_follows_the_schedule(
    toy_verifier_dir: Path, toy_dataset_path: Path, toy_verifier, dataset: PreparedDataset
) -> None:
    spec = make_spec(toy_verifier_dir, toy_dataset_path)
    model = build_model(spec, toy_verifier, dataset, torch.device("cpu"))
    optimizer = build_optimizer(model, 1e-3, 0.01, "muon")
    assert isinstance(optimizer, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["kind"] == "muon" for p in g["params"]}
    assert muon and all(model.get_parameter(n).ndim == 2 for n in muon)
    assert not any("embed_tokens" in n or "lm_head" in n for n in muon)
    assert "fc.weight" in muon and any("mlp" in n for n in muon)

    scheduler = build_scheduler(optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    before = {k: [p.detach().clone() for g in inner.param_groups for p in g["params"]]
              for k, inner in optimizer._inner.items()}  # fmt: skip
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    scheduler.step()
    for kind, inner in optimizer._inner.items():
        assert [g["lr"] for g in inner.param_groups] == [
            g["lr"] for g in optimizer.param_groups if g["kind"] == kind
        ]
        moved = [p for g in inner.param_groups for p in g["params"]]
        assert any(not torch.equal(a, b) for a, b in zip(before[kind], moved, strict=True)), kind


def test_recipe_options_resume_to_the_uninterrupted_run_and_keep_the_frozen_head(
    toy_verifier_dir: Path, toy_dataset_path: Path, prepared_dataset: Path, tmp_path: Path
) -> None:
    spec = make_spec(toy_verifier_dir, toy_dataset_path, max_steps=4, checkpoint_every_steps=100, **RECIPE)
    spec.model.freeze_lm_head = True
    spec.evaluation.prompts = 1
    ref = train(spec, tmp_path / "ref", dataset_dir=prepared_dataset)
    assert ref.status == "completed"

    seen: list[dict] = []
    stopped = train(
        spec, tmp_path / "run", dataset_dir=prepared_dataset, reporter=CallbackReporter(metrics=seen.append),
        should_stop=lambda: len(seen) >= 2,
    )  # fmt: skip
    assert stopped.status == "stopped" and stopped.step == 2
    assert train(spec, tmp_path / "run", dataset_dir=prepared_dataset).status == "completed"
    weights = final_weights(tmp_path / "ref")
    assert_same_weights(weights, final_weights(tmp_path / "run"))

    # The head is the verifier's rows still; the rest trained.
    dataset = PreparedDataset.open(prepared_dataset)
    from peagle_core.hidden_states.verifier import Verifier

    verifier = Verifier.load(str(toy_verifier_dir), device="cpu")
    rows = verifier.lm_head_weight[torch.arange(dataset.d2t.numel()) + dataset.d2t].float()
    torch.testing.assert_close(weights["lm_head.weight"].float(), rows, rtol=0, atol=0)

    adamw = make_spec(toy_verifier_dir, toy_dataset_path, max_steps=4, checkpoint_every_steps=100)
    adamw.evaluation.prompts = 1
    train(adamw, tmp_path / "adamw", dataset_dir=prepared_dataset)
    other = final_weights(tmp_path / "adamw")
    assert not torch.equal(other["fc.weight"], weights["fc.weight"])
    assert not torch.equal(other["lm_head.weight"], weights["lm_head.weight"])
