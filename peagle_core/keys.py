"""The pipeline's stage names and the content keys of its reusable stages: one hash recipe, one verifier
fingerprint.

A stage key is a pure function of (spec, source digest, verifier fingerprint): two jobs whose keys are
equal may share that stage's output. Every key is `content_key`'s full sha256; nothing else hashes a key.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peagle_core.io import sha256_file

if TYPE_CHECKING:
    from peagle_core.spec import JobSpec

REGENERATE = "regenerate"
PREPARE = "prepare"
HIDDEN_STATES = "hidden_states"
TRAIN = "train"
EVAL = "eval"
EXPORT = "export"
STAGES = (REGENERATE, PREPARE, HIDDEN_STATES, TRAIN, EVAL, EXPORT)

# Bump a stage's version when the rules that produce its output change: every stored output of the stage
# (and of the stages keyed on it) is then recomputed instead of reused.
VERSIONS = {REGENERATE: 1, PREPARE: 1, HIDDEN_STATES: 1}
REGEN_VERSION = VERSIONS[REGENERATE]

# Files of a verifier directory that define it: config, weights, tokenizer, chat template, remote code.
_VERIFIER_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja", ".py")


def content_key(*parts: Any) -> str:
    """The one key recipe: the hex sha256 of the parts as canonical JSON."""
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


# ------------------------------------------------------------------------------ the verifier fingerprint

_fp_lock = threading.Lock()
_fp_memo: dict[tuple[Any, ...], str] = {}


def verifier_fingerprint(name_or_path: str | os.PathLike[str], revision: str | None = None) -> str:
    """What a verifier is, by content: the sha256 of a local directory's defining files (relative name,
    size, sha256), so a renamed copy has the same fingerprint and a changed weight file another. A hub id
    is its name and revision (pin a commit for a content address).

    Read from the files, not a loaded model, so a stage's output can be looked up before anything loads.
    Memoised per process on the files' sizes and modification times (hashing weights takes seconds)."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        return content_key("hub", str(name_or_path), revision)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _VERIFIER_SUFFIXES)
    stats = tuple((f.relative_to(path).as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    memo_key = (str(path.resolve()), stats)
    with _fp_lock:
        if memo_key in _fp_memo:
            return _fp_memo[memo_key]
    h = hashlib.sha256()
    for f, (rel, size, _) in zip(files, stats, strict=True):
        h.update(f"{rel}|{size}|{sha256_file(f)}\n".encode())
    fp = h.hexdigest()
    with _fp_lock:
        _fp_memo[memo_key] = fp
    return fp


# ------------------------------------------------------------------------------ stage keys


def regeneration_inputs(spec: JobSpec) -> dict[str, Any]:
    """The spec's fields a regeneration depends on besides the verifier and the data: the fields of
    `peagle_core.regeneration.rewrite.RegenParams` (the spec must ask for regeneration)."""
    regen, data = spec.dataset.regenerate, spec.dataset
    if regen is None:
        raise ValueError("the spec does not ask for regeneration")
    return {
        "max_new_tokens": regen.max_new_tokens,
        "temperature": regen.temperature,
        "engine": regen.engine,
        "turns": regen.turns,
        "seq_len": data.seq_len,
        "fmt": data.format,
        "max_samples": data.max_samples,
        "dtype": spec.verifier.dtype,
        "seed": spec.training.seed,
    }


def regenerate_key_from_params(params: Any, source_sha256: str, verifier_fp: str) -> str:
    """The regeneration of `source_sha256`'s data by the verifier `verifier_fp` with `params` (a
    `RegenParams`, or its fields as a dict)."""
    fields = dict(params) if isinstance(params, dict) else asdict(params)
    if (
        fields.get("turns", "all") == "all"
    ):  # the default leaves the keys of earlier regenerations as they were
        fields.pop("turns", None)
    return content_key(REGENERATE, REGEN_VERSION, verifier_fp, source_sha256, fields)


def regenerate_key(spec: JobSpec, source_sha256: str, verifier_fp: str) -> str:
    """`regenerate_key_from_params` with the spec's regeneration parameters."""
    return regenerate_key_from_params(regeneration_inputs(spec), source_sha256, verifier_fp)


def prepare_key(spec: JobSpec, source_sha256: str, verifier_fp: str) -> str:
    """The prepared dataset: the data it reads (the regeneration when the spec asks for one), the verifier,
    and the spec's data options."""
    data = source_sha256
    if spec.dataset.regenerate is not None:
        data = regenerate_key(spec, source_sha256, verifier_fp)
    d = spec.dataset
    options = [d.seq_len, d.format, d.max_samples, spec.model.draft_vocab_size]
    return content_key(PREPARE, VERSIONS[PREPARE], data, verifier_fp, options)


def hidden_states_key(spec: JobSpec, source_sha256: str, verifier_fp: str) -> str:
    """The hidden-state cache: the prepared data, the verifier layers and the storage dtype. Without
    `verifier.layer_ids` the layers are the defaults, or an `init_from` checkpoint's."""
    layers: Any = spec.verifier.layer_ids or ["init_from", spec.model.init_from]
    return content_key(
        HIDDEN_STATES,
        VERSIONS[HIDDEN_STATES],
        prepare_key(spec, source_sha256, verifier_fp),
        layers,
        spec.hidden_states.dtype,
    )
