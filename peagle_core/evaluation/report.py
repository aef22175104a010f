"""The evaluation report (`eval.json`), typed: per K ours and vLLM's acceptance, with the publish check's."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

# How the stored JSON reads (no torch here: the dashboard reads it too). Each record types the keys whose
# stored value has the field's type; every other key (and a null or odd value of a typed one) stays in
# `extra` as stored, so `from_dict(d).to_dict() == d` for any stored object, keys in their stored order
# (`order`), and None means "not stored".


def k_key(k: int) -> str:
    """The name K's entry is stored under in `results`: "k=4"."""
    return f"k={k}"


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _rates(v: Any) -> bool:
    return isinstance(v, list) and all(_num(x) for x in v)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _object(v: Any) -> bool:
    return isinstance(v, dict)


def _objects(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(x, dict) for x in v.values())


def _split(d: Mapping[str, Any], checks: Mapping[str, Callable[[Any], bool]]) -> tuple[dict, dict]:
    """`d`'s keys whose value passes their check, and every other key."""
    typed: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in d.items():
        (typed if key in checks and checks[key](value) else extra)[key] = value
    return typed, extra


def _stored(fields: Mapping[str, Any], extra: Mapping[str, Any], order: tuple[str, ...]) -> dict[str, Any]:
    """The stored object: the fields that hold a value and the extra keys, in `order` where it names them."""
    out = {**{k: v for k, v in fields.items() if v is not None}, **extra}
    return {**{k: out[k] for k in order if k in out}, **out}


def _order(d: Mapping[str, Any]) -> dict[str, Any]:
    return {"order": tuple(d)}


@dataclass
class AcceptanceFigures:
    """One engine's acceptance at one K, or on one prompt category: mean tokens per verifier pass, the
    share of drafts accepted up to each position, what they average over, and the figures per category."""

    acceptance_length: float | None = None
    acceptance_rate_per_position: list[float] | None = None
    verifier_passes: int | None = None  # ours: its drafts
    drafts: int | None = None  # vLLM's, and a category's
    num_prompts: int | None = None
    num_generated_tokens: int | None = None
    categories: dict[str, AcceptanceFigures] | None = None
    engine: str | None = None  # vLLM's figures: the engine that measured them ("vllm 0.32.0")
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. vLLM's `matches_greedy`
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)

    _CHECKS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "acceptance_length": _num,
        "acceptance_rate_per_position": _rates,
        "verifier_passes": _int,
        "drafts": _int,
        "num_prompts": _int,
        "num_generated_tokens": _int,
        "categories": _objects,
        "engine": _str,
    }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AcceptanceFigures:
        typed, extra = _split(d, cls._CHECKS)
        if "categories" in typed:
            typed["categories"] = {str(c): cls.from_dict(f) for c, f in typed["categories"].items()}
        return cls(**typed, extra=extra, **_order(d))

    def to_dict(self) -> dict[str, Any]:
        categories = None
        if self.categories is not None:
            categories = {c: f.to_dict() for c, f in self.categories.items()}
        fields = {name: getattr(self, name) for name in self._CHECKS} | {"categories": categories}
        return _stored(fields, self.extra, self.order)

    @property
    def rates(self) -> list[float]:
        """The per-position rates ([] when none were stored)."""
        return list(self.acceptance_rate_per_position or [])


@dataclass
class KResult:
    """The evaluation at one K: our evaluator's figures (the entry's own keys) and vLLM's (`vllm`)."""

    k: int
    ours: AcceptanceFigures | None = None
    vllm: AcceptanceFigures | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KResult:
        rest = {key: v for key, v in d.items() if key != "k"}
        vllm = rest.pop("vllm") if _object(rest.get("vllm")) else None
        return cls(
            k=d["k"],
            ours=AcceptanceFigures.from_dict(rest) if rest else None,
            vllm=AcceptanceFigures.from_dict(vllm) if vllm is not None else None,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"k": self.k, **(self.ours.to_dict() if self.ours is not None else {})}
        if self.vllm is not None:
            out["vllm"] = self.vllm.to_dict()
        return out


