"""Prepared data is shared within a project and keyed by the verifier's content, never across projects:
a project cannot learn (from a reuse, or its speed) that another one trained on the same data."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from peagle_core.events import CallbackReporter
from peagle_core.pipeline.stages import Callbacks, Pipeline
from peagle_core.spec import JobSpec
from service.artifacts import ArtifactStore
from tests.worker.conftest import Stack, toy_spec


def test_prepared_data_is_per_project_and_by_verifier_content(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path
) -> None:
    store = ArtifactStore(stack.settings.artifact_root)

    def prepare(verifier: Path, project: str) -> tuple[Path, bool]:
        # The store and scratch a worker gives a job of `project` (worker.runner.JobRunner._execute).
        logs: list[dict[str, Any]] = []
        spec = JobSpec.model_validate(toy_spec(verifier, toy_dataset_path))
        stages = Pipeline.of(
            spec,
            tmp_path / project,
            store=store.scoped(f"projects/{project}"),
            scratch=tmp_path / "scratch" / project,
            callbacks=Callbacks(reporter=CallbackReporter(events=lambda e: logs.append(e.data))),
        )
        dataset = stages.data()
        assert dataset is not None
        return dataset, any(d.get("kind") == "prepare" and d.get("reused") for d in logs)

    first, reused = prepare(toy_verifier_dir, "proj_a")
    assert not reused
    renamed = tmp_path / "same-verifier-new-name"
    shutil.copytree(toy_verifier_dir, renamed)
    again, reused = prepare(renamed, "proj_a")  # another name, same content: reused
    assert reused and again == first
    other, reused = prepare(toy_verifier_dir, "proj_b")  # same data, another project: never shared
    assert not reused and other != first
