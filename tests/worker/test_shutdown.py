"""A worker stops within 10 s of SIGTERM (docker stop's grace; Kubernetes gives 30 s), also after running
jobs, every time: nothing it keeps between jobs waits out a long poll."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from tests.worker.conftest import Stack, toy_spec

STOP_BOUND_S = 10.0


def test_the_command_listener_stops_within_a_poll(redis_conn: Any) -> None:
    from worker.pool import COMMAND_POLL_S, _peagle_worker_class

    worker = _peagle_worker_class()(["default"], connection=redis_conn, name=f"listener-{time.time_ns()}")
    worker.subscribe()
    try:
        time.sleep(0.3)  # the listener is now waiting for a message that never comes
        t0 = time.monotonic()
        worker.pubsub_thread.stop(timeout=120)  # what RQ's teardown waits on (without a timeout)
        took = time.monotonic() - t0
    finally:
        worker.pubsub.close()
    assert not worker.pubsub_thread.is_alive()
    assert took < COMMAND_POLL_S + 2.0, f"the listener took {took:.1f}s to stop"  # RQ's own poll: 60 s


def test_a_worker_that_ran_a_job_exits_within_10s_of_sigterm(
    stack: Stack, tmp_path: Path, toy_verifier_dir: Path
) -> None:
    # A job that fails at once in the work horse: what the worker keeps after a job, not the job, is tested.
    spec = toy_spec(toy_verifier_dir, stack.settings.allowed_data_roots[0] / "missing.jsonl")
    for attempt in range(3):
        worker = stack.worker()
        job_id = stack.submit(spec)
        assert stack.wait_status(job_id, "failed", "succeeded", timeout=120).status == "failed"
        t0 = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=120) == 0
        took = time.monotonic() - t0
        stack.procs.remove(worker)
        assert took < STOP_BOUND_S, f"try {attempt + 1}: the worker took {took:.1f}s to stop"
