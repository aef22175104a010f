"""The vLLM-loadable checkpoint (ARCHITECTURE.md §6): write it, read it back, and validate it field by field.

`export_checkpoint` writes `config.json` + `model.safetensors` + a README model card atomically;
`validate_checkpoint` returns one human-readable reason per problem so nothing broken is published.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from peagle_core.errors import CheckpointError
from peagle_core.io import atomic_dir

if TYPE_CHECKING:
    from peagle_core.model import PEagleDraftModel

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
SPECULATORS_VERSION = "0.3.0"
ARCHITECTURE = "PEagleDraftModel"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Top-level config fields vLLM's speculators loader (and our own loader) cannot do without.
REQUIRED_FIELDS = (
    "speculators_model_type",
    "architectures",
    "transformer_layer_config",
    "draft_vocab_size",
    "mask_token_id",
    "pard_token",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_residual",
    "speculators_config",
    "speculators_version",
)
REQUIRED_LAYER_FIELDS = (
    "model_type",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_hidden_layers",
    "rms_norm_eps",
    "vocab_size",
    "rope_parameters",
)


def serve_command(verifier: str, checkpoint_dir: str | Path, k: int) -> str:
    """The exact command that serves this drafter with vLLM (P-EAGLE needs the V1 model runner)."""
    spec = json.dumps(
        {
            "model": str(checkpoint_dir),
            "method": "eagle3",
            "num_speculative_tokens": k,
            "parallel_drafting": True,
        }
    )
    return f"VLLM_USE_V2_MODEL_RUNNER=0 vllm serve {verifier} --speculative-config '{spec}'"


def build_config(
    model_config: Any, *, verifier_name_or_path: str | None = None, k: int | None = None
) -> dict:
    """The §6 `config.json` for a `PEagleConfig`; `k` (speculative tokens) defaults to num_depths."""
    c = model_config
    verifier = verifier_name_or_path or c.verifier_name_or_path or ""
    k = int(k or c.num_depths)
    rope = dict(c.rope_parameters)
    return {
        "speculators_model_type": "peagle",
        "architectures": [ARCHITECTURE],
        "transformer_layer_config": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers,
            "rms_norm_eps": c.rms_norm_eps,
            "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings,
            "rope_parameters": rope,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        },
        "draft_vocab_size": c.draft_vocab_size,
        "mask_token_id": c.mask_token_id,
        # vLLM's parallel-drafting runtime reads `pard_token` when the config skips the speculators conversion.
        "pard_token": c.mask_token_id,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "norm_before_residual": c.norm_before_residual,
        # Training-only settings, kept so `from_pretrained` rebuilds the identical config; vLLM ignores them.
        "num_depths": c.num_depths,
        "down_sample_ratio": c.down_sample_ratio,
        "down_sample_ratio_min": c.down_sample_ratio_min,
        "max_anchors": c.max_anchors,
        "speculators_config": {
            "algorithm": "peagle",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier,
                "architectures": list(c.verifier_architectures or []),
            },
        },
        "speculators_version": SPECULATORS_VERSION,
    }


def config_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `build_config`: the keyword arguments of the `PEagleConfig` a checkpoint was built from."""
    layer = cfg["transformer_layer_config"]
    verifier = cfg["speculators_config"]["verifier"]
    kwargs = {
        "hidden_size": layer["hidden_size"],
        "num_attention_heads": layer["num_attention_heads"],
        "num_key_value_heads": layer["num_key_value_heads"],
        "head_dim": layer["head_dim"],
        "intermediate_size": layer["intermediate_size"],
        "rms_norm_eps": layer["rms_norm_eps"],
        "rope_parameters": layer["rope_parameters"],
        "max_position_embeddings": layer.get("max_position_embeddings"),
        "vocab_size": layer["vocab_size"],
        "draft_vocab_size": cfg["draft_vocab_size"],
        "num_layers": layer["num_hidden_layers"],
        "aux_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"],
        "mask_token_id": cfg["mask_token_id"],
        "norm_before_residual": cfg["norm_before_residual"],
        "verifier_name_or_path": verifier.get("name_or_path"),
        "verifier_architectures": verifier.get("architectures"),
        "num_depths": cfg.get(
            "num_depths", cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        ),
    }
    for optional in ("down_sample_ratio", "down_sample_ratio_min", "max_anchors"):
        if optional in cfg:
            kwargs[optional] = cfg[optional]
    return {k: v for k, v in kwargs.items() if v is not None or k == "max_anchors"}


