"""vLLM's speed-up from a drafter, timed in pairs: the runs with and without it alternate, so that load
drifting on a shared machine slows both sides alike instead of whichever happened to run second."""

from __future__ import annotations

import statistics
from typing import Any

from peagle_core.vllm_engine import VllmEngine


def paired_speedup(
    plain: VllmEngine,
    drafted: VllmEngine,
    verifier: str,
    groups: list[list[list[int]]],
    max_new_tokens: int,
    *,
    drafter: str,
    k: int,
    rounds: int = 3,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Output tokens/s without and with `drafter` at K over `groups` (one batch each), `rounds` times.

    With two engine processes each group runs on both back to back, the order alternating group by group
    and round by round; with one engine (`plain is drafted`, e.g. one GPU's memory) every switch rebuilds
    it, so each round runs all groups on one side, then all on the other, the order alternating by round
    (ABBA, which cancels a linear drift). One untimed warm-up per side first. `speedup` is the median of
    the per-round ratios, `acceptance_length` vLLM's over every timed drafted run; `lossless` compares the two sides' tokens in the last round."""
    if rounds < 1 or not groups:
        raise ValueError("a speed-up needs at least one round and one group of prompts")
    options = options or {}
    sides = {
        "plain": (plain, {}),
        "drafted": (drafted, {"drafter": drafter, "k": k}),
    }

    def run(side: str, group: list[list[int]]) -> Any:
        engine, extra = sides[side]
        return engine.generate(verifier, group, max_new_tokens, **extra, **options)

    for side in ("plain", "drafted"):
        run(side, groups[0])
    blocks = [[g] for g in groups] if plain is not drafted else [groups]
    ratios, rates = [], {"plain": [], "drafted": []}
    drafts = accepted = 0
    tokens: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        spent = {side: [0, 0.0] for side in sides}  # output tokens, seconds
        tokens = {"plain": [], "drafted": []}
        for b, block in enumerate(blocks):
            order = ("plain", "drafted") if (r + b) % 2 == 0 else ("drafted", "plain")
            for side in order:
                for group in block:
                    out = run(side, group)
                    spent[side][0] += out.num_output_tokens
                    spent[side][1] += out.seconds
                    tokens[side].extend(out.tokens)
                    if side == "drafted":
                        drafts, accepted = drafts + out.num_drafts, accepted + out.num_accepted_tokens
        for side in sides:
            rates[side].append(spent[side][0] / spent[side][1] if spent[side][1] > 0 else 0.0)
        if rates["plain"][-1] > 0:
            ratios.append(rates["drafted"][-1] / rates["plain"][-1])
    return {
        "batch_size": max(map(len, groups)),
        "k": k,
        "prompts": sum(map(len, groups)),
        "rounds": rounds,
        "paired": "per group" if plain is not drafted else "per round (ABBA)",
        "output_tokens_per_s": statistics.median(rates["drafted"]),
        "baseline_output_tokens_per_s": statistics.median(rates["plain"]),
        "speedup": statistics.median(ratios) if ratios else None,
        "speedup_per_round": [round(x, 4) for x in ratios],
        "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "lossless": tokens["plain"] == tokens["drafted"],
    }
