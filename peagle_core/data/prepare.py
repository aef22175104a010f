"""Data preparation: JSONL chat data -> tokenized, loss-masked, truncated samples plus a draft vocabulary.

`prepare_dataset` writes the prepared-dataset directory of docs/interfaces.md atomically;
`PreparedDataset.open` reads it back.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from peagle_core.data.chat import tokenize_conversation
from peagle_core.data.formats import DEFAULT_MAX_LINE_BYTES, iter_rows
from peagle_core.data.source import InputFile
from peagle_core.data.vocab import build_draft_vocab, token_counts
from peagle_core.errors import DataError, StopRequested, VerifierError
from peagle_core.io import atomic_dir, atomic_write_json
from peagle_core.keys import content_key
from peagle_core.spec import JobSpec

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENS = "tokens.safetensors"
VOCAB = "vocab.safetensors"
MASK_TOKEN_CANDIDATES = ("<|mask|>", "<mask>", "[MASK]", "<|reserved_special_token_0|>")
# Aligned index t trains on token t+2 (docs/interfaces.md), so the first two tokens never count.
_UNTRAINABLE_PREFIX = 2
_SKIPPED_LINES_KEPT = 20  # line numbers of skipped rows the manifest names


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the tokenizer's full definition, special tokens and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(json.dumps(tokenizer.chat_template, sort_keys=True, default=str).encode())
    return h.hexdigest()


def find_mask_token_id(tokenizer: Any, vocab_size: int, verifier_dir: Path | None = None) -> int:
    """The token P-EAGLE feeds at mask depths.

    In order: `mask_token_id` recorded in a toy verifier's `toy_verifier.json`, the tokenizer's mask
    token, a known mask/reserved token, an embedding row beyond the tokenizer (unused by any text),
    then the pad token.
    """
    if verifier_dir is not None and (verifier_dir / "toy_verifier.json").is_file():
        return int(json.loads((verifier_dir / "toy_verifier.json").read_text())["mask_token_id"])
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    vocab = tokenizer.get_vocab()
    for token in MASK_TOKEN_CANDIDATES:
        if token in vocab:
            return int(vocab[token])
    if len(tokenizer) < vocab_size:
        return vocab_size - 1
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    raise VerifierError(
        "cannot choose a mask token: the tokenizer has no mask, reserved or pad token",
        code="verifier_unsupported",
    )


def _load_tokenizer_and_config(verifier: str, revision: str | None, trust_remote_code: bool):
    from transformers import AutoConfig, AutoTokenizer

    local = Path(verifier).expanduser()
    if verifier.startswith(("/", ".", "~")) and not local.is_dir():
        raise VerifierError(f"verifier path {verifier!r} does not exist", code="verifier_not_found")
    name = str(local) if local.is_dir() else verifier
    try:
        config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(
            name, revision=revision, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as exc:
        raise VerifierError(f"cannot load the tokenizer of verifier {verifier!r}: {exc}") from exc
    if not tokenizer.chat_template:
        log.warning("verifier %s has no chat template; only pre-tokenized data can be prepared", verifier)
    return tokenizer, config.get_text_config(), (local if local.is_dir() else None)


class PrepareStopped(StopRequested):
    """`prepare_dataset` ended early because its `should_stop` asked; nothing was written."""


@dataclass
class _Rows:
    """Each kept row's token ids and loss mask (truncated to `seq_len`), the rows' format, and the lines of
    the rows skipped for having no assistant token within `seq_len`."""

    ids: list[torch.Tensor] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)
    source_format: str | None = None
    skipped: list[int] = field(default_factory=list)


def _tokenize_rows(
    tokenizer: Any,
    data_path: Path,
    fmt: str,
    max_line_bytes: int,
    seq_len: int,
    vocab_size: int,
    max_samples: int | None,
    should_stop: Callable[[], bool] | None = None,
) -> _Rows:
    """Tokenize and mask each row up to `seq_len`; DataError naming the line of a row out of the verifier's
    vocabulary. `should_stop` is asked before every row (PrepareStopped)."""
    rows = _Rows()
    for row_format, row in iter_rows(data_path, fmt, max_line_bytes):
        if max_samples is not None and len(rows.ids) >= max_samples:
            break
        if should_stop is not None and should_stop():
            raise PrepareStopped(f"stopped at line {row.line}")
        rows.source_format = row_format
        if row.messages is not None:
            ids, mask = tokenize_conversation(tokenizer, row.messages, line=row.line, max_tokens=seq_len)
        else:
            ids, mask = row.input_ids, row.loss_mask
            too_big = [t for t in ids if t >= vocab_size]
            if too_big:
                raise DataError(
                    f"line {row.line}: token id {too_big[0]} is outside the verifier's vocabulary ({vocab_size})",
                    param=f"line {row.line}",
                )
        ids, mask = ids[:seq_len], mask[:seq_len]
        # A conversation whose first answer starts past seq_len has nothing to train on: one such row
        # of many is left out (and counted), not a reason to fail the job.
        if not any(mask[_UNTRAINABLE_PREFIX:]):
            rows.skipped.append(row.line)
            continue
        rows.ids.append(torch.tensor(ids, dtype=torch.int32))
        rows.masks.append(torch.tensor(mask, dtype=torch.uint8))
    return rows


def skipped_rows_note(manifest: dict[str, Any]) -> str | None:
    """One line saying which rows a preparation left out (None when it kept every row)."""
    n = manifest.get("skipped_rows", 0)
    if not n:
        return None
    lines = ", ".join(map(str, manifest.get("skipped_lines", [])))
    more = ", ..." if n > len(manifest.get("skipped_lines", [])) else ""
    return (
        f"skipped {n} row(s) with no assistant token within seq_len={manifest['seq_len']} "
        f"(line {lines}{more})"
    )


def prepare_dataset(
    verifier_path: str | Path,
    data_path: str | Path | InputFile,
    out_dir: str | Path,
    seq_len: int,
    fmt: str = "auto",
    max_samples: int | None = None,
    draft_vocab_size: int | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    should_stop: Callable[[], bool] | None = None,
) -> PreparedDataset:
    """Tokenize, mask and truncate a JSONL dataset with the verifier's tokenizer; write it to `out_dir`.

    The file is read one line at a time (each at most `max_line_bytes`) and every row is kept only as
    its compact token tensors, so memory follows the tokens kept, not the JSON text; a row costs time in
    proportion to its size, however many turns it has. Raises DataError naming the line for any bad
    row, before anything is written. A row with no trainable token within `seq_len` is left out and
    counted in the manifest (`skipped_rows`, `skipped_lines`); DataError when that leaves no row.
    `should_stop` is asked before each row: PrepareStopped, with nothing written. `data_path` given as
    an `InputFile` is not hashed again.
    """
    if seq_len < _UNTRAINABLE_PREFIX + 1:
        raise DataError(f"seq_len must be >= {_UNTRAINABLE_PREFIX + 1}, got {seq_len}", param="seq_len")
    source = InputFile.coerce(data_path)
    data_path = source.path
    tokenizer, config, verifier_dir = _load_tokenizer_and_config(
        str(verifier_path), revision, trust_remote_code
    )
    vocab_size = int(config.vocab_size)
    rows = _tokenize_rows(
        tokenizer, data_path, fmt, max_line_bytes, seq_len, vocab_size, max_samples, should_stop
    )
    _check_rows(rows, data_path, seq_len)
    input_ids, loss_mask = torch.cat(rows.ids), torch.cat(rows.masks)
    lengths = torch.tensor([0] + [len(t) for t in rows.ids], dtype=torch.int64)
    d2t, t2d = build_draft_vocab(token_counts(input_ids, loss_mask, vocab_size), draft_vocab_size)
    manifest = {
        **_manifest(rows, input_ids, loss_mask, t2d, seq_len=seq_len, max_samples=max_samples),
        **_identity(tokenizer, source, seq_len, rows.source_format, max_samples),
        "verifier_name_or_path": str(verifier_path),
        "verifier_vocab_size": vocab_size,
        "draft_vocab_size": int(d2t.numel()),
        "mask_token_id": find_mask_token_id(tokenizer, vocab_size, verifier_dir),
    }
    with atomic_dir(out_dir) as tmp:
        tokens = {"input_ids": input_ids, "loss_mask": loss_mask, "offsets": torch.cumsum(lengths, 0)}
        save_file(tokens, str(tmp / TOKENS))
        save_file({"d2t": d2t, "t2d": t2d}, str(tmp / VOCAB))
        atomic_write_json(tmp / MANIFEST, manifest)
    return PreparedDataset.open(out_dir)


def _check_rows(rows: Any, data_path: Path, seq_len: int) -> None:
    """DataError when no row is left to train on (naming why); a warning for the rows left out."""
    if rows.skipped and not rows.ids:
        raise DataError(
            f"no row has an assistant token to train on within seq_len={seq_len} ({len(rows.skipped)} "
            f"row(s), from line {rows.skipped[0]}); raise dataset.seq_len or shorten the prompts",
            param="dataset.seq_len",
        )
    if not rows.ids:
        raise DataError(f"{data_path}: the dataset has no rows", param="data")
    if not any(bool(m.any()) for m in rows.masks):  # unreachable through the per-row check: the last guard
        raise DataError("the dataset has no trainable (assistant) token", param="data")
    if rows.skipped:
        log.warning("%s: %d row(s) with nothing to train on within seq_len=%d left out (lines %s)",
                    data_path, len(rows.skipped), seq_len, rows.skipped[:_SKIPPED_LINES_KEPT])  # fmt: skip


def _manifest(
    rows: Any, input_ids: torch.Tensor, loss_mask: torch.Tensor, t2d: torch.Tensor, *, seq_len: int,
    max_samples: int | None,
) -> dict[str, Any]:  # fmt: skip
    """The manifest's counts: samples, tokens, loss tokens, rows left out, the draft vocabulary's coverage."""
    return {
        "format_version": FORMAT_VERSION,
        "num_samples": len(rows.ids),
        "num_tokens": int(input_ids.numel()),
        "num_loss_tokens": int(loss_mask.sum()),
        "skipped_rows": len(rows.skipped),
        "skipped_lines": rows.skipped[:_SKIPPED_LINES_KEPT],
        "seq_len": seq_len,
        "max_samples": max_samples,
        "draft_vocab_coverage": round(float(t2d[input_ids[loss_mask.bool()].long()].float().mean()), 6),
    }


def _identity(
    tokenizer: Any, source: InputFile, seq_len: int, source_format: str, max_samples: int | None
) -> dict[str, Any]:
    """The data's own identity (the hidden-state cache checks it): what the tokens depend on."""
    tok_fp = tokenizer_fingerprint(tokenizer)
    return {
        "source_format": source_format,
        "source_path": str(source.path),
        "source_sha256": source.sha256,
        "tokenizer_fingerprint": tok_fp,
        "fingerprint": content_key(
            "prepared_data", tok_fp, source.sha256, seq_len, source_format, max_samples
        ),
    }


