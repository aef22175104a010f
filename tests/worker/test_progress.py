"""Progress reporting: the training thread only enqueues; a writer thread batches rows into the database,
writes evaluation metrics and stage changes at once, and loses nothing when the database is slow or fails."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from service.crud import jobstate
from service.db.models import Job, JobMetric
from service.db.session import session_factory
from tests.fixtures.wait import DEFAULT_TIMEOUT_S, wait_until
from worker.attempt import AttemptContext
from worker.progress import ProgressWriter


class RecordingSessions:
    """A sessionmaker stand-in that records which thread opens each session and can hold writes back."""

    def __init__(self, sessions: Any):
        self.sessions = sessions
        self.threads: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.failures = 0

    def __call__(self) -> Any:
        self.threads.append(threading.get_ident())
        self.entered.set()
        assert self.gate.wait(DEFAULT_TIMEOUT_S), "the test never reopened the database"
        if self.failures:
            self.failures -= 1
            raise ConnectionError("database went away")
        return self.sessions()


@pytest.fixture
def job(settings: Any) -> Iterator[tuple[Any, str]]:
    from service.crud.jobs import create_job_row
    from service.crud.projects import get_or_create_project

    sessions = session_factory(settings.database_url)
    with sessions() as s:
        project = get_or_create_project(s, "progress-tests")
        spec = {"verifier": {"name_or_path": "/nowhere"}, "dataset": {"path": "/nowhere.jsonl"}}
        job_id = create_job_row(s, project.id, spec, max_attempts=1).id
        s.commit()
        assert jobstate.claim(s, job_id, "w1")  # attempt 1 holds the job: its writes are accepted
    yield sessions, job_id


def stored(sessions: Any, job_id: str) -> tuple[list[int], dict[str, Any]]:
    with sessions() as s:
        steps = s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id).order_by(JobMetric.id))
        return list(steps), s.get(Job, job_id).progress


def step(n: int, **extra: Any) -> dict[str, Any]:
    return {"step": n, "total_steps": 100, "loss": 1.0 / n, "eta_s": 100.0 - n, **extra}


def test_writes_happen_off_the_training_thread_in_few_transactions(job) -> None:
    sessions, job_id = job
    recording = RecordingSessions(sessions)
    writer = ProgressWriter(AttemptContext(recording, job_id, 1), min_interval_s=3600).start()
    writer.set_stage("train")
    for n in range(1, 101):
        writer.on_metrics(step(n))
    writer.on_metrics({"step": 100, "eval/acceptance_length@2": 1.5})
    writer.close()

    assert threading.get_ident() not in recording.threads
    # Only the stage change, the eval metrics and close() may write with a one-hour interval.
    assert 1 <= writer.flushes <= 3
    steps, progress = stored(sessions, job_id)
    assert steps == [*range(1, 101), 100]
    # The best acceptance length so far rides along, for job lists; the last step's loss, for progress bars.
    assert progress == {
        "stage": "train",
        "step": 100,
        "total_steps": 100,
        "eta_s": 0.0,
        "loss": 0.01,
        "acceptance_length": 1.5,
    }
    with sessions() as s:
        last = s.scalars(select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.id)).all()
    assert last[0].values["attempt"] == 1 and last[-1].values["eval/acceptance_length@2"] == 1.5


def test_eval_metrics_are_written_without_waiting_for_the_interval(job) -> None:
    sessions, job_id = job
    writer = ProgressWriter(AttemptContext(sessions, job_id, 1), min_interval_s=3600).start()
    try:
        for n in range(1, 4):
            writer.on_metrics(step(n))
        writer.on_metrics({"step": 3, "eval/acceptance_length@2": 1.2})
        wait_until(lambda: len(stored(sessions, job_id)[0]) == 4, message="the eval row", timeout=30)
        assert stored(sessions, job_id)[1]["step"] == 3
    finally:
        writer.close()


def test_a_stalled_database_does_not_block_the_training_thread(job) -> None:
    sessions, job_id = job
    recording = RecordingSessions(sessions)
    writer = ProgressWriter(AttemptContext(recording, job_id, 1), min_interval_s=3600).start()
    recording.gate.clear()
    try:
        # Evaluation metrics first: they are written at once, so the writer enters the stalled database.
        trainer = threading.Thread(
            target=lambda: [writer.on_metrics(step(n, **{"eval/x": 1.0})) for n in range(1, 501)]
        )
        trainer.start()
        wait_until(recording.entered.is_set, message="the writer to reach the database", timeout=30)
        # The database holds the first write; the training thread keeps reporting regardless.
        trainer.join(timeout=60)
        assert not trainer.is_alive(), "on_metrics blocked on the database"
        assert trainer.ident not in recording.threads
    finally:
        recording.gate.set()
    writer.close()
    assert stored(sessions, job_id)[0] == list(range(1, 501))


def test_a_full_queue_applies_back_pressure_instead_of_dropping(job) -> None:
    sessions, job_id = job
    recording = RecordingSessions(sessions)
    writer = ProgressWriter(AttemptContext(recording, job_id, 1), min_interval_s=3600, max_pending=4).start()
    recording.gate.clear()
    trainer = threading.Thread(target=lambda: [writer.on_metrics(step(n)) for n in range(1, 21)])
    trainer.start()
    wait_until(writer._queue.full, message="the queue to fill while the database is stalled", timeout=30)
    assert trainer.is_alive()  # waiting for room, not dropping rows
    recording.gate.set()
    trainer.join(timeout=60)
    writer.close()
    assert stored(sessions, job_id)[0] == list(range(1, 21))


def test_a_failed_write_is_reported_by_flush_and_retried(job) -> None:
    sessions, job_id = job
    recording = RecordingSessions(sessions)
    writer = ProgressWriter(AttemptContext(recording, job_id, 1), min_interval_s=3600).start()
    try:
        recording.failures = 1
        writer.on_metrics(step(1))
        with pytest.raises(ConnectionError):
            writer.flush()
        writer.on_metrics(step(2))
        writer.flush()
        assert stored(sessions, job_id)[0] == [1, 2]
    finally:
        writer.close()


def test_a_stale_attempt_writes_nothing(job) -> None:
    sessions, job_id = job
    writer = ProgressWriter(AttemptContext(sessions, job_id, 1), min_interval_s=3600).start()
    try:
        writer.on_metrics(step(1))
        writer.flush()
        # The job is taken from attempt 1 (a false death) and claimed again: attempt 2.
        with sessions() as s:
            assert jobstate.transition(s, job_id, "queued", expect=("running",), fence=1)
            assert jobstate.claim(s, job_id, "w2")
        writer.on_metrics(step(2))
        writer.flush()
        assert writer.lost.is_set()
        steps, progress = stored(sessions, job_id)
        assert steps == [1] and progress["step"] == 1
    finally:
        writer.close()
