"""Starting a job from a published P-EAGLE checkpoint (`model.init_from`, ours or one speculators saved),
checked against the verifier and the spec before any training step.

The checkpoint decides the drafter's architecture, draft vocabulary and mask token; the spec still decides
the training-only settings (depths and COD sampling). A spec field that names an architecture value the
checkpoint does not have is an error, never silently overridden.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from peagle_core.errors import CheckpointError
from peagle_core.model.config import DrafterSettings, PEagleConfig
from peagle_core.model.drafter import PEagleDraftModel
from peagle_core.model.speculators import CONFIG_NAME, read_checkpoint
from peagle_core.spec import JobSpec

PARAM = "model.init_from"
# Spec fields that shape the drafter: taken from the checkpoint; set in the spec, they must agree with it.
ARCHITECTURE_FIELDS = ("num_layers", "layer_type", "norm_before_residual", "draft_vocab_size")
# Every other drafter setting only steers training: the spec's value wins.
TRAINING_FIELDS = tuple(f for f in DrafterSettings.model_fields if f not in ARCHITECTURE_FIELDS)


def _error(problems: list[str], spec: JobSpec, param: str = PARAM) -> CheckpointError:
    return CheckpointError(problems, path=f"{PARAM} {spec.model.init_from}", param=param)


def init_layer_ids(spec: JobSpec) -> list[int] | None:
    """The verifier layers the `init_from` checkpoint was trained on (None without one, or when it does not
    record them): the verifier must feed the drafter those same layers."""
    if spec.model.init_from is None:
        return None
    try:
        ids = json.loads((Path(spec.model.init_from) / CONFIG_NAME).read_text())[
            "eagle_aux_hidden_state_layer_ids"
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # `load_init_checkpoint` reports what is wrong with the directory
    return list(ids) if isinstance(ids, list) and ids else None


def load_init_checkpoint(
    spec: JobSpec, verifier_config: Any, verifier_layer_ids: list[int]
) -> PEagleDraftModel:
    """The drafter `spec.model.init_from` names, with the spec's training settings, ready to train.

    Raises CheckpointError (param `model.init_from`, or the spec field that disagrees) when the directory is
    not a loadable checkpoint, does not fit the verifier, or contradicts an architecture field of the spec.
    """
    try:
        config, state = read_checkpoint(spec.model.init_from)
    except CheckpointError as exc:
        raise _error(exc.problems, spec) from None
    text = (
        verifier_config.get_text_config() if hasattr(verifier_config, "get_text_config") else verifier_config
    )
    problems = [
        f"the checkpoint's {name} is {getattr(config, name)}, the verifier's is {getattr(text, name)}"
        for name in ("hidden_size", "vocab_size")
        if getattr(config, name) != getattr(text, name)
    ]
    if config.aux_layer_ids and config.aux_layer_ids != list(verifier_layer_ids):
        raise _error(
            [f"the checkpoint was trained on verifier layers {config.aux_layer_ids}, the job feeds it "
             f"{list(verifier_layer_ids)}: leave verifier.layer_ids unset or set it to the checkpoint's"],
            spec,
            param="verifier.layer_ids",
        )  # fmt: skip
    if problems:
        raise _error(problems, spec)
    for name in ARCHITECTURE_FIELDS:
        wanted = getattr(spec.model, name)
        if name in spec.model.model_fields_set and wanted is not None and wanted != getattr(config, name):
            raise _error(
                [f"model.{name} is {wanted!r} but the checkpoint's is {getattr(config, name)!r}: leave "
                 f"model.{name} unset to keep the checkpoint's"],
                spec,
                param=f"model.{name}",
            )  # fmt: skip
    updates = {name: getattr(spec.model, name) for name in TRAINING_FIELDS}
    updates |= {
        "aux_layer_ids": list(verifier_layer_ids),
        "verifier_name_or_path": spec.verifier.name_or_path,
        "verifier_architectures": list(getattr(verifier_config, "architectures", None) or []),
    }
    config = PEagleConfig(**(config.model_dump() | updates))
    model = PEagleDraftModel(config)
    model.load_state_dict(state)
    return model
