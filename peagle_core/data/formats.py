"""JSONL readers for the three input formats (messages, ShareGPT, pre-tokenized) and their structural checks.

Every row is normalised to a `Row`; every problem raises DataError naming the 1-based line number.
No tokenizer is needed, so the service can validate an upload as it streams in.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from peagle_core.documents import DocumentError, load_json_line
from peagle_core.errors import DataError
from peagle_core.text import first_text_problem

Format = Literal["messages", "sharegpt", "tokenized"]
FORMATS: tuple[str, ...] = ("auto", "messages", "sharegpt", "tokenized")
# One JSONL line is parsed into Python objects about 12x its size, so a line's length bounds the memory a
# reader needs. 8 MiB holds a 131072-token pre-tokenized row or ~2M characters of chat several times over.
DEFAULT_MAX_LINE_BYTES = 8 << 20
MAX_ROW_CATEGORY_CHARS = 200
# Token ids travel as int32 in packed batches and caches; no vocabulary comes near it.
MAX_TOKEN_ID = (1 << 31) - 1
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
}


@dataclass
class Row:
    """One normalised sample: a conversation (`messages`) or pre-tokenized `input_ids` + `loss_mask`."""

    line: int
    messages: list[dict[str, str]] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    category: str | None = None  # a chat row's optional top-level "category" (per-category reports)

    @property
    def prompts_only(self) -> bool:
        """A conversation with no assistant turn: trainable only once the verifier writes the answers."""
        return self.messages is not None and not any(m["role"] == "assistant" for m in self.messages)


@dataclass
class ValidationReport:
    """What `validate_jsonl` found: row count, detected format, assistant turns (0 for tokenized)."""

    rows: int
    format: Format
    assistant_turns: int = 0
    prompts_only_rows: int = 0  # conversations with no assistant turn (valid only with regeneration)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "format": self.format,
            "assistant_turns": self.assistant_turns,
            "prompts_only_rows": self.prompts_only_rows,
        }


def require_dataset_file(path: str | Path, *, param: str = "data", where: str = "") -> Path:
    """`path` as a Path if it is a file; otherwise DataError `dataset_not_found` naming it (and `where`,
    e.g. " on the worker") for the input `param`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"dataset file {str(path)!r} does not exist{where}", code="dataset_not_found", param=param
        )
    return path


def detect_format(obj: Any) -> Format | None:
    """The format a parsed row looks like, or None."""
    if not isinstance(obj, dict):
        return None
    if "messages" in obj:
        return "messages"
    if "conversations" in obj:
        return "sharegpt"
    if "input_ids" in obj:
        return "tokenized"
    return None


def _turns(obj: dict[str, Any], fmt: Format, line: int, prompts_only_ok: bool) -> list[dict[str, str]]:
    key, role_key, text_key = (
        ("messages", "role", "content") if fmt == "messages" else ("conversations", "from", "value")
    )
    turns = obj.get(key)
    if not isinstance(turns, list):
        raise DataError(f"line {line}: '{key}' must be a list of turns", param=f"line {line}")
    if not turns:
        raise DataError(f"line {line}: empty conversation", param=f"line {line}")
    messages = []
    for i, turn in enumerate(turns):
        # The error's text is built only for the turn at fault: a row may have many thousands of turns.
        if not isinstance(turn, dict):
            raise DataError(f"line {line}: {key}[{i}] must be an object", param=f"line {line}")
        role = turn.get(role_key)
        text = turn.get(text_key)
        if not isinstance(role, str):
            raise DataError(f"line {line}: {key}[{i}] has no '{role_key}' string", param=f"line {line}")
        if fmt == "messages":
            if role not in ROLES:
                raise DataError(
                    f"line {line}: {key}[{i}]: unknown role {role!r} (expected one of {', '.join(ROLES)})",
                    param=f"line {line}",
                )
        else:
            if role.lower() not in SHAREGPT_ROLES:
                raise DataError(
                    f"line {line}: {key}[{i}]: unknown role {role!r} "
                    f"(expected one of {', '.join(sorted(SHAREGPT_ROLES))})",
                    param=f"line {line}",
                )
            role = SHAREGPT_ROLES[role.lower()]
        if not isinstance(text, str):
            raise DataError(f"line {line}: {key}[{i}] has no '{text_key}' string", param=f"line {line}")
        messages.append({"role": role, "content": text})
    if all(m["role"] == "system" for m in messages):
        raise DataError(f"line {line}: empty conversation (only system turns)", param=f"line {line}")
    if not prompts_only_ok and not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            f"line {line}: no assistant turn, nothing to train on (prompts-only data needs "
            "dataset.regenerate, so that the verifier writes the answers)",
            param=f"line {line}",
        )
    return messages


def _category(obj: dict[str, Any], line: int) -> str | None:
    cat = obj.get("category")
    if cat is None or cat == "":
        return None
    if not isinstance(cat, str) or not 0 < len(cat) <= MAX_ROW_CATEGORY_CHARS:
        raise DataError(
            f"line {line}: 'category' must be a string of 1 to {MAX_ROW_CATEGORY_CHARS} characters",
            param=f"line {line}",
        )
    return cat