def expected_tensors(cfg: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor the checkpoint must hold: name -> (shape, kind) with kind in {"float", "int64", "bool"}."""
    layer = cfg["transformer_layer_config"]
    h, v, vd = layer["hidden_size"], layer["vocab_size"], cfg["draft_vocab_size"]
    q_out = layer["num_attention_heads"] * layer["head_dim"]
    kv_out = layer["num_key_value_heads"] * layer["head_dim"]
    inter = layer["intermediate_size"]
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "fc.weight": ((h, 3 * h), "float"),
        "layers.0.hidden_norm.weight": ((h,), "float"),
        "norm.weight": ((h,), "float"),
        "lm_head.weight": ((vd, h), "float"),
        "embed_tokens.weight": ((v, h), "float"),
        "mask_hidden": ((1, 1, 3 * h), "float"),
        "d2t": ((vd,), "int64"),
        "t2d": ((v,), "bool"),
    }
    for i in range(layer["num_hidden_layers"]):
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
    return out


def write_pretrained(
    model: PEagleDraftModel,
    out_dir: str | Path,
    *,
    extra_config: Mapping[str, Any] | None = None,
    readme: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Atomically write `config.json` + `model.safetensors` (+ README) for `model`; returns the directory.

    Only the §6 tensors are saved (the frozen verifier head stays behind). `dtype` casts float tensors
    (default: keep the training dtype, so loading back is bit-exact).
    """
    cfg = build_config(model.config)
    cfg.update(extra_config or {})
    state = model.state_dict()
    wanted = expected_tensors(cfg)
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
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        if readme is not None:
            (tmp / CARD_NAME).write_text(readme)
    return Path(out_dir)


def read_pretrained(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a §6 directory: (config dict, state dict). Raises CheckpointError if it does not validate."""
    path = Path(path)
    problems = validate_checkpoint(path)
    if problems:
        raise CheckpointError(problems, path=str(path))
    cfg = json.loads((path / CONFIG_NAME).read_text())
    return cfg, load_file(str(path / WEIGHTS_NAME))


def model_card(
    *,
    verifier: str,
    checkpoint_dir: str | Path,
    k: int,
    data_fingerprint: str | None,
    metrics: Mapping[str, Any] | None,
    model_config: Any,
) -> str:
    """A README that says what this drafter was trained against and how to serve it."""
    lines = [
        "# P-EAGLE drafter",
        "",
        f"A P-EAGLE (parallel-drafting EAGLE-3) speculative decoding drafter for `{verifier}`.",
        "",
        "## Training",
        "",
        f"- verifier: `{verifier}`",
        f"- training data fingerprint: `{data_fingerprint or 'unknown'}`",
        f"- draft layers: {model_config.num_layers}, parallel depths: {model_config.num_depths}",
        f"- draft vocabulary: {model_config.draft_vocab_size} of {model_config.vocab_size} tokens",
        f"- verifier layers feeding the drafter: {list(model_config.aux_layer_ids)}",
        "",
        "## Metrics",
        "",
    ]
    if metrics:
        lines += [f"- {name}: {value}" for name, value in sorted(metrics.items())]
    else:
        lines.append("- none recorded")
    lines += [
        "",
        "## Serve with vLLM (0.28 or later)",
        "",
        "```bash",
        serve_command(verifier, checkpoint_dir, k),
        "```",
        "",
    ]
    return "\n".join(lines)


def export_checkpoint(
    model: PEagleDraftModel,
    out_dir: str | Path,
    *,
    verifier_name_or_path: str,
    data_fingerprint: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    speculative_tokens: int | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the §6 directory with its model card atomically, then validate it (CheckpointError if broken)."""
    out_dir = Path(out_dir)
    k = int(speculative_tokens or model.config.num_depths)
    cfg_overrides = build_config(model.config, verifier_name_or_path=verifier_name_or_path, k=k)
    readme = model_card(
        verifier=verifier_name_or_path,
        checkpoint_dir=out_dir,
        k=k,
        data_fingerprint=data_fingerprint,
        metrics=metrics,
        model_config=model.config,
    )
    write_pretrained(model, out_dir, extra_config=cfg_overrides, readme=readme, dtype=dtype)
    problems = validate_checkpoint(out_dir)
    if problems:
        raise CheckpointError(problems, path=str(out_dir))
    return out_dir


# ---------------------------------------------------------------------------------------------- validation


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def _check_config(cfg: Any) -> list[str]:
    if not isinstance(cfg, dict):
        return ["config.json: must be a JSON object"]
    problems = [f"config.json: missing required field {f!r}" for f in REQUIRED_FIELDS if f not in cfg]
    if cfg.get("speculators_model_type", "peagle") != "peagle":
        problems.append(
            f"config.json: speculators_model_type is {cfg['speculators_model_type']!r}, expected 'peagle'"
        )
    if "architectures" in cfg and cfg["architectures"] != [ARCHITECTURE]:
        problems.append(
            f"config.json: architectures is {cfg['architectures']!r}, expected [{ARCHITECTURE!r}]"
        )
    layer = cfg.get("transformer_layer_config")
    if "transformer_layer_config" in cfg and not isinstance(layer, dict):
        problems.append("config.json: transformer_layer_config must be an object")
    elif isinstance(layer, dict):
        problems += [
            f"config.json: transformer_layer_config is missing {f!r}"
            for f in REQUIRED_LAYER_FIELDS
            if f not in layer
        ]
        if layer.get("model_type", "llama") != "llama":
            problems.append(
                f"config.json: transformer_layer_config.model_type is {layer['model_type']!r}, expected 'llama'"
            )
        for f in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                  "num_hidden_layers", "vocab_size"):  # fmt: skip
            if f in layer and not (isinstance(layer[f], int) and layer[f] > 0):
                problems.append(f"config.json: transformer_layer_config.{f} must be a positive integer")
        rope = layer.get("rope_parameters")
        if "rope_parameters" in layer:
            if not isinstance(rope, dict) or "rope_type" not in rope or "rope_theta" not in rope:
                problems.append("config.json: transformer_layer_config.rope_parameters must be a flat object "
                                "with 'rope_type' and 'rope_theta'")  # fmt: skip
            elif any(isinstance(v, dict) for v in rope.values()):
                problems.append("config.json: transformer_layer_config.rope_parameters must be flat (text-only), "
                                "not nested per attention type")  # fmt: skip
    vd = cfg.get("draft_vocab_size")
    if "draft_vocab_size" in cfg and not (isinstance(vd, int) and vd > 0):
        problems.append("config.json: draft_vocab_size must be a positive integer")
    vocab = layer.get("vocab_size") if isinstance(layer, dict) else None
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
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if "eagle_aux_hidden_state_layer_ids" in cfg and not (
        isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) and i >= 0 for i in ids)
    ):
        problems.append("config.json: eagle_aux_hidden_state_layer_ids must list 3 non-negative layer ids")
    if "norm_before_residual" in cfg and not isinstance(cfg["norm_before_residual"], bool):
        problems.append("config.json: norm_before_residual must be true or false")
    problems += (
        _check_speculators_config(cfg.get("speculators_config")) if "speculators_config" in cfg else []
    )
    return problems


