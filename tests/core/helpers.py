"""Helpers shared by the trainer tests (test_train, test_world_size): a small job spec and weight comparison."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from peagle_core.spec import JobSpec, parse_spec
from peagle_core.training.resume import latest_checkpoint


def make_spec(verifier_dir: Path, data_path: Path, *, mode: str = "online", **training) -> JobSpec:
    """A spec that trains a one-layer, three-depth drafter on the toy verifier; `training` overrides."""
    return parse_spec(
        {
            "verifier": {"name_or_path": str(verifier_dir)},
            "dataset": {"path": str(data_path), "seq_len": 128, "val_fraction": 0.1},
            "hidden_states": {"mode": mode},
            "model": {"num_layers": 1, "num_depths": 3, "draft_vocab_size": 256},
            "training": {
                "total_seq_len": 256,
                "lr": 1e-3,
                "warmup_ratio": 0.2,
                "seed": 7,
                **training,
            },
            # vLLM's own evaluation and publish gate have their tests (tests/integration); here they would only
            # add an engine start to every training run.
            "evaluation": {
                "prompts": 2,
                "max_new_tokens": 8,
                "speculative_tokens": [1, 3],
                "engine": "peagle",
            },
            "export": {"vllm_check": False},
        }
    )


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    """The drafter weights of the newest training checkpoint under `out`."""
    return load_file(str(latest_checkpoint(out / "checkpoints") / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
