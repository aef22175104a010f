"""False death: a worker frozen long enough to be presumed dead wakes up to find its job fenced off.

The job is requeued and resumed by a second worker; the first one, once thawed, can write nothing (status,
metrics, events, resume point, publish are all conditional on its attempt number), and the published
weights equal those of an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file

from service.artifacts import ArtifactStore
from tests.worker.conftest import Stack, toy_spec
from worker.reconcile import reconcile_once


def _weights(stack: Stack, job_id: str) -> dict[str, torch.Tensor]:
    (ckpt,) = stack.checkpoints(job_id)
    local = ArtifactStore(stack.settings.artifact_root).local_path(f"{ckpt.uri}/model.safetensors")
    return load_file(str(local))


def test_a_frozen_worker_is_fenced_off_and_the_job_finishes_once(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    spec = toy_spec(
        toy_verifier_dir,
        toy_dataset_path,
        # Long enough (the toy trains ~15 steps/s) that the freeze lands mid-training.
        training={"max_steps": 80, "checkpoint_every_steps": 5, "epochs": 50},
        evaluation={"prompts": 1},
    )
    job_id = stack.submit(spec)
    first = stack.worker(log_name="frozen")
    stack.wait_for(
        "a mirrored checkpoint and reported steps",
        lambda: (stack.job(job_id).resume_step or 0) >= 2 and stack.metrics(job_id),
        timeout=300,
    )

    assert stack.job(job_id).resume_step < 80, "the job finished before the freeze: lengthen it"
    # Freeze the whole worker (RQ parent and work horse): its database and Redis heartbeats stop with it.
    tree = [psutil.Process(first.pid), *psutil.Process(first.pid).children(recursive=True)]
    for p in tree:
        p.suspend()
    try:
        requeued = stack.wait_for(
            "the reconciler to presume the frozen worker dead",
            lambda: reconcile_once(stack.settings, redis=stack.redis, min_queued_age_s=0).requeued,
            timeout=120,
            every=1.0,
        )
        assert requeued == [job_id]
        stack.worker(log_name="second")
        stack.wait_for(
            "attempt 2 to train",
            lambda: any(m.get("attempt") == 2 and "loss" in m for m in stack.metrics(job_id)),
            timeout=300,
        )
    finally:
        for p in tree:
            p.resume()  # the frozen worker wakes up mid-step, still believing the job is its own

    job = stack.wait_status(job_id, "succeeded", "failed", "cancelled", timeout=300)
    assert job.status == "succeeded", job.error
    assert job.attempt == 2
    statuses = [e.data["status"] for e in stack.events(job_id) if e.type == "status"]
    assert statuses == ["queued", "running", "queued", "running", "succeeded"]
    assert len(stack.checkpoints(job_id)) == 1  # at most one attempt published

    # Nothing attempt 1 reported landed after attempt 2 started.
    with stack.sessions() as s:
        from sqlalchemy import select

        from service.db.models import JobMetric

        rows = s.execute(select(JobMetric.id, JobMetric.values).where(JobMetric.job_id == job_id)).all()
    first_ids = [i for i, v in rows if v.get("attempt") == 1]
    second_ids = [i for i, v in rows if v.get("attempt") == 2]
    assert first_ids and second_ids and max(first_ids) < min(second_ids)

    # The same spec run without interruption ends with the very same weights.
    reference = stack.submit(spec)
    assert stack.wait_status(reference, "succeeded", "failed", timeout=300).status == "succeeded"
    got, want = _weights(stack, job_id), _weights(stack, reference)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
