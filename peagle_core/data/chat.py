"""Chat-template rendering and exact assistant loss masks.

With `{% generation %}` markers in the template, HF's assistant mask is used. Otherwise each assistant turn
is located by rendering prefixes: the turn's tokens are those between `render(messages[:i], gen_prompt)`
and `render(messages[:i+1])` in the full conversation's tokens.
"""

from __future__ import annotations

from typing import Any

from peagle_core.errors import DataError


def has_generation_markers(tokenizer: Any) -> bool:
    """True when the chat template marks assistant spans itself (`{% generation %}`)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default", "")
    return isinstance(template, str) and "{% generation %}" in template.replace(
        "{%- generation", "{% generation"
    )


def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
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


def _mask_by_prefixes(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    ids = encode(tokenizer, render(tokenizer, messages))
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # common-prefix lengths, not raw lengths: robust to a tokenizer merging across a turn boundary
        start = _common_prefix(
            ids, encode(tokenizer, render(tokenizer, messages[:i], add_generation_prompt=True))
        )
        end = _common_prefix(ids, encode(tokenizer, render(tokenizer, messages[: i + 1])))
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
    tokenizer: Any, messages: list[dict[str, str]], line: int | None = None
) -> tuple[list[int], list[int]]:
    """`(input_ids, loss_mask)` of a conversation; the mask is 1 exactly on assistant-turn tokens."""
    try:
        if has_generation_markers(tokenizer):
            return _mask_by_markers(tokenizer, messages)
        return _mask_by_prefixes(tokenizer, messages)
    except DataError:
        raise
    except Exception as exc:  # a template's raise_exception, or a tokenizer without a template
        where = f"line {line}: " if line is not None else ""
        raise DataError(
            f"{where}the chat template failed: {exc}", param=f"line {line}" if line is not None else None
        ) from exc
