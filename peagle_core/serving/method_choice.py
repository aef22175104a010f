"""Which method to serve, from each method's serving recommendation measured on the same verifier, prompts
and training budget: the faster at the smallest batch size, and whether P-EAGLE's claim (not slower than
EAGLE-3 at batch 1) held there. No torch: the bench and the docs render it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from peagle_core.serving.recommendation import ServingRecommendation, method_name


@dataclass(frozen=True)
class MethodChoice:
    """The method and K to serve (None: neither beat plain decoding) at `batch_size`, the smallest batch
    size all methods were measured at, with each method's best speed-up there."""

    method: str | None
    k: int | None
    batch_size: int
    best: dict[str, tuple[int | None, float | None]]  # method -> (its best K, speed-up) at batch_size

    @property
    def peagle_holds(self) -> bool | None:
        """Whether P-EAGLE's best is at least EAGLE-3's at `batch_size` (None when either is missing)."""
        p, e = self.best.get("peagle", (None, None))[1], self.best.get("eagle3", (None, None))[1]
        return None if p is None or e is None else p >= e

    def sentence(self) -> str:
        figures = ", ".join(
            f"{method_name(m)} {s:.2f}× (K={k})" for m, (k, s) in self.best.items() if s is not None
        )
        head = (
            f"serve {method_name(self.method)} with num_speculative_tokens={self.k}"
            if self.method is not None
            else "serve without a drafter"
        )
        claim = {
            True: "P-EAGLE ≥ EAGLE-3 holds here",
            False: "P-EAGLE ≥ EAGLE-3 does not hold here",
            None: "P-EAGLE against EAGLE-3 not measured",
        }[self.peagle_holds]
        return f"{head}: at batch {self.batch_size} {figures}; {claim}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "k": self.k,
            "batch_size": self.batch_size,
            "best": {m: {"k": k, "speedup": s} for m, (k, s) in self.best.items()},
            "peagle_holds": self.peagle_holds,
            "sentence": self.sentence(),
        }


def choose_method(recommendations: Mapping[str, ServingRecommendation]) -> MethodChoice | None:
    """The method to serve from each method's recommendation (keyed by `model.method`); None when no
    batch size was measured for all of them."""
    common = set.intersection(*({b.batch_size for b in r.batches} for r in recommendations.values())) if (
        recommendations
    ) else set()  # fmt: skip
    if not common:
        return None
    size = min(common)
    best: dict[str, tuple[int | None, float | None]] = {}
    for method, rec in recommendations.items():
        figures = next(b for b in rec.batches if b.batch_size == size)
        best[method] = (figures.best_k, figures.best_speedup)
    ranked = sorted(
        ((s, m, k) for m, (k, s) in best.items() if s is not None and s > 1.0),
        key=lambda t: (t[0], t[1] == "peagle"),  # a tie goes to P-EAGLE, the default
        reverse=True,
    )
    method, k = (ranked[0][1], ranked[0][2]) if ranked else (None, None)
    return MethodChoice(method=method, k=k, batch_size=size, best=best)
