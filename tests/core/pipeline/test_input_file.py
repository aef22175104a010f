"""The pipeline owns its input's identity: one job checks and hashes each dataset file it reads once."""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

import peagle_core.data.prepare  # loaded before `hashed` looks for its sha256_file
import peagle_core.io
import peagle_core.regeneration.rewrite
from peagle_core.data.source import InputFile
from peagle_core.errors import DataError
from peagle_core.pipeline.stages import REGENERATED, run_pipeline
from peagle_core.spec import parse_spec
from tests.core.helpers import make_spec


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Counter[Path]:
    """Every file `peagle_core.io.sha256_file` reads from here on, counted, wherever it was imported."""
    original = peagle_core.io.sha256_file
    passes: Counter[Path] = Counter()

    def counting(path, *args, **kwargs):
        passes[Path(path).resolve()] += 1
        return original(path, *args, **kwargs)

    for module in list(sys.modules.values()):
        # The module's own namespace: a lazy module's __getattr__ would import things.
        if getattr(module, "__dict__", {}).get("sha256_file") is original:
            monkeypatch.setattr(module, "sha256_file", counting)
    return passes


def test_a_job_hashes_its_dataset_once(
    toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path, hashed: Counter[Path]
) -> None:
    data = tmp_path / "data.jsonl"
    shutil.copy(toy_dataset_path, data)
    spec = make_spec(toy_verifier_dir, data, max_steps=1)
    result = run_pipeline(spec, tmp_path / "run")
    assert result.status == "completed" and result.export_dir is not None
    assert hashed[data.resolve()] == 1


def test_a_regenerating_job_hashes_the_source_and_the_rewrite_once_each(
    toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path, hashed: Counter[Path]
) -> None:
    data = tmp_path / "data.jsonl"
    shutil.copy(toy_dataset_path, data)
    fields = make_spec(toy_verifier_dir, data, max_steps=1).model_dump(mode="json", exclude_none=True)
    fields["dataset"] |= {"max_samples": 24, "regenerate": {"max_new_tokens": 4}}
    spec = parse_spec(fields)
    result = run_pipeline(spec, tmp_path / "run")
    assert result.status == "completed"
    (rewrite,) = (tmp_path / "run" / "regenerated").glob(f"*/{REGENERATED}")
    # The rewrite is hashed as it is written (its provenance); prepare reads that digest.
    assert hashed[data.resolve()] == 1 and hashed[rewrite.resolve()] == 1


def test_an_input_file_is_checked_and_hashed_once_or_not_at_all(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist on the worker") as info:
        InputFile.of(tmp_path / "missing.jsonl", param="dataset.path", where=" on the worker")
    assert info.value.param == "dataset.path"
    data = tmp_path / "data.jsonl"
    data.write_text('{"messages": []}\n')
    known = InputFile.of(data, sha256="0" * 64)
    assert known.sha256 == "0" * 64 and known.size == data.stat().st_size
    assert InputFile.coerce(known) is known
    assert InputFile.of(data).sha256 == peagle_core.io.sha256_file(data)
