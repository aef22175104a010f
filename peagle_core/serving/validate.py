"""Checks a checkpoint directory against the contract vLLM loads, one human-readable reason per problem.

The contract is docs/architecture.md, Checkpoint contract; the format itself (file names, where each
config field lives, the tensor list) is `peagle_core.model.speculators`. Nothing broken is published:
`export.export_checkpoint` runs these checks before its directory appears.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from peagle_core.model.config import multimodal_rope_settings
from peagle_core.model.speculators import (
    ARCHITECTURES,
    CONFIG_NAME,
    LAYER,
    LAYER_ARCHITECTURES,
    WEIGHTS_NAME,
    expected_tensors,
    method_fields,
    method_of,
    read_config_fields,
)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Fields vLLM's speculators loader needs beyond the drafter config's own (those are in CONFIG_FIELDS).
# `pard_token` is not among them: we write it equal to `mask_token_id`, which vLLM reads first, and
# speculators' own checkpoints leave it out.
_FIXED_FIELDS = (
    "speculators_model_type",
    "architectures",
    LAYER,
    "speculators_config",
    "speculators_version",
)


def required_fields(method: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The top-level and `transformer_layer_config` fields a config.json of `method` must hold."""
    paths = [f.path for f in method_fields(method).values() if f.required]
    top = (*_FIXED_FIELDS, *(path[0] for path in paths if len(path) == 1))
    return top, ("model_type", *(path[1] for path in paths if path[0] == LAYER))


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def _check_config(cfg: Any) -> list[str]:
    if not isinstance(cfg, dict):
        return ["config.json: must be a JSON object"]
    method = method_of(cfg)
    required, required_layer = required_fields(method)
    problems = [f"config.json: missing required field {f!r}" for f in required if f not in cfg]
    if cfg.get("speculators_model_type", "peagle") not in ARCHITECTURES:
        problems.append(f"config.json: speculators_model_type is {cfg['speculators_model_type']!r}, expected one "
                        f"of {sorted(ARCHITECTURES)}")  # fmt: skip
    if "architectures" in cfg and cfg["architectures"] != [ARCHITECTURES[method]]:
        problems.append(
            f"config.json: architectures is {cfg['architectures']!r}, expected [{ARCHITECTURES[method]!r}]"
        )
    layer = cfg.get(LAYER)
    if LAYER in cfg and not isinstance(layer, dict):
        problems.append(f"config.json: {LAYER} must be an object")
    elif isinstance(layer, dict):
        problems += _check_layer(layer, required_layer)
    vocab = layer.get("vocab_size") if isinstance(layer, dict) else None
    problems += _check_vocab_and_mask(cfg, vocab)
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if "eagle_aux_hidden_state_layer_ids" in cfg and not (
        isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) and i >= 0 for i in ids)
    ):
        problems.append("config.json: eagle_aux_hidden_state_layer_ids must list 3 non-negative layer ids")
    elif "eagle_aux_hidden_state_layer_ids" in cfg and ids != sorted(set(ids)):
        problems.append(f"config.json: eagle_aux_hidden_state_layer_ids {ids} must be distinct and ascending: "
                        "vLLM gathers the verifier's aux hidden states in layer order")  # fmt: skip
    if "norm_before_residual" in cfg and not isinstance(cfg["norm_before_residual"], bool):
        problems.append("config.json: norm_before_residual must be true or false")
    if "speculators_config" in cfg:
        problems += _check_speculators_config(cfg["speculators_config"], method)
    return problems


def _check_layer(layer: dict, required: tuple[str, ...]) -> list[str]:
    where = f"config.json: {LAYER}"
    problems = [f"{where} is missing {f!r}" for f in required if f not in layer]
    if layer.get("model_type", "llama") not in LAYER_ARCHITECTURES:
        problems.append(f"{where}.model_type is {layer['model_type']!r}, expected one of "
                        f"{sorted(LAYER_ARCHITECTURES)} (the layer families vLLM serves our drafters in)")  # fmt: skip
    for f in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "num_hidden_layers", "vocab_size"):  # fmt: skip
        if f in layer and not (isinstance(layer[f], int) and layer[f] > 0):
            problems.append(f"{where}.{f} must be a positive integer")
    if "rope_parameters" in layer:
        problems += _check_rope(layer["rope_parameters"])
    return problems


