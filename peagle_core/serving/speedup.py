"""vLLM's speed-up from a speculator, timed in pairs: the runs with and without it alternate, so that load
drifting on a shared machine slows both sides alike instead of whichever happened to run second."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from peagle_core.figures import (
    is_int,
    is_number,
    is_rates,
    is_str,
    split_typed,
    stored_dict,
    stored_order,
)

if TYPE_CHECKING:
    from peagle_core.vllm_engine import SpeculativeMethod, VllmProcess

Groups = list[list[list[int]]]  # batches of prompts (token ids), each one `generate` call


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


@dataclass(frozen=True)
class Speedup:
    """One speed-up measured in vLLM: a speculator (`method`: "eagle3" for the drafter, or "ngram") at K
    and batch size, its output tokens/s against plain decoding's, their median ratio over the rounds, and
    whether the outputs matched. The one speed-up type: `paired_speedups` returns it, the gate's verdict,
    the recommendation, the page and the CLI read it. Fields are None where a stored row lacks them; other
    stored keys stay in `extra`, so a stored row reads back unchanged."""

    method: str | None = None
    batch_size: int | None = None
    k: int | None = None
    prompts: int | None = None
    rounds: int | None = None
    paired: str | None = None  # "per group", or "per round (ABBA)" on one engine process
    output_tokens_per_s: float | None = None
    baseline_output_tokens_per_s: float | None = None
    speedup: float | None = None  # None: plain decoding measured no time
    speedup_per_round: list[float] | None = None
    acceptance_length: float | None = None  # vLLM's, over the timed drafted runs
    lossless: bool | None = None
    dtype: str | None = None  # what the judge timed in
    extra: dict[str, Any] = field(default_factory=dict)
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)

    _CHECKS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "method": is_str,
        "batch_size": is_int,
        "k": is_int,
        "prompts": is_int,
        "rounds": is_int,
        "paired": is_str,
        "output_tokens_per_s": is_number,
        "baseline_output_tokens_per_s": is_number,
        "speedup": is_number,
        "speedup_per_round": is_rates,
        "acceptance_length": is_number,
        "lossless": _is_bool,
        "dtype": is_str,
    }
    # A measured row writes its null speed-up (and the judge's null dtype) as null, as it always has.
    _KEEP_NONE: ClassVar[tuple[str, ...]] = ("speedup",)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Speedup:
        typed, extra = split_typed(d, cls._CHECKS)
        return cls(**typed, extra=extra, **stored_order(d))

    def to_dict(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in self._CHECKS}
        return stored_dict(values, self.extra, self.order, () if self.order else self._KEEP_NONE)

    @property
    def is_drafter(self) -> bool:
        """The drafter's row (rows stored before ngram was measured have no method: the drafter's)."""
        return self.method in (None, "eagle3")


def batch_groups(prompts: list[list[int]], batch_size: int) -> Groups:
    """`prompts` cut into batches of `batch_size` in order (the last one shorter; one batch of all when
    there are fewer prompts than that)."""
    if batch_size < 1:
        raise ValueError("a batch holds at least one prompt")
    return [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]


def paired_speedups(
    plain: VllmProcess,
    drafted: VllmProcess,
    verifier: str,
    batchings: list[Groups],
    max_new_tokens: int,
    *,
    drafter: str | None = None,
    k: int,
    method: SpeculativeMethod = "eagle3",
    rounds: int = 3,
    options: dict[str, Any] | None = None,
    on_round: Callable[[int], None] | None = None,
) -> list[Speedup]:
    """Output tokens/s without and with the speculator (`drafter` at K, or vLLM's `ngram` at K) for each
    set of groups in `batchings` (the same prompts batched differently, e.g. batch 1 and batch 8), one
    figure per set, all timed in the same rounds so that one speculator configuration is built once.

    With two engine processes each group runs on both back to back, the order alternating group by group
    and round by round; with one engine (`plain is drafted`, e.g. one GPU's memory) every switch rebuilds
    it, so each round runs all groups on one side, then all on the other, the order alternating by round
    (ABBA, which cancels a linear drift). One untimed warm-up per side first. `speedup` is the median of
    the per-round ratios, `acceptance_length` vLLM's over every timed drafted run; `lossless` compares the
    two sides' tokens in the last round. `on_round(r)` hears each round (0-based) start, for progress."""
    if rounds < 1 or not batchings or not all(batchings):
        raise ValueError("a speed-up needs at least one round and one group of prompts")
    options = options or {}
    speculator: dict[str, Any] = {"k": k, "method": method}
    if method == "eagle3":
        if drafter is None:
            raise ValueError("the eagle3 method needs a drafter")
        speculator["drafter"] = drafter
    sides = {"plain": (plain, {}), "drafted": (drafted, speculator)}

    def run(side: str, group: list[list[int]]) -> Any:
        engine, extra = sides[side]
        return engine.generate(verifier, group, max_new_tokens, **extra, **options)

    if on_round is not None:
        on_round(0)  # the warm-up, which builds the speculator's engine, counts as the first round's
    for side in ("plain", "drafted"):
        run(side, batchings[0][0])
    items = [(s, g) for s, groups in enumerate(batchings) for g in groups]
    blocks = [[item] for item in items] if plain is not drafted else [items]
    tallies = [_Tally() for _ in batchings]
    for r in range(rounds):
        if on_round is not None and r:
            on_round(r)
        for t in tallies:
            t.start_round()
        for b, block in enumerate(blocks):
            order = ("plain", "drafted") if (r + b) % 2 == 0 else ("drafted", "plain")
            for side in order:
                for s, group in block:
                    tallies[s].add(side, run(side, group))
        for t in tallies:
            t.end_round()
    paired = "per group" if plain is not drafted else "per round (ABBA)"
    return [t.speedup(groups, method=method, k=k, rounds=rounds, paired=paired)
            for t, groups in zip(tallies, batchings, strict=True)]  # fmt: skip


@dataclass
class _Tally:
    """One batching's timings over the rounds: each round's output tokens/s per side and their ratio, the
    drafted side's drafts and accepted tokens, and the last round's tokens of each side."""

    rates: dict[str, list[float]] = field(default_factory=lambda: {"plain": [], "drafted": []})
    ratios: list[float] = field(default_factory=list)
    drafts: int = 0
    accepted: int = 0
    spent: dict[str, list[float]] = field(default_factory=dict)  # side -> [output tokens, seconds]
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)

    def start_round(self) -> None:
        self.spent = {side: [0, 0.0] for side in self.rates}
        self.tokens = {side: [] for side in self.rates}

    def add(self, side: str, out: Any) -> None:
        self.spent[side][0] += out.num_output_tokens
        self.spent[side][1] += out.seconds
        self.tokens[side].extend(out.tokens)
        if side == "drafted":
            self.drafts += out.num_drafts
            self.accepted += out.num_accepted_tokens

    def end_round(self) -> None:
        for side, (output_tokens, seconds) in self.spent.items():
            self.rates[side].append(output_tokens / seconds if seconds > 0 else 0.0)
        if self.rates["plain"][-1] > 0:
            self.ratios.append(self.rates["drafted"][-1] / self.rates["plain"][-1])

    def speedup(self, groups: Groups, *, method: str, k: int, rounds: int, paired: str) -> Speedup:
        return Speedup(
            method=method,
            batch_size=max(map(len, groups)),
            k=k,
            prompts=sum(map(len, groups)),
            rounds=rounds,
            paired=paired,
            output_tokens_per_s=statistics.median(self.rates["drafted"]),
            baseline_output_tokens_per_s=statistics.median(self.rates["plain"]),
            speedup=statistics.median(self.ratios) if self.ratios else None,
            speedup_per_round=[round(x, 4) for x in self.ratios],
            acceptance_length=1 + self.accepted / self.drafts if self.drafts else 1.0,
            lossless=self.tokens["plain"] == self.tokens["drafted"],
        )
