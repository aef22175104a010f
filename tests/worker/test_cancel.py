"""A cancelled job never runs again: not after its worker is interrupted mid-cancel, not on a later delivery."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from service.crud import jobstate
from service.queue import enqueue_run
from tests.worker.conftest import Stack, toy_spec


def test_interrupted_worker_never_undoes_a_cancel(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    from worker.runner import JobRunner

    spec = toy_spec(
        toy_verifier_dir,
        toy_dataset_path,
        training={"max_steps": 500, "checkpoint_every_steps": 1000, "epochs": 50},
    )
    job_id = stack.submit(spec, enqueue=False)

    def cancel_then_interrupt() -> None:
        stack.wait_for("training steps", lambda: (stack.job(job_id).progress or {}).get("step", 0) >= 1)
        with stack.sessions() as s:
            assert jobstate.transition(s, job_id, "cancelling", expect=("running",), event="cancel requested")
        # Ctrl-C lands while the worker is still stopping (before its monitor even sees the cancel).
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.getsignal(signal.SIGUSR1)
    thread = threading.Thread(target=cancel_then_interrupt)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            JobRunner(stack.settings, job_id, "in-process-worker").run()
    finally:
        thread.join()
        signal.signal(signal.SIGUSR1, previous)

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