def _check_rope(rope: Any) -> list[str]:
    where = f"config.json: {LAYER}.rope_parameters"
    if not isinstance(rope, dict) or "rope_type" not in rope or "rope_theta" not in rope:
        return [f"{where} must be a flat object with 'rope_type' and 'rope_theta'"]
    if any(isinstance(v, dict) for v in rope.values()):
        return [f"{where} must be flat (text-only), not nested per attention type"]
    if mrope := multimodal_rope_settings(rope):
        return [f"{where} has multimodal rotary settings {mrope}: vLLM refuses parallel drafting for an "
                "M-RoPE drafter, and on text it is plain RoPE"]  # fmt: skip
    return []


def _check_vocab_and_mask(cfg: dict, vocab: Any) -> list[str]:
    problems = []
    vd = cfg.get("draft_vocab_size")
    if "draft_vocab_size" in cfg and not (isinstance(vd, int) and vd > 0):
        problems.append("config.json: draft_vocab_size must be a positive integer")
    if isinstance(vd, int) and isinstance(vocab, int) and vd > vocab:
        problems.append(f"config.json: draft_vocab_size {vd} exceeds the verifier vocab_size {vocab}")
    mask = cfg.get("mask_token_id")
    if "mask_token_id" in cfg:
        if not isinstance(mask, int) or isinstance(mask, bool):
            problems.append("config.json: mask_token_id must be an integer token id")
        elif isinstance(vocab, int) and not 0 <= mask < vocab:
            problems.append(f"config.json: mask_token_id {mask} is outside the vocabulary [0, {vocab})")
    if "pard_token" in cfg and "mask_token_id" in cfg and cfg["pard_token"] != mask:
        problems.append(f"config.json: pard_token {cfg['pard_token']!r} differs from mask_token_id {mask!r}")
    return problems


def _check_speculators_config(sc: Any, method: str = "peagle") -> list[str]:
    where = "config.json: speculators_config"
    if not isinstance(sc, dict):
        return [f"{where} must be an object"]
    problems = []
    if sc.get("algorithm") != method:
        problems.append(f"{where}.algorithm is {sc.get('algorithm')!r}, expected {method!r}")
    methods = sc.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        problems.append(f"{where}.proposal_methods must be a non-empty list")
    else:
        m = methods[0]
        if m.get("proposal_type") != "greedy":
            problems.append(
                f"{where}.proposal_methods[0].proposal_type is {m.get('proposal_type')!r}, expected 'greedy'"
            )
        k = m.get("speculative_tokens")
        if not (isinstance(k, int) and k >= 1):
            problems.append(f"{where}.proposal_methods[0].speculative_tokens must be an integer >= 1")
    if sc.get("default_proposal_method") != "greedy":
        problems.append(
            f"{where}.default_proposal_method is {sc.get('default_proposal_method')!r}, expected 'greedy'"
        )
    verifier = sc.get("verifier")
    if not isinstance(verifier, dict):
        problems.append(f"{where}.verifier must be an object with name_or_path and architectures")
    else:
        if not isinstance(verifier.get("name_or_path"), str) or not verifier.get("name_or_path"):
            problems.append(f"{where}.verifier.name_or_path is missing")
        if not isinstance(verifier.get("architectures"), list):
            problems.append(f"{where}.verifier.architectures must be a list")
    return problems


def _check_against_verifier(cfg: dict, verifier_config: Any) -> list[str]:
    layer = cfg.get("transformer_layer_config") or {}
    problems = []
    for ours, theirs in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size")):
        want = _get(verifier_config, theirs)
        if want is not None and layer.get(ours) is not None and layer[ours] != want:
            problems.append(
                f"config.json: transformer_layer_config.{ours} is {layer[ours]}, the verifier's is {want}"
            )
    n_layers = _get(verifier_config, "num_hidden_layers")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if isinstance(n_layers, int) and isinstance(ids, list):
        bad = [i for i in ids if isinstance(i, int) and i >= n_layers]
        if bad:
            problems.append(f"config.json: eagle_aux_hidden_state_layer_ids {bad} do not exist in the "
                            f"{n_layers}-layer verifier")  # fmt: skip
    archs = _get(verifier_config, "architectures")
    declared = (cfg.get("speculators_config") or {}).get("verifier", {})
    declared_archs = declared.get("architectures") if isinstance(declared, dict) else None
    if archs and declared_archs and list(archs) != list(declared_archs):
        problems.append(f"config.json: speculators_config.verifier.architectures {declared_archs} differ from the "
                        f"verifier's {list(archs)}")  # fmt: skip
    return problems


def _kind(dtype: torch.dtype) -> str:
    if dtype in FLOAT_DTYPES:
        return "float"
    return {torch.int64: "int64", torch.bool: "bool"}.get(dtype, str(dtype).removeprefix("torch."))


