"""Acceptance figures as `eval.json` stores them: the one acceptance type, a K's entry (ours and vLLM's) and
the helpers that read a stored object into typed fields, keeping whatever else it holds."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

# How the stored JSON reads (no torch here: the dashboard reads it too). Each record types the keys whose
# stored value has the field's type; every other key (and a null or odd value of a typed one) stays in
# `extra` as stored, so `from_dict(d).to_dict() == d` for any stored object, keys in their stored order
# (`order`), and None means "not stored".


def k_key(k: int) -> str:
    """The name K's entry is stored under in `results`: "k=4"."""
    return f"k={k}"


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_rates(v: Any) -> bool:
    return isinstance(v, list) and all(is_number(x) for x in v)


def is_str(v: Any) -> bool:
    return isinstance(v, str)


def is_object(v: Any) -> bool:
    return isinstance(v, dict)


def is_objects(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(x, dict) for x in v.values())


def split_typed(d: Mapping[str, Any], checks: Mapping[str, Callable[[Any], bool]]) -> tuple[dict, dict]:
    """`d`'s keys whose value passes their check, and every other key."""
    typed: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in d.items():
        (typed if key in checks and checks[key](value) else extra)[key] = value
    return typed, extra


def stored_dict(
    fields: Mapping[str, Any],
    extra: Mapping[str, Any],
    order: tuple[str, ...],
    keep_none: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The stored object: the fields that hold a value (or are in `keep_none`, written as null) and the
    extra keys, in `order` where it names them."""
    out = {**{k: v for k, v in fields.items() if v is not None or k in keep_none}, **extra}
    return {**{k: out[k] for k in order if k in out}, **out}


def stored_order(d: Mapping[str, Any]) -> dict[str, Any]:
    return {"order": tuple(d)}


@dataclass
class Acceptance:
    """Acceptance at one K, or on one prompt category, by our evaluator or vLLM: mean tokens per verifier
    pass, the share of drafts accepted up to each position, what they average over, and the figures per
    category. The one acceptance type: the evaluator returns it (with its `tokens`), the gate compares two
    of them, the report stores them and the page reads them."""

    acceptance_length: float | None = None
    acceptance_rate_per_position: list[float] | None = None
    verifier_passes: int | None = None  # ours: its drafts
    drafts: int | None = None  # vLLM's, and a category's
    num_prompts: int | None = None
    num_generated_tokens: int | None = None
    categories: dict[str, Acceptance] | None = None
    served_by: str | None = None  # vLLM's figures: who measured them ("vllm 0.32.0"; stored as "engine")
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. vLLM's `matches_greedy`
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # Our evaluator's generated tokens per prompt, for the caller that compares outputs; never stored.
    tokens: list[list[int]] = field(default_factory=list, compare=False, repr=False)

    _CHECKS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "acceptance_length": is_number,
        "acceptance_rate_per_position": is_rates,
        "verifier_passes": is_int,
        "drafts": is_int,
        "num_prompts": is_int,
        "num_generated_tokens": is_int,
        "categories": is_objects,
        "engine": is_str,
    }
    _ATTRS: ClassVar[dict[str, str]] = {"engine": "served_by"}  # stored key -> attribute, where they differ

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Acceptance:
        typed, extra = split_typed(d, cls._CHECKS)
        if "categories" in typed:
            typed["categories"] = {str(c): cls.from_dict(f) for c, f in typed["categories"].items()}
        return cls(**{cls._ATTRS.get(k, k): v for k, v in typed.items()}, extra=extra, **stored_order(d))

    def to_dict(self) -> dict[str, Any]:
        categories = None
        if self.categories is not None:
            categories = {c: f.to_dict() for c, f in self.categories.items()}
        fields = {key: getattr(self, self._ATTRS.get(key, key)) for key in self._CHECKS}
        return stored_dict(fields | {"categories": categories}, self.extra, self.order)

    @property
    def rates(self) -> list[float]:
        """The per-position rates ([] when none were stored)."""
        return list(self.acceptance_rate_per_position or [])

    @property
    def draft_count(self) -> int:
        """How many drafts the figures average over: ours' verifier passes, or vLLM's drafts."""
        return self.verifier_passes or self.drafts or 0

    def variance(self) -> float:
        """Variance of accepted tokens per draft, c = sum_j [c > j], so c^2 = sum_j (2j+1) [c > j]."""
        mean = sum(self.rates)
        return max(0.0, sum((2 * j + 1) * r for j, r in enumerate(self.rates)) - mean**2)


@dataclass
class KResult:
    """The evaluation at one K: our evaluator's figures (the entry's own keys) and vLLM's (`vllm`)."""

    k: int
    ours: Acceptance | None = None
    vllm: Acceptance | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KResult:
        rest = {key: v for key, v in d.items() if key != "k"}
        vllm = rest.pop("vllm") if is_object(rest.get("vllm")) else None
        return cls(
            k=d["k"],
            ours=Acceptance.from_dict(rest) if rest else None,
            vllm=Acceptance.from_dict(vllm) if vllm is not None else None,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"k": self.k, **(self.ours.to_dict() if self.ours is not None else {})}
        if self.vllm is not None:
            out["vllm"] = self.vllm.to_dict()
        return out
