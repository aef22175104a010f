"""A stage's input file, established once: checked to exist and hashed a single time, then passed down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from peagle_core.data.formats import require_dataset_file
from peagle_core.io import sha256_file


@dataclass(frozen=True)
class InputFile:
    """A dataset file a stage reads: its path, sha256 (the stage keys' source digest) and size in bytes.

    Built once per stage input (`of`) and handed to every consumer, so a multi-GB JSONL is checked and
    hashed once per job, not by each stage again."""

    path: Path
    sha256: str
    size: int

    @classmethod
    def of(
        cls, path: str | Path, *, param: str = "data", where: str = "", sha256: str | None = None
    ) -> InputFile:
        """`path` as an input: DataError `dataset_not_found` (naming `param`, and `where`) unless it is a
        file; hashed unless its sha256 is already known (a stored dataset's, a regeneration's provenance)."""
        path = require_dataset_file(path, param=param, where=where)
        return cls(path, sha256 if sha256 is not None else sha256_file(path), path.stat().st_size)

    @classmethod
    def coerce(cls, source: str | Path | InputFile, *, param: str = "data") -> InputFile:
        """`source` itself when it is an `InputFile` already, else `of(source)`."""
        return source if isinstance(source, InputFile) else cls.of(source, param=param)


def provenance_path(out: Path) -> Path:
    """Where the provenance record of a written dataset file lies: beside it, `OUT.provenance.json`."""
    return out.with_name(out.name + ".provenance.json")
