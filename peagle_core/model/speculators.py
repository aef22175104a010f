"""The speculators checkpoint format on disk: file names, config.json <-> `PEagleConfig`, the tensor list,
for both methods: speculators' `peagle` type, and its `eagle3` type (no mask token, no `mask_hidden`).

`CONFIG_FIELDS` maps every `PEagleConfig` field to its place in config.json; writing (`config_json`)
and reading (`read_config_fields`, `read_checkpoint`) both go through it. Reading also accepts what
speculators' own save path writes, and refuses by name the settings this drafter does not implement. The contract is
docs/architecture.md, Checkpoint contract; `peagle_core.serving.validate` checks a directory against it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import save_file

from peagle_core.errors import CheckpointError
from peagle_core.io import atomic_dir
from peagle_core.model.config import PEAGLE_ONLY_FIELDS, Method, PEagleConfig, text_rope_parameters

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
SPECULATORS_VERSION = "0.3.0"
ARCHITECTURE = "PEagleDraftModel"
# `model.method` -> config.json's speculators_model_type (= speculators_config.algorithm) and architectures.
ARCHITECTURES: dict[str, str] = {"peagle": ARCHITECTURE, "eagle3": "Eagle3Speculator"}
LAYER = "transformer_layer_config"
# transformer_layer_config.model_type -> the HF architecture of that layer family (`PEagleConfig.layer_type`).
LAYER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class ConfigField:
    """Where config.json keeps one `PEagleConfig` field; `required`: vLLM cannot load the file without it."""

    path: tuple[str, ...]
    required: bool = True

    @property
    def name(self) -> str:
        return ".".join(self.path)


CONFIG_FIELDS: dict[str, ConfigField] = {
    # `model.method` is speculators' model type: vLLM picks the drafter's runtime by it.
    "method": ConfigField(("speculators_model_type",), required=False),
    "hidden_size": ConfigField((LAYER, "hidden_size")),
    "num_attention_heads": ConfigField((LAYER, "num_attention_heads")),
    "num_key_value_heads": ConfigField((LAYER, "num_key_value_heads")),
    "head_dim": ConfigField((LAYER, "head_dim")),
    "intermediate_size": ConfigField((LAYER, "intermediate_size")),
    "num_layers": ConfigField((LAYER, "num_hidden_layers")),
    "rms_norm_eps": ConfigField((LAYER, "rms_norm_eps")),
    "vocab_size": ConfigField((LAYER, "vocab_size")),
    "rope_parameters": ConfigField((LAYER, "rope_parameters")),
    # vLLM picks the drafter class from it and defaults to llama when it is absent.
    "layer_type": ConfigField((LAYER, "model_type"), required=False),
    "max_position_embeddings": ConfigField((LAYER, "max_position_embeddings"), required=False),
    "draft_vocab_size": ConfigField(("draft_vocab_size",)),
    "mask_token_id": ConfigField(("mask_token_id",)),
    "aux_layer_ids": ConfigField(("eagle_aux_hidden_state_layer_ids",)),
    "norm_before_residual": ConfigField(("norm_before_residual",)),
    # Training-only settings, kept so a reload rebuilds the identical config; vLLM ignores them.
    "num_depths": ConfigField(("num_depths",), required=False),
    "down_sample_ratio": ConfigField(("down_sample_ratio",), required=False),
    "down_sample_ratio_min": ConfigField(("down_sample_ratio_min",), required=False),
    "max_anchors": ConfigField(("max_anchors",), required=False),
    "ttt_steps": ConfigField(("ttt_steps",), required=False),
    "verifier_name_or_path": ConfigField(("speculators_config", "verifier", "name_or_path")),
    "verifier_architectures": ConfigField(("speculators_config", "verifier", "architectures")),
}


# Fields only one method's config.json holds: vLLM reads the mask token for parallel drafting only.
METHOD_ONLY_FIELDS: dict[str, tuple[str, ...]] = {
    "peagle": ("mask_token_id", *PEAGLE_ONLY_FIELDS),
    "eagle3": ("ttt_steps",),
}


def method_fields(method: str) -> dict[str, ConfigField]:
    """The `CONFIG_FIELDS` a config.json of `method` holds."""
    others = {f for m, fields in METHOD_ONLY_FIELDS.items() if m != method for f in fields}
    return {name: where for name, where in CONFIG_FIELDS.items() if name not in others}


def method_of(cfg: Mapping[str, Any]) -> Method:
    """The method a config.json describes: `eagle3` for speculators' eagle3 type, else `peagle`."""
    return "eagle3" if cfg.get("speculators_model_type") == "eagle3" else "peagle"