def _tokenized(obj: dict[str, Any], line: int) -> Row:
    ids, mask = obj.get("input_ids"), obj.get("loss_mask")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise DataError(f"line {line}: 'input_ids' must be a list of integers", param=f"line {line}")
    if not ids:
        raise DataError(f"line {line}: empty 'input_ids'", param=f"line {line}")
    if any(t < 0 for t in ids):
        raise DataError(f"line {line}: 'input_ids' has a negative id", param=f"line {line}")
    if any(t > MAX_TOKEN_ID for t in ids):
        raise DataError(
            f"line {line}: 'input_ids' has an id above {MAX_TOKEN_ID} (no vocabulary is that large)",
            param=f"line {line}",
        )
    if mask is None:
        raise DataError(f"line {line}: missing 'loss_mask'", param=f"line {line}")
    if not isinstance(mask, list) or not all(m in (0, 1) and not isinstance(m, float) for m in mask):
        raise DataError(f"line {line}: 'loss_mask' must be a list of 0/1", param=f"line {line}")
    if len(mask) != len(ids):
        raise DataError(
            f"line {line}: 'loss_mask' has {len(mask)} entries but 'input_ids' has {len(ids)}",
            param=f"line {line}",
        )
    if not any(mask):
        raise DataError(f"line {line}: 'loss_mask' is all zeros, nothing to train on", param=f"line {line}")
    return Row(line=line, input_ids=[int(t) for t in ids], loss_mask=[int(m) for m in mask])


def parse_row(obj: Any, fmt: Format, line: int, prompts_only_ok: bool = False) -> Row:
    """Check one parsed JSON row against `fmt` and normalise it.

    A conversation without an assistant turn is an error unless `prompts_only_ok` (regeneration writes
    the answers)."""
    seen = detect_format(obj)
    if seen != fmt:
        what = "not a JSON object" if not isinstance(obj, dict) else f"looks like {seen or 'no known format'}"
        raise DataError(f"line {line}: expected a {fmt} row, {what}", param=f"line {line}")
    if fmt == "tokenized":
        return _tokenized(obj, line)
    return Row(line=line, messages=_turns(obj, fmt, line, prompts_only_ok), category=_category(obj, line))


def _lines(source: str | Path | IO[bytes] | IO[str], max_line_bytes: int) -> Iterator[tuple[int, str]]:
    """Lines one at a time, never reading more than `max_line_bytes` (+ the newline) of any line."""
    if isinstance(source, str | Path):
        with open(source, "rb") as f:
            yield from _lines(f, max_line_bytes)
        return
    n = 0
    while raw := source.readline(max_line_bytes + 1):
        n += 1
        if len(raw.rstrip(b"\r\n" if isinstance(raw, bytes) else "\r\n")) > max_line_bytes:
            raise DataError(
                f"line {n}: longer than {max_line_bytes} bytes (the limit, PEAGLE_MAX_LINE_BYTES)",
                code="line_too_long",
                param=f"line {n}",
            )
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"line {n}: not valid UTF-8 ({exc.reason})", param=f"line {n}") from exc
        yield n, raw


def iter_rows(
    source: str | Path | IO[bytes] | IO[str],
    fmt: str = "auto",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    prompts_only_ok: bool = False,
) -> Iterator[tuple[Format, Row]]:
    """Parse and check a JSONL source row by row; `auto` takes the format of the first row.

    Memory is bounded by one line: a line longer than `max_line_bytes` raises DataError naming it.
    `prompts_only_ok` accepts conversations without an assistant turn (see `parse_row`)."""
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r} (expected one of {', '.join(FORMATS)})", param="format")
    resolved: Format | None = None if fmt == "auto" else fmt  # type: ignore[assignment]
    for n, text in _lines(source, max_line_bytes):
        if not text.strip():
            continue
        try:
            obj = load_json_line(text)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"line {n}: malformed JSON ({exc.msg} at column {exc.colno})", param=f"line {n}"
            ) from exc
        except DocumentError as exc:
            # Numbers no field takes (NaN, infinities, overflowing floats, integers past the digit
            # limit) and nesting past the parser's: the line, never a 500.
            raise DataError(f"line {n}: {exc}", code="invalid_number", param=f"line {n}") from None
        # Text a tokenizer or a store cannot take (NUL, lone surrogates) is refused here, naming the line;
        # tabs, newlines and any other Unicode are data a model may see.
        if (problem := first_text_problem(obj)) is not None:
            raise DataError(f"line {n}: {problem}", code="invalid_text", param=f"line {n}")
        if resolved is None:
            resolved = detect_format(obj)
            if resolved is None:
                raise DataError(
                    f"line {n}: cannot detect the format: expected a 'messages', 'conversations' or "
                    "'input_ids' key",
                    param=f"line {n}",
                )
        yield resolved, parse_row(obj, resolved, n, prompts_only_ok)


def validate_jsonl(
    source: str | Path | IO[bytes] | IO[str] | bytes,
    fmt: str = "auto",
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    prompts_only_ok: bool = False,
) -> ValidationReport:
    """Check a JSONL dataset's structure without a tokenizer, one line at a time; raises DataError naming
    the first bad line (malformed, nested too deeply, longer than `max_line_bytes`). With
    `prompts_only_ok`, conversations without an assistant turn are counted instead of refused."""
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    rows = assistant = prompts_only = 0
    resolved: Format | None = None
    for fmt_seen, row in iter_rows(source, fmt, max_line_bytes, prompts_only_ok):
        resolved = fmt_seen
        rows += 1
        if row.messages is not None:
            assistant += sum(m["role"] == "assistant" for m in row.messages)
            prompts_only += row.prompts_only
    if rows == 0 or resolved is None:
        raise DataError("the dataset has no rows", param="data")
    return ValidationReport(
        rows=rows, format=resolved, assistant_turns=assistant, prompts_only_rows=prompts_only
    )