def prepare_for_spec(
    spec: JobSpec,
    data_path: str | Path | InputFile,
    out_dir: str | Path,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    should_stop: Callable[[], bool] | None = None,
) -> PreparedDataset:
    """`prepare_dataset` with the verifier, sequence length, format and vocabulary of a job spec."""
    return prepare_dataset(
        spec.verifier.name_or_path,
        data_path,
        out_dir,
        seq_len=spec.dataset.seq_len,
        fmt=spec.dataset.format,
        max_samples=spec.dataset.max_samples,
        draft_vocab_size=spec.model.draft_vocab_size,
        revision=spec.verifier.revision,
        trust_remote_code=spec.verifier.trust_remote_code,
        max_line_bytes=max_line_bytes,
        should_stop=should_stop,
    )


class PreparedDataset:
    """A prepared dataset directory, held in memory: samples are unaligned `(input_ids, loss_mask)`."""

    def __init__(
        self,
        path: Path,
        manifest: dict[str, Any],
        tokens: dict[str, torch.Tensor],
        vocab: dict[str, torch.Tensor],
    ):
        self.path = path
        self.manifest = manifest
        self._input_ids = tokens["input_ids"]
        self._loss_mask = tokens["loss_mask"]
        self._offsets = tokens["offsets"]
        self.d2t: torch.Tensor = vocab["d2t"]
        self.t2d: torch.Tensor = vocab["t2d"]
        self.lengths: list[int] = (self._offsets[1:] - self._offsets[:-1]).tolist()

    @classmethod
    def open(cls, path: str | Path) -> PreparedDataset:
        """Read a directory written by `prepare_dataset`; DataError if it is missing or inconsistent."""
        path = Path(path)
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            tokens = load_file(str(path / TOKENS))
            vocab = load_file(str(path / VOCAB))
        except (OSError, json.JSONDecodeError, SafetensorError) as exc:
            raise DataError(
                f"{path}: not a readable prepared dataset ({exc})", code="dataset_corrupt"
            ) from exc
        if manifest.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{path}: prepared-dataset format {manifest.get('format_version')} is not {FORMAT_VERSION}",
                code="dataset_corrupt",
            )
        offsets = tokens.get("offsets")
        if (
            offsets is None
            or offsets.numel() != manifest["num_samples"] + 1
            or int(offsets[-1]) != tokens["input_ids"].numel()
            or tokens["loss_mask"].numel() != tokens["input_ids"].numel()
        ):
            raise DataError(f"{path}: tokens do not match the manifest", code="dataset_corrupt")
        return cls(path, manifest, tokens, vocab)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        s, e = int(self._offsets[i]), int(self._offsets[i + 1])
        return self._input_ids[s:e].long(), self._loss_mask[s:e].long()

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def mask_token_id(self) -> int:
        return int(self.manifest["mask_token_id"])

    def split(self, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
        """Seeded `(train_indices, val_indices)`, each sorted; both non-empty when 0 < fraction and n >= 2."""
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError("val_fraction must be in [0, 1)")
        n = len(self)
        n_val = round(n * val_fraction)
        if val_fraction > 0 and n >= 2:
            n_val = min(max(n_val, 1), n - 1)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        return sorted(perm[n_val:]), sorted(perm[:n_val])