@dataclass
class SpeedupFigures:
    """One speed-up measured in vLLM (`serving.speedup.paired_speedups`' row): a speculator (`method`) at
    K and batch size, its output tokens/s against plain decoding's, and their ratio."""

    method: str | None = None  # "eagle3" (the drafter) or "ngram"
    k: int | None = None
    batch_size: int | None = None
    prompts: int | None = None
    output_tokens_per_s: float | None = None
    baseline_output_tokens_per_s: float | None = None
    speedup: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # rounds, pairing, per-round ratios, lossless, ...
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)

    _CHECKS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "method": _str,
        "k": _int,
        "batch_size": _int,
        "prompts": _int,
        "output_tokens_per_s": _num,
        "baseline_output_tokens_per_s": _num,
        "speedup": _num,
    }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeedupFigures:
        typed, extra = _split(d, cls._CHECKS)
        return cls(**typed, extra=extra, **_order(d))

    def to_dict(self) -> dict[str, Any]:
        return _stored({name: getattr(self, name) for name in self._CHECKS}, self.extra, self.order)


@dataclass
class ServingFigures:
    """The publish check's verdict as the report stores it (`ServingCheck.to_dict()`): its status and K,
    vLLM's acceptance there (`figures`), the speed-ups measured and the serving recommendation drawn from
    them (`ServingRecommendation.to_dict()`, read back with `ServingRecommendation.parse`)."""

    status: str | None = None  # "verified" or "unverified"
    reason: str | None = None  # why unverified
    k: int | None = None
    prompts: int | None = None
    figures: AcceptanceFigures = field(default_factory=AcceptanceFigures)
    speedup: SpeedupFigures | None = None  # the drafter at K, smallest batch
    speedups: list[SpeedupFigures] | None = None
    recommendation: dict[str, Any] | None = None
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)

    _CHECKS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "status": _str,
        "reason": _str,
        "k": _int,
        "prompts": _int,
        "speedup": _object,
        "speedups": lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v),
        "recommendation": _object,
    }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServingFigures:
        typed, rest = _split(d, cls._CHECKS)
        if "speedup" in typed:
            typed["speedup"] = SpeedupFigures.from_dict(typed["speedup"])
        if "speedups" in typed:
            typed["speedups"] = [SpeedupFigures.from_dict(r) for r in typed["speedups"]]
        return cls(**typed, figures=AcceptanceFigures.from_dict(rest), **_order(d))

    def to_dict(self) -> dict[str, Any]:
        fields = {
            "status": self.status,
            "reason": self.reason,
            "k": self.k,
            "prompts": self.prompts,
            "speedup": self.speedup.to_dict() if self.speedup is not None else None,
            "speedups": [r.to_dict() for r in self.speedups] if self.speedups is not None else None,
            "recommendation": self.recommendation,
        }
        return _stored(fields, self.figures.to_dict(), self.order)


@dataclass
class EvaluationReport:
    """An evaluation of a drafter at the step it was taken: per K ours and vLLM's figures (`results`),
    and, in the export's report, the publish check's (`serving`). Stored as `eval.json` and as a
    checkpoint's `metrics["eval"]`: {"step": N, "results": {"k=N": {...}}, "serving": {...}}."""

    step: int | None = None
    results: dict[int, KResult] = field(default_factory=dict)
    serving: ServingFigures | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other top-level keys, as stored
    unread: dict[str, Any] = field(default_factory=dict)  # `results` entries not of a K's shape
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> EvaluationReport:
        """The report of a stored object (an empty report for None or a non-object)."""
        if not isinstance(d, Mapping):
            return cls()
        typed, extra = _split(
            d, {"step": _int, "results": lambda v: _object(v) and bool(v), "serving": _object}
        )
        results, unread = {}, {}
        for name, entry in (typed.get("results") or {}).items():
            if _object(entry) and _int(entry.get("k")) and name == k_key(entry["k"]):
                results[entry["k"]] = KResult.from_dict(entry)
            else:
                unread[name] = entry
        serving = ServingFigures.from_dict(typed["serving"]) if "serving" in typed else None
        return cls(typed.get("step"), results, serving, extra, unread, **_order(d))

    def to_dict(self) -> dict[str, Any]:
        results = None
        if self.results or self.unread:
            results = {**{k_key(k): r.to_dict() for k, r in self.results.items()}, **self.unread}
        serving = self.serving.to_dict() if self.serving is not None else None
        return _stored({"step": self.step, "results": results, "serving": serving}, self.extra, self.order)

    def at(self, k: int) -> KResult | None:
        """The figures at K, if it was evaluated."""
        return self.results.get(k)

    def ours(self, k: int) -> AcceptanceFigures | None:
        """Our evaluator's figures at K (None when it did not run)."""
        r = self.results.get(k)
        return r.ours if r is not None else None

    def with_serving(self, serving: Mapping[str, Any]) -> EvaluationReport:
        """This report with the publish check's verdict (`ServingCheck.to_dict()`)."""
        return replace(self, serving=ServingFigures.from_dict(serving))
