"""Chat-template rendering and exact assistant loss masks, in time linear in the conversation.

With `{% generation %}` markers in the template, HF's assistant mask is used. Otherwise an assistant turn's
tokens are those between `render_chat(messages[:i], gen_prompt)` and `render_chat(messages[:i+1])` in the full
conversation's tokens (common prefixes, so a tokenizer merging across a turn boundary is handled). The
conversation is tokenized once, only up to `max_tokens`; a prefix's tokens are read off it, re-tokenizing
only the text after its last added token (`peagle_core.data.tokens`).
"""

from __future__ import annotations

import bisect
from typing import Any

from peagle_core.data.tokens import PrefixTokenizer, prefix_tokenizer
from peagle_core.errors import DataError


def has_generation_markers(tokenizer: Any) -> bool:
    """True when the chat template marks assistant spans itself (`{% generation %}`)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default", "")
    return isinstance(template, str) and "{% generation %}" in template.replace(
        "{%- generation", "{% generation"
    )


def render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template applied to `messages`, as text."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of already-rendered text (the template adds any BOS itself)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_chars(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (string compares run in C; a bisection)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _mask_by_offsets(
    tokenizer: Any, messages: list[dict[str, str]], max_tokens: int | None
) -> tuple[list[int], list[int]]:
    """`_mask_by_prefixes`' spans, rendering the conversation once and tokenizing it up to `max_tokens`.

    Turns are taken in order and stop at the first that starts past `max_tokens`, so a many-turn row costs
    what its first `max_tokens` tokens do, plus one render.
    """
    enc = prefix_tokenizer(tokenizer)
    text = render_chat(tokenizer, messages)
    full = enc.encode(text, max_tokens)
    limit = len(full.ids)
    ends = [e for _, _, e in full.added]

    def shared(other: str) -> int:
        """`_common_prefix(ids, encode(other))`, at most `limit`: the tokens before the last added token
        that `other` shares with `text` are the same in both, so only the rest of `other` is tokenized."""
        k = bisect.bisect_right(ends, _common_chars(text, other)) - 1
        base, at = (full.added[k][0], full.added[k][1]) if k >= 0 else (0, 0)
        if base >= limit:
            return limit
        return base + _common_prefix(full.ids[base:], enc.encode(other[at:], limit - base).ids)

    mask = [0] * limit
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = shared(render_chat(tokenizer, messages[:i], add_generation_prompt=True))
        if start >= limit:
            break
        end = shared(render_chat(tokenizer, messages[: i + 1]))
        mask[start:end] = [1] * max(0, end - start)
    return full.ids, mask


def _mask_by_prefixes(
    tokenizer: Any, messages: list[dict[str, str]], max_tokens: int | None
) -> tuple[list[int], list[int]]:
    """For tokenizers without offsets: each prefix rendered and tokenized whole (turns stop at `max_tokens`)."""
    ids = encode(tokenizer, render_chat(tokenizer, messages))[:max_tokens]
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # common-prefix lengths, not raw lengths: robust to a tokenizer merging across a turn boundary
        start = _common_prefix(
            ids, encode(tokenizer, render_chat(tokenizer, messages[:i], add_generation_prompt=True))
        )
        if start >= len(ids):
            break
        end = _common_prefix(ids, encode(tokenizer, render_chat(tokenizer, messages[: i + 1])))
        for t in range(start, end):
            mask[t] = 1
    return ids, mask


def _mask_by_markers(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = list(out["input_ids"])
    mask = [int(m) for m in out["assistant_masks"]]
    return ids, mask


def tokenize_conversation(
    tokenizer: Any, messages: list[dict[str, str]], line: int | None = None, max_tokens: int | None = None
) -> tuple[list[int], list[int]]:
    """`(input_ids, loss_mask)` of a conversation, its first `max_tokens` tokens (all when None); the mask is 1
    exactly on assistant-turn tokens."""
    try:
        if has_generation_markers(tokenizer):
            ids, mask = _mask_by_markers(tokenizer, messages)
            return ids[:max_tokens], mask[:max_tokens]
        if PrefixTokenizer.supports(tokenizer):
            return _mask_by_offsets(tokenizer, messages, max_tokens)
        return _mask_by_prefixes(tokenizer, messages, max_tokens)
    except DataError:
        raise
    except Exception as exc:  # a template's raise_exception, or a tokenizer without a template
        where = f"line {line}: " if line is not None else ""
        raise DataError(
            f"{where}the chat template failed: {exc}", param=f"line {line}" if line is not None else None
        ) from exc
