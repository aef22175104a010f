"""How to serve a drafter, from vLLM's measured speed-ups: its method (P-EAGLE or EAGLE-3), the K to serve it
with and what it buys at each batch size measured, beside vLLM's training-free `ngram` speculator on the
same prompts (no torch: the dashboard and the CLI render it too).

The rows are `serving.speedup.Speedup`s with their `method` (`eagle3` for the drafter, `ngram`). The K served is the best one at the smallest batch size where some K beats plain decoding
(speed-up above 1): speculative decoding pays most where decoding is latency-bound, and one server runs
one K. When no K beats plain at any batch size there is no K to recommend, and the sentence says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peagle_core.serving.speedup import Speedup

DRAFTER, NGRAM = "eagle3", "ngram"  # the `method` of a speed-up row (vLLM's speculator, for both of ours)
# `model.method` -> how people name it.
METHOD_NAMES = {"peagle": "P-EAGLE", "eagle3": "EAGLE-3"}


def method_name(method: str) -> str:
    return METHOD_NAMES.get(method, method)


@dataclass(frozen=True)
class BatchChoice:
    """The recommendation at one batch size: the best speed-ups measured there, the drafter's and ngram's,
    each with its K, and the drafter's at the recommended K (None when there is none, or it was not
    measured here). Part of `ServingRecommendation`, not a speed-up row of its own."""

    batch_size: int
    best_k: int | None
    best_speedup: float | None
    ngram_k: int | None = None
    ngram_speedup: float | None = None
    speedup: float | None = None


@dataclass(frozen=True)
class ServingRecommendation:
    """The K to serve the drafter with (None: no K beat plain decoding) and the figures behind it, one
    entry per batch size, smallest first; `method` is the drafter's (`model.method`), which the
    `vllm serve` command depends on (parallel drafting or not)."""

    k: int | None
    batches: tuple[BatchChoice, ...]
    method: str = "peagle"

    @classmethod
    def choose(cls, rows: Iterable[Speedup], method: str = "peagle") -> ServingRecommendation | None:
        """The recommendation for a drafter of `method` from speed-up rows (None when no row has a speed-up)."""
        measured = [r for r in rows if r.speedup is not None and r.k is not None and r.batch_size is not None]
        if not measured:
            return None
        sizes = sorted({r.batch_size for r in measured})

        def best(method: str, size: int) -> Speedup | None:
            mine = [r for r in measured if (r.method or DRAFTER) == method and r.batch_size == size]
            # The smaller K on a tie: fewer drafted tokens per step for the same speed.
            return max(mine, key=lambda r: (r.speedup, -r.k), default=None)

        winners = {size: best(DRAFTER, size) for size in sizes}
        k = next((w.k for w in winners.values() if w is not None and w.speedup > 1.0), None)
        batches = []
        for size in sizes:
            w, ng = winners[size], best(NGRAM, size)
            at_k = [r.speedup for r in measured if r.is_drafter and r.batch_size == size and r.k == k]
            batches.append(
                BatchChoice(
                    batch_size=size,
                    best_k=w.k if w is not None else None,
                    best_speedup=float(w.speedup) if w is not None else None,
                    ngram_k=ng.k if ng is not None else None,
                    ngram_speedup=float(ng.speedup) if ng is not None else None,
                    speedup=float(at_k[0]) if at_k else None,
                )
            )
        return cls(k=k, batches=tuple(batches), method=method)

    def serve_k(self, default: int) -> int:
        """The K the `vllm serve` command should carry: the recommended one, else `default`."""
        return self.k if self.k is not None else default

    def sentence(self) -> str:
        """One line for people, e.g. "serve the P-EAGLE drafter with num_speculative_tokens=2: 1.42× at
        batch 1, 1.10× at batch 8 (ngram 1.19× / 1.05×)"."""
        name = method_name(self.method)
        ngram = [b.ngram_speedup for b in self.batches if b.ngram_speedup is not None]
        ngram_part = "ngram " + " / ".join(f"{s:.2f}×" for s in ngram) if ngram else "ngram not measured"
        if self.k is None:
            best = ", ".join(
                f"best {b.best_speedup:.2f}× at batch {b.batch_size} (K={b.best_k})"
                for b in self.batches
                if b.best_speedup is not None
            )
            return (
                f"no num_speculative_tokens beat plain decoding with this {name} drafter ({best}): serve without "
                f"it ({ngram_part})"
            )
        figures = ", ".join(
            f"{b.speedup:.2f}× at batch {b.batch_size}" for b in self.batches if b.speedup is not None
        )
        others = "".join(
            f"; K={b.best_k} is faster at batch {b.batch_size} ({b.best_speedup:.2f}×)"
            for b in self.batches
            if b.best_k is not None and b.best_k != self.k
        )
        # A drafter that loses to the training-free speculator should say so: the user may serve ngram.
        others += "".join(
            f"; ngram is faster at batch {b.batch_size} ({b.ngram_speedup:.2f}× against {b.speedup:.2f}×)"
            for b in self.batches
            if b.speedup is not None and b.ngram_speedup is not None and b.ngram_speedup > b.speedup
        )
        return (
            f"serve the {name} drafter with num_speculative_tokens={self.k}: {figures} ({ngram_part}){others}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the sentence for readers of the raw JSON (`from_dict` ignores it)."""
        return {
            "method": self.method,
            "k": self.k,
            "batches": [asdict(b) for b in self.batches],
            "sentence": self.sentence(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServingRecommendation:
        known = set(BatchChoice.__dataclass_fields__)
        return cls(
            method=str(d.get("method") or "peagle"),  # recorded before EAGLE-3: P-EAGLE's
            k=d.get("k"),
            batches=tuple(BatchChoice(**{f: v for f, v in b.items() if f in known}) for b in d["batches"]),
        )

    @classmethod
    def of(cls, holder: Mapping[str, Any] | None) -> ServingRecommendation | None:
        """The recommendation stored under `recommendation` in `holder`: a stored serving verdict
        (`ServingCheck.to_dict()`) or a succeeded job's progress; None for verdicts recorded without one,
        or before there was one."""
        return cls.parse((holder or {}).get("recommendation"))

    @classmethod
    def parse(cls, stored: Any) -> ServingRecommendation | None:
        """A stored recommendation (`to_dict()`), or None when `stored` is not one."""
        if not isinstance(stored, Mapping) or not isinstance(stored.get("batches"), list):
            return None
        return cls.from_dict(stored)
