"""The drafter's configuration, defined once: the method (P-EAGLE or EAGLE-3) and settings a job chooses,
and the shape it takes from the verifier.

`DrafterSettings` are the fields `JobSpec.model` exposes (spec.py extends it); `PEagleConfig` adds the
shape read from the verifier's HF config. Imports no torch, so the job spec stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

if TYPE_CHECKING:
    from transformers import LlamaConfig

DEFAULT_DRAFT_VOCAB_SIZE = 32000
# Multimodal rotary keys (xdrope_section is HunYuan-VL's name for mrope_section). On text, M-RoPE's
# position streams are equal, which is plain RoPE; and vLLM refuses parallel drafting for a drafter
# whose rope config declares M-RoPE.
MROPE_KEYS = ("mrope_section", "mrope_interleaved", "xdrope_section")
# The drafter layer families vLLM's speculators loader maps (`update_peagle`: model_type -> architecture);
# qwen3 adds an RMSNorm over each head of q and k before RoPE.
LayerType = Literal["llama", "qwen3"]
# peagle drafts every depth in one pass (mask tokens); eagle3 drafts one token per pass, trained with
# training-time test (peagle_core.model.eagle3). Same body, same checkpoint tensors but `mask_hidden`.
Method = Literal["peagle", "eagle3"]
# COD sampling applies to parallel drafting only; EAGLE-3 trains every position at every unrolled step.
PEAGLE_ONLY_FIELDS = ("down_sample_ratio", "down_sample_ratio_min", "max_anchors")


class DrafterSettings(BaseModel):
    """What a job chooses about the drafter: its method, its depth and the COD sampling (P-EAGLE's
    parameter table) or the training-time-test steps (EAGLE-3's)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # First, so that the validators of the fields below see it.
    method: Method = Field(
        default="peagle",
        description="`peagle`: parallel drafting, all K tokens in one pass; `eagle3`: autoregressive drafting, "
        "one pass per token, trained with training-time test over `ttt_steps` unrolled steps.",
    )
    num_layers: int = Field(default=4, ge=1, le=64)
    num_depths: int = Field(default=4, ge=1, le=32)
    down_sample_ratio: float = Field(default=0.7, gt=0.0, le=1.0)
    down_sample_ratio_min: float = Field(default=0.2, ge=0.0, le=1.0)
    max_anchors: int | None = Field(default=None, ge=1, le=131072)
    norm_before_residual: bool = True
    layer_type: LayerType = Field(
        default="llama",
        description="Decoder layer family, as vLLM serves it: llama, or qwen3 (q/k RMSNorm per head).",
    )
    ttt_steps: int | None = Field(
        default=None,
        ge=1,
        le=32,
        description="method eagle3 only: steps the drafter is unrolled over in training, each on its own "
        "previous output (default: num_depths, the K it drafts).",
    )

    @field_validator(*PEAGLE_ONLY_FIELDS)
    @classmethod
    def _cod_is_peagles(cls, v: Any, info: ValidationInfo) -> Any:
        # A non-default COD setting under eagle3 would be silently ignored: refuse it, naming the field.
        default = DrafterSettings.model_fields[info.field_name].default
        if info.data.get("method") == "eagle3" and v != default:
            raise ValueError(f"applies to method peagle only (COD sampling), not {info.data['method']}")
        return v

    @field_validator("ttt_steps")
    @classmethod
    def _ttt_is_eagle3s(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("method", "peagle") != "eagle3":
            raise ValueError("applies to method eagle3 only (training-time test); set model.method: eagle3")
        return v

    @property
    def row_depths(self) -> int:
        """How many depths (P-EAGLE) or unrolled steps (EAGLE-3) a training row may have."""
        if self.method == "eagle3":
            return self.ttt_steps or self.num_depths
        return self.num_depths

    def drafter_settings(self) -> dict[str, Any]:
        """Just the `DrafterSettings` fields, for a subclass (the job spec) to hand to `PEagleConfig`."""
        return {name: getattr(self, name) for name in DrafterSettings.model_fields}


def ascending_layer_ids(ids: list[int]) -> list[int]:
    """Three distinct, non-negative verifier layer ids, sorted: vLLM gathers the verifier's aux hidden
    states in layer order, so `fc` must be trained on them in that order too. ValueError otherwise."""
    if len(ids) != 3:
        raise ValueError("must list exactly 3 layer ids")
    if any(i < 0 for i in ids):
        raise ValueError("layer ids must be >= 0")
    if len(set(ids)) != 3:
        raise ValueError("layer ids must be distinct")
    return sorted(ids)


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's default auxiliary layers for an L-layer verifier: [2, L//2, L-3], ascending.

    Ids index HF `hidden_states` (id i is the input of decoder layer i), the convention vLLM captures.
    Verifiers too small for three distinct defaults fall back to [0, L//2, L-1].
    """
    n = num_hidden_layers
    if n < 3:
        raise ValueError(f"the verifier has {n} layers; P-EAGLE needs at least 3")
    ids = [2, n // 2, n - 3]
    if len(set(ids)) < 3:
        ids = [0, n // 2, n - 1]
    return sorted(ids)


def text_rope_parameters(text_config: Any) -> dict[str, Any]:
    """The verifier's rotary settings as one flat, text-only dict with `rope_type` and `rope_theta`."""
    rope = dict(
        getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    )
    rope.setdefault("rope_type", rope.get("type", "default"))  # `type` is the legacy name
    rope.setdefault("rope_theta", getattr(text_config, "rope_theta", 10000.0))
    rope = {k: v for k, v in rope.items() if k not in (*MROPE_KEYS, "type")}
    if rope["rope_type"] == "mrope":  # older multimodal configs name M-RoPE as a rope type
        rope["rope_type"] = "default"
    return rope


def multimodal_rope_settings(rope: dict[str, Any]) -> list[str]:
    """The M-RoPE settings in a rope dict (empty when it is text-only)."""
    found = [k for k in MROPE_KEYS if k in rope]
    return found + [f"{k}: mrope" for k in ("rope_type", "type") if rope.get(k) == "mrope"]


class PEagleConfig(DrafterSettings):
    """Shape of the drafter (from the verifier) plus the P-EAGLE settings."""

    hidden_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    intermediate_size: int = Field(ge=1)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope_parameters: dict[str, Any] = Field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    max_position_embeddings: int = Field(default=8192, ge=1)
    vocab_size: int = Field(ge=2)
    draft_vocab_size: int = Field(ge=2)
    aux_layer_ids: list[int] = Field(default_factory=list)
    # P-EAGLE's mask token; EAGLE-3 checkpoints have none (vLLM reads it for parallel drafting only).
    mask_token_id: int = Field(default=0, ge=0)
    verifier_name_or_path: str | None = None
    verifier_architectures: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> PEagleConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError("draft_vocab_size must not exceed vocab_size")
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary ({self.vocab_size})"
            )
        if "rope_type" not in self.rope_parameters or "rope_theta" not in self.rope_parameters:
            raise ValueError("rope_parameters needs 'rope_type' and 'rope_theta'")
        if mrope := multimodal_rope_settings(self.rope_parameters):
            raise ValueError(f"rope_parameters must be text-only, without M-RoPE settings {mrope}")
        if self.aux_layer_ids and ascending_layer_ids(self.aux_layer_ids) != self.aux_layer_ids:
            raise ValueError(f"aux_layer_ids {self.aux_layer_ids} must be ascending (vLLM's layer order)")
        return self

    @classmethod
    def from_verifier(cls, hf_config: Any, **overrides: Any) -> PEagleConfig:
        """Shape from a verifier's HF config (text part); P-EAGLE settings from `overrides`.

        Defaults: aux layers [2, L//2, L-3], draft vocab min(32000, vocab) (None: the full vocabulary),
        mask token = the pad token (else the last id): the data pipeline normally passes the one it reserved.
        """
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        heads = text.num_attention_heads
        pad = getattr(text, "pad_token_id", None)
        values: dict[str, Any] = {
            "hidden_size": text.hidden_size,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
            "intermediate_size": text.intermediate_size,
            "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
            "rope_parameters": text_rope_parameters(text),
            "max_position_embeddings": getattr(text, "max_position_embeddings", 8192),
            "vocab_size": text.vocab_size,
            "draft_vocab_size": DEFAULT_DRAFT_VOCAB_SIZE,
            "aux_layer_ids": default_layer_ids(text.num_hidden_layers),
            "mask_token_id": pad if pad is not None else text.vocab_size - 1,
            "verifier_name_or_path": getattr(text, "_name_or_path", None) or None,
            "verifier_architectures": list(getattr(hf_config, "architectures", None) or []),
        }
        values.update(overrides)
        if values["draft_vocab_size"] is None:  # null means the full vocabulary
            values["draft_vocab_size"] = text.vocab_size
        values["draft_vocab_size"] = min(values["draft_vocab_size"], text.vocab_size)
        return cls(**values)

    def to_llama_config(self) -> LlamaConfig:
        """The Llama config of the drafter's decoder layers (for transformers' Llama building blocks)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=self.num_layers,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
        )
