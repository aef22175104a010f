"""The leading tokens of a long text without tokenizing all of it: the text is cut just before an added
(special) token, where the tokenizer splits it anyway, so the tokens kept are exactly the whole text's."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

# Tokens kept past the limit before a cut: an added token's strip options could touch the ones just before it.
_MARGIN = 16
# Characters first tried per wanted token (about 4 in English; the cut moves on when it gets too few).
_CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Tokens:
    """The first tokens of a text and where its added tokens are: `(token index, start char, end char)`."""

    ids: list[int]
    added: list[tuple[int, int, int]]


class PrefixTokenizer:
    """A fast (offset-tracking) HF tokenizer that tokenizes only as much of a text as a caller needs.

    Correct because HF tokenizers split a text at its added tokens first and tokenize the pieces
    independently: the tokens before an added token do not depend on anything after it.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # Only tokens that match wherever their text occurs are cut points and anchors.
        self._content = {
            i: t.content
            for i, t in tokenizer.added_tokens_decoder.items()
            if t.content and not (t.single_word or t.lstrip or t.rstrip)
        }
        contents = sorted(set(self._content.values()), key=len, reverse=True)
        self._next_added = re.compile("|".join(map(re.escape, contents))) if contents else None

    @staticmethod
    def supports(tokenizer: Any) -> bool:
        return bool(getattr(tokenizer, "is_fast", False)) and hasattr(tokenizer, "added_tokens_decoder")

    def encode(self, text: str, limit: int | None = None) -> Tokens:
        """The first `limit` tokens of `text` (all of them when None or fewer), as `encode` gives them for
        the whole text, with no special tokens added."""
        if limit is not None and self._next_added is not None:
            want = limit + _MARGIN
            chars = _CHARS_PER_TOKEN * want
            # Each try at least doubles the text tokenized, so the tries cost at most twice the last.
            while chars < len(text) and (m := self._next_added.search(text, chars)) is not None:
                got = self._encode(text[: m.start()])
                if len(got.ids) >= want:
                    return _head(got, limit)
                chars = 2 * m.start() + 1
        got = self._encode(text)
        return got if limit is None else _head(got, limit)

    def _encode(self, text: str) -> Tokens:
        out = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(out["input_ids"])
        added = [
            (k, s, e)
            for k, (t, (s, e)) in enumerate(zip(ids, out["offset_mapping"], strict=True))
            if self._content.get(t) is not None and text[s:e] == self._content[t]
        ]
        return Tokens(ids, added)


def _head(tokens: Tokens, limit: int) -> Tokens:
    return Tokens(tokens.ids[:limit], [a for a in tokens.added if a[0] < limit])


def prefix_tokenizer(tokenizer: Any) -> PrefixTokenizer:
    """The `PrefixTokenizer` of `tokenizer`, built once per tokenizer (it compiles a pattern of the added
    tokens: per row, that would cost more than the row)."""
    try:
        return _cached(tokenizer)
    except TypeError:  # an unhashable tokenizer: built for this call
        return PrefixTokenizer(tokenizer)


_cached = functools.lru_cache(maxsize=8)(PrefixTokenizer)