def _check_speculators_config(sc: Any) -> list[str]:
    where = "config.json: speculators_config"
    if not isinstance(sc, dict):
        return [f"{where} must be an object"]
    problems = []
    if sc.get("algorithm") != "peagle":
        problems.append(f"{where}.algorithm is {sc.get('algorithm')!r}, expected 'peagle'")
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
    try:
        expected = expected_tensors(cfg)
    except (KeyError, TypeError):
        return []  # the config problems already explain why shapes cannot be derived
    try:
        with safe_open(str(weights), framework="pt") as f:
            names = set(f.keys())
            problems = [f"{WEIGHTS_NAME}: missing tensor {n!r}" for n in sorted(set(expected) - names)]
            problems += [f"{WEIGHTS_NAME}: unexpected tensor {n!r}" for n in sorted(names - set(expected))]
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
                problems.append(
                    f"{WEIGHTS_NAME}: float tensors mix dtypes {sorted(str(d) for d in float_dtypes)}"
                )
            if not problems:
                problems += _check_vocab_map(f.get_tensor("d2t"), f.get_tensor("t2d"), cfg)
    except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
        return [f"{WEIGHTS_NAME}: cannot be read ({exc})"]
    return problems


def _check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, cfg: dict) -> list[str]:
    vocab, vd = cfg["transformer_layer_config"]["vocab_size"], cfg["draft_vocab_size"]
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
    """Every reason `path` is not a loadable §6 P-EAGLE checkpoint (empty list when it is).

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
