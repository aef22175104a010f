"""Token-budgeted conversation picking: order kept, rows copied verbatim, budget and long prompts honoured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peagle_core.data.budget import MIN_TRAINABLE, take_conversations
from peagle_core.data.chat import tokenize_conversation


@pytest.fixture(scope="module")
def tokenizer(toy_verifier_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_verifier_dir)


def _conversation(i: int, prompt_words: int = 3, turns: int = 2) -> dict:
    messages = []
    for t in range(turns):
        messages.append({"role": "user", "content": " ".join(["ask"] * prompt_words) + f" {i}.{t}"})
        messages.append({"role": "assistant", "content": f"answer number {i} turn {t}\u2028still the answer"})
    return {"messages": messages, "id": f"c{i}"}


def test_takes_whole_conversations_in_order_until_the_budget(tokenizer, tmp_path: Path) -> None:
    rows = [_conversation(i) for i in range(40)]
    source = tmp_path / "src.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    sizes = [len(tokenize_conversation(tokenizer, r["messages"])[0]) for r in rows]
    budget = sum(sizes[:7]) - 1  # reached inside the 7th conversation: it is kept whole

    got = take_conversations(tokenizer, source, tmp_path / "out.jsonl", budget_tokens=budget, seq_len=512)

    kept = (tmp_path / "out.jsonl").read_text().split("\n")
    assert [json.loads(line) for line in kept if line] == rows[:7]  # verbatim: ids and U+2028 survive
    assert (got.conversations, got.assistant_turns, got.tokens, got.skipped_long_prompt) == (
        7,
        14,
        sum(sizes[:7]),
        0,
    )


def test_counts_tokens_within_seq_len_and_skips_prompts_that_leave_nothing(tokenizer, tmp_path: Path) -> None:
    seq_len = 96
    long_prompt = _conversation(
        0, prompt_words=seq_len
    )  # its first answer starts past seq_len - MIN_TRAINABLE
    rows = [long_prompt, _conversation(1, turns=12), _conversation(2)]
    source = tmp_path / "src.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    first_answer = tokenize_conversation(tokenizer, long_prompt["messages"])[1].index(1)
    assert first_answer >= seq_len - MIN_TRAINABLE

    got = take_conversations(tokenizer, source, tmp_path / "out.jsonl", budget_tokens=10**6, seq_len=seq_len)

    long_ids = tokenize_conversation(tokenizer, rows[1]["messages"])[0]
    assert len(long_ids) > seq_len  # so the cut matters
    short = len(tokenize_conversation(tokenizer, rows[2]["messages"])[0])
    assert (got.conversations, got.skipped_long_prompt) == (2, 1)
    assert got.tokens == seq_len + short


def test_rejects_budgets_and_lengths_out_of_range(tokenizer, tmp_path: Path) -> None:
    source = tmp_path / "src.jsonl"
    source.write_text(json.dumps(_conversation(0)) + "\n")
    with pytest.raises(ValueError, match="budget_tokens"):
        take_conversations(tokenizer, source, tmp_path / "o.jsonl", budget_tokens=0, seq_len=512)
    with pytest.raises(ValueError, match="seq_len"):
        take_conversations(tokenizer, source, tmp_path / "o.jsonl", budget_tokens=10, seq_len=MIN_TRAINABLE)
