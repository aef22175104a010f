"""Every stage answers a stop within a bound: a cancel during data preparation is honoured at once, and a
stage that runs past `PEAGLE_STAGE_TIMEOUT_S` stops and fails the job (prepare stands for every stage)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from service.crud import jobstate
from tests.worker.conftest import Stack, toy_spec

ROWS = 20_000  # about 15 s of preparation on an idle CPU: far longer than either stop may take
STAGE_TIMEOUT_S = 6.0
CANCEL_BOUND_S = 30.0  # half the cancel grace, after which the reconciler would stop the job hard


@pytest.fixture(scope="module")
def big_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peagle_core.toy import write_toy_dataset

    return write_toy_dataset(tmp_path_factory.mktemp("big_data") / "big.jsonl", n=ROWS, seed=1)


def _stopped_at_line(stack: Stack, job_id: str) -> int:
    (event,) = [e for e in stack.events(job_id) if e.message.startswith("data preparation stopped at line")]
    return int(event.message.rsplit(" ", 1)[1])


def test_a_cancel_during_prepare_is_honoured_within_the_bound(
    stack: Stack, toy_verifier_dir: Path, big_dataset: Path
) -> None:
    stack.worker()
    job_id = stack.submit(toy_spec(toy_verifier_dir, big_dataset))
    stack.wait_for("preparation to start", lambda: any(
        e.type == "stage" and e.data["stage"] == "prepare" for e in stack.events(job_id)))  # fmt: skip
    with stack.sessions() as s:
        assert jobstate.transition(s, job_id, "cancelling", expect=("running",), event="cancel requested")
    t0 = time.monotonic()
    assert stack.wait_status(job_id, "cancelled", "failed", "succeeded", timeout=60).status == "cancelled"
    # Loading the tokenizer (seconds on a busy CPU) is the longest step between two checks.
    assert time.monotonic() - t0 < CANCEL_BOUND_S
    assert 0 < _stopped_at_line(stack, job_id) < ROWS
    assert "hidden_states" not in {e.data.get("stage") for e in stack.events(job_id) if e.type == "stage"}


def test_a_stage_past_its_time_limit_stops_and_fails_the_job(
    stack: Stack, toy_verifier_dir: Path, big_dataset: Path
) -> None:
    stack.env["PEAGLE_STAGE_TIMEOUT_S"] = str(STAGE_TIMEOUT_S)
    stack.worker()
    job_id = stack.submit(toy_spec(toy_verifier_dir, big_dataset))
    job = stack.wait_status(job_id, "failed", "succeeded", "cancelled", timeout=120)
    assert job.status == "failed" and job.error["code"] == "stage_timeout", job.error
    assert job.error["message"] == (
        f"the prepare stage ran longer than its limit of {STAGE_TIMEOUT_S:g}s (PEAGLE_STAGE_TIMEOUT_S)"
    )
    assert 0 < _stopped_at_line(stack, job_id) < ROWS