def _check_tensors(cfg: dict, weights: Path) -> list[str]:
    fields, _ = read_config_fields(cfg)
    try:
        expected = expected_tensors(fields)
    except (KeyError, TypeError):
        return []  # the config problems already explain why shapes cannot be derived
    try:
        with safe_open(str(weights), framework="pt") as f:
            names = set(f.keys())
            problems = [f"{WEIGHTS_NAME}: missing tensor {n!r}" for n in sorted(set(expected) - names)]
            problems += [_unexpected(n, fields) for n in sorted(names - set(expected))]
            float_dtypes = set()
            for name, (shape, kind) in expected.items():
                if name not in names:
                    continue
                t = f.get_tensor(name)
                if tuple(t.shape) != shape:
                    problems.append(
                        f"{WEIGHTS_NAME}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}"
                    )
                if _kind(t.dtype) != kind:
                    problems.append(
                        f"{WEIGHTS_NAME}: tensor {name!r} has dtype {_kind(t.dtype)}, expected {kind}"
                    )
                elif kind == "float":
                    float_dtypes.add(t.dtype)
                    if not torch.isfinite(t).all():
                        problems.append(f"{WEIGHTS_NAME}: tensor {name!r} holds NaN or inf values")
            if len(float_dtypes) > 1:
                mix = sorted(str(d).removeprefix("torch.") for d in float_dtypes)
                problems.append(f"{WEIGHTS_NAME}: float tensors mix dtypes {mix}; a checkpoint holds one "
                                "(bf16, or fp32 when export.dtype asks for it)")  # fmt: skip
            if not problems and "d2t" in expected:
                problems += _check_vocab_map(f.get_tensor("d2t"), f.get_tensor("t2d"), fields)
    except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
        return [f"{WEIGHTS_NAME}: cannot be read ({exc})"]
    return problems


def _unexpected(name: str, fields: Mapping[str, Any]) -> str:
    if name == "mask_hidden" and fields.get("method") == "eagle3":
        return (f"{WEIGHTS_NAME}: tensor 'mask_hidden' must not be present: an EAGLE-3 drafter drafts without "
                "mask positions (vLLM skips it, and it would not be what was trained)")  # fmt: skip
    if name in ("d2t", "t2d"):
        return (f"{WEIGHTS_NAME}: tensor {name!r} must not be present: the draft vocabulary is the full "
                f"vocabulary ({fields['vocab_size']}), for which vLLM has no vocabulary map and refuses one")  # fmt: skip
    return f"{WEIGHTS_NAME}: unexpected tensor {name!r}"


def _check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, fields: Mapping[str, Any]) -> list[str]:
    vocab, vd = fields["vocab_size"], fields["draft_vocab_size"]
    problems = []
    target = torch.arange(vd, dtype=torch.int64) + d2t
    out_of_range = ((target < 0) | (target >= vocab)).nonzero().flatten()
    if len(out_of_range):
        i = int(out_of_range[0])
        problems.append(f"d2t: entry {i} maps to token {int(target[i])}, outside the vocabulary [0, {vocab}) "
                        f"({len(out_of_range)} of {vd} entries out of range)")  # fmt: skip
    n_true = int(t2d.sum())
    if n_true != vd:
        problems.append(f"t2d: marks {n_true} tokens, expected exactly draft_vocab_size={vd}")
    if not problems:
        if target.unique().numel() != vd:
            problems.append("d2t: maps two draft ids to the same verifier token")
        elif not torch.equal(target.sort().values, t2d.nonzero().flatten()):
            problems.append("d2t/t2d: the tokens i + d2t[i] are not exactly the positions t2d marks")
    return problems


def validate_checkpoint(path: str | Path, verifier_config: Any = None) -> list[str]:
    """Every reason `path` is not a P-EAGLE or EAGLE-3 checkpoint vLLM loads (empty list when it is).

    `verifier_config` (an HF config or dict) additionally checks hidden size, vocabulary, layer ids and
    architectures against the verifier the drafter will be served with.
    """
    path = Path(path)
    if not path.is_dir():
        return [f"{path}: not a directory"]
    problems = []
    cfg_path, weights = path / CONFIG_NAME, path / WEIGHTS_NAME
    cfg: Any = None
    if not cfg_path.is_file():
        problems.append(f"{CONFIG_NAME}: missing")
    else:
        try:
            cfg = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            problems.append(f"{CONFIG_NAME}: invalid JSON ({exc})")
    if cfg is not None:
        problems += _check_config(cfg)
        if verifier_config is not None and isinstance(cfg, dict):
            problems += _check_against_verifier(cfg, verifier_config)
    if not weights.is_file():
        problems.append(f"{WEIGHTS_NAME}: missing")
    elif isinstance(cfg, dict):
        problems += _check_tensors(cfg, weights)
    return problems
