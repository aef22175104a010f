"""The evaluation report (`eval.json`), typed: per K ours and vLLM's acceptance, and the publish gate's
verdict on the export (no torch: the dashboard and the CLI read it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from peagle_core.figures import (
    Acceptance,
    KResult,
    is_int,
    is_object,
    k_key,
    split_typed,
    stored_dict,
    stored_order,
)
from peagle_core.serving.gate import ServingCheck


@dataclass
class EvaluationReport:
    """An evaluation of a drafter at the step it was taken: per K ours and vLLM's figures (`results`),
    and, in the export's report, the publish check's (`serving`). Stored as `eval.json` and as a
    checkpoint's `metrics["eval"]`: {"step": N, "results": {"k=N": {...}}, "serving": {...}}."""

    step: int | None = None
    results: dict[int, KResult] = field(default_factory=dict)
    serving: ServingCheck | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other top-level keys, as stored
    unread: dict[str, Any] = field(default_factory=dict)  # `results` entries not of a K's shape
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> EvaluationReport:
        """The report of a stored object (an empty report for None or a non-object)."""
        if not isinstance(d, Mapping):
            return cls()
        typed, extra = split_typed(
            d, {"step": is_int, "results": lambda v: is_object(v) and bool(v), "serving": is_object}
        )
        results, unread = {}, {}
        for name, entry in (typed.get("results") or {}).items():
            if is_object(entry) and is_int(entry.get("k")) and name == k_key(entry["k"]):
                results[entry["k"]] = KResult.from_dict(entry)
            else:
                unread[name] = entry
        serving = ServingCheck.from_dict(typed["serving"]) if "serving" in typed else None
        return cls(typed.get("step"), results, serving, extra, unread, **stored_order(d))

    def to_dict(self) -> dict[str, Any]:
        results = None
        if self.results or self.unread:
            results = {**{k_key(k): r.to_dict() for k, r in self.results.items()}, **self.unread}
        serving = self.serving.to_dict() if self.serving is not None else None
        return stored_dict(
            {"step": self.step, "results": results, "serving": serving}, self.extra, self.order
        )

    def at(self, k: int) -> KResult | None:
        """The figures at K, if it was evaluated."""
        return self.results.get(k)

    def ours(self, k: int) -> Acceptance | None:
        """Our evaluator's figures at K (None when it did not run)."""
        r = self.results.get(k)
        return r.ours if r is not None else None

    def with_serving(self, check: ServingCheck) -> EvaluationReport:
        """This report with the publish gate's verdict."""
        return replace(self, serving=check)
