"""Response regeneration: the verifier rewrites every assistant turn of a chat dataset (and answers every user
turn of a prompts-only conversation), turn by turn.

Progress is appended to a work log one conversation at a time, so a killed run resumes with no duplicate
and no lost row; the finished JSONL keeps the source's format and gets a provenance record beside it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from peagle_core.data.chat import encode, render_chat
from peagle_core.data.formats import Row, iter_rows
from peagle_core.data.source import InputFile, provenance_path
from peagle_core.errors import DataError
from peagle_core.io import atomic_write_bytes, atomic_write_json, sha256_file
from peagle_core.keys import (
    REGEN_VERSION,
    regenerate_key_from_params,
    regeneration_inputs,
    verifier_fingerprint,
)
from peagle_core.regeneration.generators import Engine, Generator, open_generator

if TYPE_CHECKING:
    from peagle_core.spec import JobSpec
    from peagle_core.vllm_engine import VllmProcess

log = logging.getLogger(__name__)

# Conversations per batch (turn i of each generated together). vLLM schedules a batch as one continuous
# batch: on a 2-core CPU 64 conversations regenerated 2.6x faster than 16, and 128 no faster than 64; a
# batch is also what a killed run can lose, so it stays far below a dataset.
BATCH_SIZE: dict[str, int] = {"transformers": 16, "vllm": 64}

_SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


@dataclass(frozen=True)
class RegenParams:
    """What a regeneration depends on besides the verifier and the data (all part of its fingerprint)."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    engine: Engine = "transformers"
    turns: Literal["all", "first"] = "all"  # "first": later turns kept as written
    seq_len: int = 2048  # a turn whose prompt leaves no room for one answer token within seq_len is skipped
    fmt: str = "auto"
    max_samples: int | None = None
    seed: int = 0
    dtype: str = "auto"  # the verifier's (`verifier.dtype`); vLLM's `auto` is bf16 where bf16 is fast


@dataclass
class RegenReport:
    """Counts of one regeneration (the whole output, resumed parts included) and this run's speed."""

    status: Literal["completed", "stopped"] = "completed"
    fingerprint: str = ""
    conversations: int = 0  # source conversations done
    total: int = 0  # source conversations in all
    written: int = 0  # rows in the output
    turns: int = 0  # assistant turns rewritten
    skipped_prompt_too_long: int = 0  # turns cut: prompt >= seq_len (the conversation ends before them)
    dropped_empty: int = 0  # turns cut: the verifier generated nothing
    hit_max_new_tokens: int = 0  # turns kept without an end of turn (flagged in the provenance)
    dropped_conversations: int = 0  # conversations left with no assistant turn
    resumed_from: int = 0  # conversations already in the work log when this run started
    reused: bool = False  # a finished regeneration with this fingerprint was found
    generated_tokens: int = 0  # by this run
    seconds: float = 0.0  # of this run's generation

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tokens_per_s": round(self.tokens_per_s, 2)}


# ------------------------------------------------------------------------------ paths


