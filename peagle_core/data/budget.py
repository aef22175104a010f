"""Whole conversations taken in order until a token budget is spent: training data sized by tokens, not rows.

The real demo and the real-model benches size their ShareGPT data this way. A conversation counts the
tokens a job keeps of it (cut at `seq_len`); one whose first answer starts within MIN_TRAINABLE tokens of
`seq_len` (or past it) is skipped and counted, since a job refuses a row with nothing to train on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peagle_core.data.chat import tokenize_conversation
from peagle_core.io import atomic_write_bytes

# A conversation must keep at least this many assistant tokens within seq_len to be worth a row.
MIN_TRAINABLE = 64


@dataclass(frozen=True)
class BudgetedData:
    """What `take_conversations` wrote: the file, and the figures a run reports about its data."""

    path: Path
    conversations: int
    assistant_turns: int
    tokens: int
    skipped_long_prompt: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "conversations": self.conversations,
            "assistant_turns": self.assistant_turns,
            "tokens": self.tokens,
            "skipped_long_prompt": self.skipped_long_prompt,
        }


def take_conversations(
    tokenizer: Any, source: Path, out: Path, *, budget_tokens: int, seq_len: int
) -> BudgetedData:
    """Copy whole conversations of the chat JSONL `source` (`{"messages": [...]}` rows) to `out`
    (atomically), in order and as written, until their tokens within `seq_len` reach `budget_tokens`."""
    if budget_tokens < 1:
        raise ValueError(f"budget_tokens must be >= 1, got {budget_tokens}")
    if seq_len <= MIN_TRAINABLE:
        raise ValueError(f"seq_len must be > {MIN_TRAINABLE}, got {seq_len}")
    lines: list[str] = []
    tokens = turns = skipped = 0
    # Lines split on "\n" only, copied as written: the text holds U+2028, which str.splitlines() breaks at.
    for number, line in enumerate(source.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        messages = json.loads(line)["messages"]
        ids, mask = tokenize_conversation(tokenizer, messages, line=number, max_tokens=seq_len)
        if 1 not in mask[: seq_len - MIN_TRAINABLE]:
            skipped += 1
            continue
        lines.append(line)
        turns += sum(m["role"] == "assistant" for m in messages)
        tokens += min(len(ids), seq_len)
        if tokens >= budget_tokens:
            break
    atomic_write_bytes(out, ("\n".join(lines) + "\n").encode())
    return BudgetedData(out, len(lines), turns, tokens, skipped)
