"""Drafters of every shape vLLM must serve, trained briefly on the toy verifier and exported as users get them.

Three drafters cover the shapes the serving tests need: full vocabulary with four layers and
`norm_before_residual` (K = 1..4), a reduced draft vocabulary with one layer and without it (K = 1..3),
and an EAGLE-3 drafter (`model.method: eagle3`, served without parallel drafting) of the second's shape.
The second trains longer on a larger slice of the toy corpus (600 conversations; on the suite's 64 its
acceptance length on the serving prompts was 1.14 at K=3, on 600 1.59), so that the comparison of our
figure with vLLM's, and the gate's collapse check, mean something. It trains in bf16
(`training.precision: bf16`), the first in fp32, so the publish gate's tests load a bf16-trained drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from peagle_core.spec import parse_spec
from tests.core.helpers import make_spec
from tests.fixtures.toy import TOY_DATASET_ROWS


@dataclass(frozen=True)
class Shape:
    name: str
    num_layers: int
    num_depths: int
    draft_vocab_size: int | None
    norm_before_residual: bool
    steps: int
    conversations: int  # of the toy corpus it trains on
    precision: str  # training.precision
    method: str = "peagle"  # model.method


SHAPES = (
    Shape("full-vocab-4-layers", 4, 4, None, True, 20, 64, "fp32"),
    Shape("draft-vocab-1-layer", 1, 3, 256, False, 200, 600, "bf16"),
    Shape("eagle3-draft-vocab-1-layer", 1, 3, 256, False, 120, 600, "fp32", method="eagle3"),
)


@pytest.fixture(scope="session")
def exported_drafters(
    tmp_path_factory: pytest.TempPathFactory, toy_verifier_dir: Path, toy_dataset_path: Path
) -> dict[str, Path]:
    """Shape name -> the published (bf16) checkpoint directory of a drafter trained on the toy."""
    from peagle_core.pipeline.stages import run_pipeline
    from peagle_core.toy import write_toy_dataset

    out = {}
    for shape in SHAPES:
        data = toy_dataset_path
        if shape.conversations != TOY_DATASET_ROWS:
            data = write_toy_dataset(
                tmp_path_factory.mktemp("serving_data") / "toy.jsonl", n=shape.conversations, seed=0
            )
        raw = make_spec(
            toy_verifier_dir,
            data,
            max_steps=shape.steps,
            checkpoint_every_steps=1000,
            lr=3e-3,
            precision=shape.precision,
        ).model_dump(mode="json", exclude_unset=True)
        raw["model"] |= {
            "num_layers": shape.num_layers,
            "num_depths": shape.num_depths,
            "draft_vocab_size": shape.draft_vocab_size,
            "norm_before_residual": shape.norm_before_residual,
            "method": shape.method,
        }
        raw["evaluation"] |= {"speculative_tokens": [shape.num_depths]}
        spec = parse_spec(raw)
        result = run_pipeline(spec, tmp_path_factory.mktemp(shape.name))
        assert result.export_dir is not None
        out[shape.name] = result.export_dir
    return out