def work_log_path(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def read_provenance(out: str | Path) -> dict[str, Any] | None:
    """The provenance of a finished regeneration at `out`, or None when it is missing or unfinished."""
    out = Path(out)
    try:
        prov = json.loads(provenance_path(out).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return prov if out.is_file() else None


def finished_regeneration(out: str | Path, fingerprint: str) -> dict[str, Any] | None:
    """The provenance at `out` when it records a finished regeneration with `fingerprint` (the reuse
    check), else None."""
    prov = read_provenance(out)
    return prov if prov is not None and prov.get("fingerprint") == fingerprint else None


def regenerated_file(out: str | Path, prov: dict[str, Any]) -> InputFile:
    """The finished output `out` as the next stage's input, its sha256 the one its provenance records
    (hashed once, when it was written)."""
    return InputFile.of(out, sha256=prov.get("output_sha256"))


# ------------------------------------------------------------------------------ the rewrite


@dataclass
class _Conversation:
    index: int
    row: Row
    out: list[dict[str, str]] = field(default_factory=list)
    pos: int = 0
    done: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    flagged_turns: list[int] = field(default_factory=list)

    def bump(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def advance(self) -> None:
        """Copy system and user turns as written up to the next assistant turn (or the end)."""
        msgs = self.row.messages or []
        while self.pos < len(msgs) and msgs[self.pos]["role"] != "assistant":
            self.out.append(dict(msgs[self.pos]))
            self.pos += 1
        if self.pos >= len(msgs):
            self.done = True

    def keep_rest_as_written(self) -> None:
        """After the first rewritten answer: the later turns as written, up to the first answer slot with
        nothing written in it (a prompts-only conversation's), and ending on an answer."""
        msgs = self.row.messages or []
        for m in msgs[self.pos :]:
            if m["role"] == "assistant" and not m["content"].strip():
                break
            self.out.append(dict(m))
        while self.out[-1]["role"] != "assistant":
            self.out.pop()
        self.pos = len(msgs)
        self.done = True

    def cut(self, reason: str) -> None:
        """End the conversation before the current turn; later turns would follow a history that isn't."""
        self.bump(reason)
        while self.out and self.out[-1]["role"] != "assistant":
            self.out.pop()
        self.done = True


def _with_answer_slots(row: Row) -> Row:
    """A prompts-only conversation gets an (empty) assistant turn after each user turn, for the verifier to
    write; a conversation with answers is rewritten where its answers are."""
    if not row.prompts_only or row.messages is None:
        return row
    messages: list[dict[str, str]] = []
    for m in row.messages:
        messages.append(m)
        if m["role"] == "user":
            messages.append({"role": "assistant", "content": ""})
    return replace(row, messages=messages)


def rewrite_conversations(
    rows: Sequence[tuple[int, Row]],
    tokenizer: Any,
    generator: Generator,
    params: RegenParams,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[list[_Conversation], int] | None:
    """Rewrite every assistant turn of `rows` (the first only with `params.turns == "first"`), all
    conversations' turn i in one batch.

    Returns the conversations and the tokens generated, or None when `should_stop` asked to stop first.
    """
    convs = [_Conversation(i, _with_answer_slots(row)) for i, row in rows]
    generated = 0
    while True:
        active = []
        for c in convs:
            if c.done:
                continue
            c.advance()
            if c.done:
                continue
            prompt = encode(tokenizer, render_chat(tokenizer, c.out, add_generation_prompt=True))
            if len(prompt) >= params.seq_len:
                c.cut("skipped_prompt_too_long")
                continue
            active.append((c, prompt))
        if not active:
            return convs, generated
        if should_stop is not None and should_stop():
            return None
        gens = generator.generate([p for _, p in active], params.max_new_tokens)
        for (c, _), g in zip(active, gens, strict=True):
            generated += len(g.tokens)
            text = tokenizer.decode(g.tokens, skip_special_tokens=True)
            if not text.strip():
                c.cut("dropped_empty")
                continue
            c.out.append({"role": "assistant", "content": text})
            c.pos += 1
            c.bump("turns")
            if not g.finished:
                c.bump("hit_max_new_tokens")
                c.flagged_turns.append(sum(m["role"] == "assistant" for m in c.out) - 1)
            if params.turns == "first":
                c.keep_rest_as_written()


def _output_row(messages: list[dict[str, str]], fmt: str, category: str | None = None) -> dict[str, Any]:
    if fmt == "sharegpt":
        row: dict[str, Any] = {
            "conversations": [{"from": _SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages]
        }
    else:
        row = {"messages": messages}
    if category is not None:
        row["category"] = category
    return row


class _WorkLog:
    """`OUT.parts`: a header naming the fingerprint, then one JSON line per finished source conversation."""

    def __init__(self, path: Path, fingerprint: str):
        self.path, self.fingerprint = path, fingerprint
        self.records: dict[int, dict[str, Any]] = {}

    def load(self) -> None:
        """Read what a previous run appended; a torn last line (killed mid-write) is cut off."""
        if not self.path.is_file():
            self._start()
            return
        raw = self.path.read_bytes()
        good = raw[: raw.rfind(b"\n") + 1]
        lines = good.splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
            records = [json.loads(line) for line in lines[1:]]
        except json.JSONDecodeError:
            header, records = {}, []
        if header.get("fingerprint") != self.fingerprint:
            log.warning("%s belongs to another regeneration; starting over", self.path)
            self._start()
            return
        for r in records:
            self.records.setdefault(int(r["i"]), r)  # first wins: a resumed run never rewrites a done row
        if len(good) != len(raw):
            with open(self.path, "r+b") as f:
                f.truncate(len(good))

    def _start(self) -> None:
        atomic_write_bytes(self.path, (json.dumps({"fingerprint": self.fingerprint}) + "\n").encode())

    def append(self, records: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        with open(self.path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        for r in records:
            self.records[int(r["i"])] = r


def rewrite_dataset(
    verifier: str,
    data_path: str | Path | InputFile,
    out: str | Path,
    params: RegenParams,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    batch_size: int | None = None,
    vllm_engine: VllmProcess | None = None,
    on_progress: Callable[[RegenReport], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    verifier_fp: str | None = None,
) -> RegenReport:
    """Rewrite every assistant turn of the chat JSONL `data_path` with the verifier; write `out` (same format).

    Resumes from `OUT.parts` when a run with the same fingerprint was interrupted; returns at once
    (`reused=True`) when `out` already holds it. `vllm_engine` (engine "vllm") is an engine handle to
    reuse, else one is started for this call. `should_stop` is checked before each batch of generations.
    `data_path` given as an `InputFile` is not hashed again.
    """
    out = Path(out)
    source = InputFile.coerce(data_path)
    data_path, source_sha = source.path, source.sha256
    verifier_fp = verifier_fp or verifier_fingerprint(verifier, revision)
    fp = regenerate_key_from_params(params, source_sha, verifier_fp)
    prov = finished_regeneration(out, fp)
    if prov is not None:
        return RegenReport(**{**prov["counts"], "fingerprint": fp, "reused": True, "status": "completed"})

    batch_size = batch_size or BATCH_SIZE[params.engine]
    source_format, rows = _read_chat_rows(data_path, params)
    work, report = _resume(out, fp, len(rows))
    todo = [(i, row) for i, row in enumerate(rows) if i not in work.records]
    if todo:
        tokenizer, generator, close = open_generator(
            params.engine,
            verifier,
            temperature=params.temperature,
            seed=params.seed,
            seq_len=params.seq_len,
            batch_size=batch_size,
            revision=revision,
            trust_remote_code=trust_remote_code,
            vllm_engine=vllm_engine,
            dtype=params.dtype,
        )
        try:
            batches = (todo[s : s + batch_size] for s in range(0, len(todo), batch_size))
            for batch in batches:
                if not _rewrite_batch(
                    batch, tokenizer, generator, params, work, report, source_format, should_stop
                ):
                    report.status = "stopped"
                    return report
                if on_progress is not None:
                    on_progress(report)
        finally:
            close()
    _finish(out, work, report, source_format, source_sha, verifier, verifier_fp, params)
    return report


def _resume(out: Path, fp: str, total: int) -> tuple[_WorkLog, RegenReport]:
    """`out`'s work log (what an interrupted run of `fp` finished) and a report that counts it."""
    work = _WorkLog(work_log_path(out), fp)
    work.load()
    report = RegenReport(fingerprint=fp, total=total, resumed_from=len(work.records))
    _fold_counts(report, work.records.values())
    return work, report


def _rewrite_batch(
    batch: list[tuple[int, Row]],
    tokenizer: Any,
    generator: Generator,
    params: RegenParams,
    work: _WorkLog,
    report: RegenReport,
    source_format: str,
    should_stop: Callable[[], bool] | None,
) -> bool:
    """Rewrite one batch, log its records and count them in `report`; False when `should_stop` cut it short."""
    t0 = time.perf_counter()
    result = rewrite_conversations(batch, tokenizer, generator, params, should_stop)
    if result is None:
        return False
    convs, generated = result
    records = [_record(c, source_format) for c in convs]
    work.append(records)
    report.generated_tokens += generated
    report.seconds += time.perf_counter() - t0
    _fold_counts(report, records)
    return True


def _read_chat_rows(data_path: Path, params: RegenParams) -> tuple[str, list[Row]]:
    rows: list[Row] = []
    fmt = "messages"
    # prompts-only rows are welcome here: the verifier writes their answers
    for fmt, row in iter_rows(data_path, params.fmt, prompts_only_ok=True):
        if fmt == "tokenized":
            raise DataError(
                f"line {row.line}: regeneration needs chat data (messages or sharegpt), not tokenized rows",
                param="dataset.regenerate",
            )
        rows.append(row)
        if params.max_samples is not None and len(rows) >= params.max_samples:
            break
    if not rows:
        raise DataError(f"{data_path}: the dataset has no rows", param="data")
    return fmt, rows


def _record(c: _Conversation, fmt: str) -> dict[str, Any]:
    kept = any(m["role"] == "assistant" for m in c.out)
    counts = dict(c.counts)
    if not kept:
        counts["dropped_conversations"] = 1
    return {
        "i": c.index,
        "line": c.row.line,
        "row": _output_row(c.out, fmt, c.row.category) if kept else None,
        "counts": counts,
        "flagged_turns": c.flagged_turns,
    }


def _fold_counts(report: RegenReport, records: Any) -> None:
    for r in records:
        report.conversations += 1
        report.written += r["row"] is not None
        for key, n in r["counts"].items():
            setattr(report, key, getattr(report, key) + n)


def _finish(
    out: Path,
    work: _WorkLog,
    report: RegenReport,
    source_format: str,
    source_sha: str,
    verifier: str,
    verifier_fp: str,
    params: RegenParams,
) -> None:
    """Write the output in source order, then the provenance (the completion marker), then drop the log."""
    records = [work.records[i] for i in sorted(work.records)]
    if not any(r["row"] is not None for r in records):
        raise DataError(
            "regeneration left no conversation to train on (every prompt too long or every answer empty)",
            param="dataset.regenerate",
        )
    data = "".join(json.dumps(r["row"], ensure_ascii=False) + "\n" for r in records if r["row"] is not None)
    atomic_write_bytes(out, data.encode())
    flagged = []
    n = 0
    for r in records:
        if r["row"] is not None:
            flagged += [{"row": n, "source_line": r["line"], "turn": t} for t in r["flagged_turns"]]
            n += 1
    counts = {
        k: v
        for k, v in report.to_dict().items()
        if k not in ("status", "reused", "tokens_per_s", "fingerprint")
    }
    atomic_write_json(
        provenance_path(out),
        {
            "regen_version": REGEN_VERSION,
            "fingerprint": report.fingerprint,
            "verifier": verifier,
            "verifier_fingerprint": verifier_fp,
            "source_sha256": source_sha,
            "source_format": source_format,
            "output_sha256": sha256_file(out),
            "params": asdict(params),
            "counts": counts,
            "hit_max_new_tokens_turns": flagged,
        },
    )
    work.path.unlink(missing_ok=True)


def params_for_spec(spec: JobSpec) -> RegenParams:
    """The regeneration parameters of a job spec whose `dataset.regenerate` is set."""
    return RegenParams(**regeneration_inputs(spec))
