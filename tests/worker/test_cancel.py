"""A cancelled job never runs again: not after its worker is interrupted mid-cancel, not on a later delivery."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from service.crud import jobstate
from service.queue import enqueue_run
from tests.worker.conftest import Stack, toy_spec


def test_interrupted_worker_never_undoes_a_cancel(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.progress import ProgressWriter
    from worker.runner import JobRunner

    spec = toy_spec(
        toy_verifier_dir,
        toy_dataset_path,
        training={"max_steps": 500, "checkpoint_every_steps": 1000, "epochs": 50},
    )
    job_id = stack.submit(spec, enqueue=False)

    report = ProgressWriter.on_metrics

    def cancel_then_interrupt(self: ProgressWriter, metrics: dict) -> None:
        report(self, metrics)
        if metrics.get("step") == 2:
            with stack.sessions() as s:
                assert jobstate.transition(
                    s, job_id, "cancelling", expect=("running",), event="cancel requested"
                )
            # Ctrl-C lands on the training thread right after the cancel request, before the worker's
            # monitor has seen it (a signal would race the monitor; this is the interleaving that matters).
            raise KeyboardInterrupt

    monkeypatch.setattr(ProgressWriter, "on_metrics", cancel_then_interrupt)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        with pytest.raises(KeyboardInterrupt):
            JobRunner(stack.settings, job_id, "in-process-worker").run()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    monkeypatch.undo()

    job = stack.job(job_id)
    assert job.status == "cancelled"
    statuses = [e.data["status"] for e in stack.events(job_id) if e.type == "status"]
    assert statuses == ["queued", "running", "cancelling", "cancelled"]

    # A stale delivery of the job (Redis still held it) finds it cancelled and does not run it.
    enqueue_run(stack.redis, job_id, "default", stack.settings.job_timeout_s)
    stack.run_burst()
    job = stack.job(job_id)
    assert (job.status, job.attempt) == ("cancelled", 1)
    assert stack.checkpoints(job_id) == []
