"""Prepared data is shared within a project and keyed by the verifier's content, never across projects:
a project cannot learn (from a reuse, or its speed) that another one trained on the same data."""

from __future__ import annotations

import shutil
from pathlib import Path

from peagle_core.io import sha256_file
from peagle_core.spec import JobSpec
from tests.worker.conftest import Stack, toy_spec
from worker.runner import JobRunner


def test_prepared_data_is_per_project_and_by_verifier_content(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path
) -> None:
    runner = JobRunner(stack.settings, "job_prepkey", "w1")
    sha = sha256_file(toy_dataset_path)

    def prepare(verifier: Path, project: str) -> tuple[Path, bool]:
        spec = JobSpec.model_validate(toy_spec(verifier, toy_dataset_path))
        return runner._prepared_dataset(spec, toy_dataset_path, sha, tmp_path / project, project)

    first, reused = prepare(toy_verifier_dir, "proj_a")
    assert not reused
    renamed = tmp_path / "same-verifier-new-name"
    shutil.copytree(toy_verifier_dir, renamed)
    again, reused = prepare(renamed, "proj_a")  # another name, same content: reused
    assert reused and again == first
    other, reused = prepare(toy_verifier_dir, "proj_b")  # same data, another project: never shared
    assert not reused and other != first
