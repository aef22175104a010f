"""What a string from a client may hold: the one rule for spec fields, names, data rows, headers and query
parameters.

Two classes of text. Free text (prompts, dataset messages) is what a model may legitimately see: tabs,
newlines and any Unicode are kept; only what no store or tokenizer can hold is refused: NUL (Postgres text
columns cannot store it, C-string tokenizers truncate at it) and lone surrogates (not encodable as UTF-8,
so neither a database, a JSON response nor a tokenizer can take them). Names (job names, paths, ids, keys,
cursors) also refuse every other control character: a newline or an escape sequence in a name forges log
lines and terminal output, and no real name needs one.
"""

from __future__ import annotations

import re

# Far above any legitimate value (the longest field, an evaluation prompt, allows 32768 characters); a
# field without a tighter bound of its own is capped here, so no string is unbounded.
MAX_TEXT_CHARS = 1 << 16

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
# C0 controls, DEL and C1 controls (Unicode category Cc).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def text_problem(
    value: str, *, free_text: bool = False, max_chars: int | None = MAX_TEXT_CHARS
) -> str | None:
    """Why `value` cannot be accepted, as a message (never echoing the value), or None when it can.
    `max_chars=None` leaves the length to the caller (a data line is bounded by its byte length)."""
    if max_chars is not None and len(value) > max_chars:
        return f"longer than {max_chars} characters ({len(value)})"
    match = (_UNSTORABLE if free_text else _CONTROL).search(value)
    if match is None:
        return None
    char = match.group()
    where = f"at character {match.start() + 1}"
    if char == "\x00":
        return f"contains a NUL character (U+0000) {where}"
    if "\ud800" <= char <= "\udfff":
        return f"contains a lone surrogate (U+{ord(char):04X}) {where}, which is not valid Unicode text"
    return f"contains a control character (U+{ord(char):04X}) {where}; names may not hold any"


def printable(value: str, *, controls: bool = True) -> str:
    """`value` with unstorable characters (and, with `controls`, every control character) escaped
    (`\\x00`, `\\ud800`): safe to echo in an error message or a log line, whatever a client sent."""
    pattern = _CONTROL if controls else _UNSTORABLE
    return pattern.sub(
        lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"), value
    )


def first_text_problem(value: object) -> str | None:
    """The first unstorable string (a key or a value) anywhere in parsed JSON, as free text, with where it
    is (`messages[1].content: ...`); walked without recursion, so any depth the parser took is safe."""
    # One regex search per string and no path built: a many-turn row costs what its text does. Where the
    # problem is, is worked out only when there is one.
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _UNSTORABLE.search(item) is not None:
                return _locate_text_problem(value)
        elif isinstance(item, dict):
            if any(_UNSTORABLE.search(key) is not None for key in item if isinstance(key, str)):
                return _locate_text_problem(value)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _locate_text_problem(value: object) -> str | None:
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if (problem := text_problem(item, free_text=True, max_chars=None)) is not None:
                return f"{where or 'value'}: {problem}"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                path = f"{where}.{key}" if where else str(key)
                if (problem := text_problem(key, free_text=True, max_chars=None)) is not None:
                    return f"a key in {where or 'the row'}: {problem}"
                stack.append((printable(path), child))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None
