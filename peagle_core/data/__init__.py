"""Training data: JSONL readers and validation, chat masks, preparation, draft vocabulary and packing.

`validate_jsonl` needs no torch (the API calls it on upload); the torch-backed names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from peagle_core.data.formats import ValidationReport, validate_jsonl

if TYPE_CHECKING:
    from peagle_core.data.prepare import PreparedDataset, prepare_dataset

__all__ = ["PreparedDataset", "ValidationReport", "prepare_dataset", "validate_jsonl"]


def __getattr__(name: str) -> Any:
    if name in ("PreparedDataset", "prepare_dataset"):
        from peagle_core.data import prepare

        return getattr(prepare, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