def checkpoint_method(path: str | Path) -> Method:
    """The method of the checkpoint directory `path` (`peagle` when its config.json is missing or unreadable:
    the validator reports those)."""
    try:
        cfg = json.loads((Path(path) / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return "peagle"
    return method_of(cfg) if isinstance(cfg, dict) else "peagle"


def _fixed_fields(speculative_tokens: int, method: Method) -> dict[str, Any]:
    """The parts of config.json that are the same for every drafter of `method` we write."""
    return {
        "speculators_model_type": method,
        "architectures": [ARCHITECTURES[method]],
        LAYER: {
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        },
        "speculators_config": {
            "algorithm": method,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {},
        },
        "speculators_version": SPECULATORS_VERSION,
    }


def config_json(config: PEagleConfig, *, speculative_tokens: int | None = None) -> dict[str, Any]:
    """The config.json of a drafter; `speculative_tokens` (K) defaults to its num_depths."""
    out = _fixed_fields(int(speculative_tokens or config.num_depths), config.method)
    for field, where in method_fields(config.method).items():
        *parents, key = where.path
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[key] = getattr(config, field)
    out[LAYER]["architectures"] = [LAYER_ARCHITECTURES[config.layer_type]]
    if config.method == "peagle":
        # vLLM's parallel-drafting runtime reads `pard_token` when the config skips the speculators conversion.
        out["pard_token"] = config.mask_token_id
    out["speculators_config"]["verifier"]["name_or_path"] = config.verifier_name_or_path or ""
    return out


def read_config_fields(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], list[ConfigField]]:
    """The `PEagleConfig` fields config.json holds, and the required ones it lacks.

    `num_depths` falls back to the speculative token count, as in checkpoints speculators itself saved;
    `method` is read from speculators_model_type.
    """
    values: dict[str, Any] = {"method": method_of(cfg)}
    missing: list[ConfigField] = []
    for field, where in method_fields(values["method"]).items():
        node = _lookup(cfg, where.path)
        if node is not _ABSENT:
            values[field] = node
        elif where.required:
            missing.append(where)
    if "num_depths" not in values:
        methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
        if isinstance(methods[0], Mapping) and "speculative_tokens" in methods[0]:
            values["num_depths"] = methods[0]["speculative_tokens"]
    return values, missing


_ABSENT = object()


# Settings a speculators-saved EAGLE-3/P-EAGLE checkpoint may carry that this drafter does not implement:
# config.json path -> the values that mean "not used". Loading such a checkpoint would silently change it.
_UNSUPPORTED: dict[tuple[str, ...], tuple[Any, ...]] = {
    ("norm_before_fc",): (None, False),
    ("fc_norm",): (None, False),
    ("norm_output",): (None, False),
    (LAYER, "attention_bias"): (None, False),
    (LAYER, "mlp_bias"): (None, False),
    (LAYER, "hidden_act"): (None, "silu"),
    (LAYER, "use_sliding_window"): (None, False),
}


def unsupported_settings(cfg: Mapping[str, Any]) -> list[str]:
    """One problem per setting in config.json this drafter does not implement (a speculators checkpoint
    may use them); empty for every checkpoint we write."""
    problems = []
    for where, neutral in _UNSUPPORTED.items():
        value = _lookup(cfg, where)
        if value is not _ABSENT and value not in neutral:
            problems.append(f"{CONFIG_NAME}: {'.'.join(where)} = {value!r} is not supported")
    layer = cfg.get(LAYER) if isinstance(cfg.get(LAYER), Mapping) else {}
    target = cfg.get("target_hidden_size")
    if target is not None and target != layer.get("hidden_size"):
        problems.append(
            f"{CONFIG_NAME}: target_hidden_size {target!r} differs from the drafter's hidden_size"
        )
    if "sliding_attention" in (layer.get("layer_types") or []):
        problems.append(f"{CONFIG_NAME}: {LAYER}.layer_types: sliding-window layers are not supported")
    return problems


def _lookup(cfg: Any, path: tuple[str, ...]) -> Any:
    node = cfg
    for key in path:
        node = node.get(key, _ABSENT) if isinstance(node, Mapping) else _ABSENT
    return node


def _with_rope_parameters(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """`cfg` with a layer config saved before transformers 5 (`rope_theta`, `rope_scaling`; published
    speculators checkpoints have them) given the flat `rope_parameters` it means."""
    layer = cfg.get(LAYER)
    if not isinstance(layer, Mapping) or "rope_parameters" in layer or "rope_theta" not in layer:
        return cfg
    return {**cfg, LAYER: {**layer, "rope_parameters": text_rope_parameters(SimpleNamespace(**layer))}}


def config_from_json(cfg: Mapping[str, Any], *, path: str | None = None) -> PEagleConfig:
    """The `PEagleConfig` a config.json describes (ours, or one speculators saved); CheckpointError naming
    each missing, bad or unsupported field."""
    values, missing = read_config_fields(_with_rope_parameters(cfg))
    problems = [f"{CONFIG_NAME}: missing required field {f.name!r}" for f in missing]
    problems += unsupported_settings(cfg)
    if problems:
        raise CheckpointError(problems, path=path)
    values = {k: v for k, v in values.items() if v is not None or k == "max_anchors"}
    try:
        return PEagleConfig(**values)
    except ValidationError as exc:
        problems = [
            f"{CONFIG_NAME}: {'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors()
        ]
        raise CheckpointError(problems, path=path) from None


def expected_tensors(shape: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor the checkpoint holds: name -> (shape, kind), kind in {"float", "int64", "bool"};
    `d2t`/`t2d` only when the draft vocabulary is smaller than the verifier's.

    `shape` maps `PEagleConfig` field names to values (a config's `model_dump()` or `read_config_fields`);
    a missing or malformed one raises KeyError or TypeError.
    """
    h, v, vd = shape["hidden_size"], shape["vocab_size"], shape["draft_vocab_size"]
    q_out = shape["num_attention_heads"] * shape["head_dim"]
    kv_out = shape["num_key_value_heads"] * shape["head_dim"]
    inter = shape["intermediate_size"]
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "fc.weight": ((h, 3 * h), "float"),
        "layers.0.hidden_norm.weight": ((h,), "float"),
        "norm.weight": ((h,), "float"),
        "lm_head.weight": ((vd, h), "float"),
        "embed_tokens.weight": ((v, h), "float"),
    }
    if shape.get("method", "peagle") == "peagle":  # parallel drafting's hidden input for depths >= 1
        out["mask_hidden"] = ((1, 1, 3 * h), "float")
    if vd != v:  # with the full vocabulary the map is the identity, and vLLM has no parameter for it
        out["d2t"] = ((vd,), "int64")
        out["t2d"] = ((v,), "bool")
    for i in range(shape["num_layers"]):
        # Layer 0 attends over [embedding; projected hidden] (2H); the rest see the residual stream (H).
        d_in = 2 * h if i == 0 else h
        p = f"layers.{i}."
        out[p + "self_attn.q_proj.weight"] = ((q_out, d_in), "float")
        out[p + "self_attn.k_proj.weight"] = ((kv_out, d_in), "float")
        out[p + "self_attn.v_proj.weight"] = ((kv_out, d_in), "float")
        out[p + "self_attn.o_proj.weight"] = ((h, q_out), "float")
        out[p + "mlp.gate_proj.weight"] = ((inter, h), "float")
        out[p + "mlp.up_proj.weight"] = ((inter, h), "float")
        out[p + "mlp.down_proj.weight"] = ((h, inter), "float")
        out[p + "input_layernorm.weight"] = ((h,), "float")
        out[p + "post_attention_layernorm.weight"] = ((h,), "float")
        if shape.get("layer_type", "llama") == "qwen3":  # RMSNorm over each head of q and k
            out[p + "self_attn.q_norm.weight"] = ((shape["head_dim"],), "float")
            out[p + "self_attn.k_norm.weight"] = ((shape["head_dim"],), "float")
    return out


def write_checkpoint(
    out_dir: str | Path,
    config: PEagleConfig,
    state: Mapping[str, torch.Tensor],
    *,
    speculative_tokens: int | None = None,
    readme: str | None = None,
    dtype: torch.dtype | None = None,
    check: Callable[[Path], None] | None = None,
) -> Path:
    """Atomically write config.json + model.safetensors (+ README) for a drafter's config and state dict.

    Only the tensors `expected_tensors` lists are saved; `dtype` casts the float ones. `check(tmp_dir)`
    runs on the finished temporary directory before it is renamed into place, so a failing check
    (an exception) publishes nothing.
    """
    wanted = expected_tensors(config.model_dump())
    missing = sorted(set(wanted) - set(state))
    if missing:
        raise CheckpointError([f"model has no tensor {name!r}" for name in missing], path=str(out_dir))
    tensors = {}
    for name in wanted:
        t = state[name].detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        # clone: safetensors refuses tensors that share storage (views, tied weights).
        tensors[name] = t.contiguous().clone()
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        cfg = config_json(config, speculative_tokens=speculative_tokens)
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        if readme is not None:
            (tmp / CARD_NAME).write_text(readme)
        if check is not None:
            check(tmp)
    return Path(out_dir)


def read_checkpoint(path: str | Path) -> tuple[PEagleConfig, dict[str, torch.Tensor]]:
    """Read a checkpoint directory into its config and tensors, checking names and shapes.

    Raises CheckpointError naming every missing file, field or tensor and every wrong shape.
    """
    path = Path(path)
    cfg_path, weights = path / CONFIG_NAME, path / WEIGHTS_NAME
    missing = [f"{f.name}: missing" for f in (cfg_path, weights) if not f.is_file()]
    if missing:
        raise CheckpointError(missing, path=str(path))
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError([f"{CONFIG_NAME}: invalid JSON ({exc})"], path=str(path)) from None
    if not isinstance(cfg, dict):
        raise CheckpointError([f"{CONFIG_NAME}: must be a JSON object"], path=str(path))
    config = config_from_json(cfg, path=str(path))
    expected = expected_tensors(config.model_dump())
    try:
        with safe_open(str(weights), framework="pt") as f:
            names = f.keys()
            state = {name: f.get_tensor(name) for name in names}
    except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError([f"{WEIGHTS_NAME}: cannot be read ({exc})"], path=str(path)) from None
    problems = [f"{WEIGHTS_NAME}: missing tensor {n!r}" for n in sorted(set(expected) - set(state))]
    problems += [f"{WEIGHTS_NAME}: unexpected tensor {n!r}" for n in sorted(set(state) - set(expected))]
    problems += [
        f"{WEIGHTS_NAME}: tensor {n!r} has shape {list(state[n].shape)}, expected {list(shape)}"
        for n, (shape, _) in expected.items()
        if n in state and tuple(state[n].shape) != shape
    ]
    if problems:
        raise CheckpointError(problems, path=str(path))
    return config, state
