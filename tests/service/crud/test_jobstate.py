"""The status machine: legal moves succeed once, illegal ones are refused, races have one winner."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from service.crud import jobstate
from service.crud.jobs import create_job_row
from service.crud.projects import get_or_create_project
from service.db.models import Job, JobEvent
from service.db.session import session_factory
from tests.fixtures.race import at_once


@pytest.fixture
def job_id(db_url: str) -> str:
    with session_factory(db_url)() as s:
        project = get_or_create_project(s, "jobstate-tests")
        job = create_job_row(s, project.id, {"resources": {"queue": "default"}}, max_attempts=3)
        s.commit()
        return job.id


def test_full_lifecycle_stamps_and_events(db_url: str, job_id: str) -> None:
    with session_factory(db_url)() as s:
        assert jobstate.transition(s, job_id, "running", attempt=Job.attempt + 1, worker_name="w1")
        assert jobstate.transition(s, job_id, "succeeded", progress={"stage": "done"})
        job = s.get(Job, job_id)
        assert (job.status, job.attempt, job.worker_name) == ("succeeded", 1, "w1")
        assert job.started_at is not None and job.finished_at >= job.started_at
        statuses = [
            e.data["status"]
            for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
        ]
        assert statuses == ["queued", "running", "succeeded"]


@pytest.mark.parametrize(
    ("path", "to"),
    [
        ((), "succeeded"),
        ((), "cancelling"),
        (("running", "succeeded"), "running"),
        (("cancelled",), "queued"),
        # A cancel is never undone: no path leads from cancelling back to queued.
        (("running", "cancelling"), "queued"),
    ],
)
def test_illegal_transitions_are_refused(db_url: str, job_id: str, path: tuple[str, ...], to: str) -> None:
    with session_factory(db_url)() as s:
        for step in path:
            assert jobstate.transition(s, job_id, step)
        before = s.get(Job, job_id).status
        # Either the machine forbids the move outright or no allowed source matches the current status.
        try:
            moved = jobstate.transition(s, job_id, to)
        except jobstate.IllegalTransition:
            moved = False
        assert not moved
        s.expire_all()
        assert s.get(Job, job_id).status == before


def test_expect_outside_the_machine_raises(db_url: str, job_id: str) -> None:
    with session_factory(db_url)() as s, pytest.raises(jobstate.IllegalTransition):
        jobstate.transition(s, job_id, "running", expect=["succeeded"])


def test_terminal_states_have_no_exits() -> None:
    for status in ("succeeded", "failed", "cancelled"):
        assert jobstate.TRANSITIONS[status] == frozenset()
        assert jobstate.is_terminal(status)


def test_concurrent_claims_have_exactly_one_winner(db_url: str, job_id: str) -> None:
    factory = session_factory(db_url)

    def claim(name: str) -> bool:
        with factory() as s:
            return jobstate.transition(s, job_id, "running", expect=["queued"], worker_name=name)

    results = at_once([lambda i=i: claim(f"w{i}") for i in range(4)])
    assert sorted(results) == [False, False, False, True]
    with factory() as s:
        events = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "status")).all()
        assert [e.data["status"] for e in events].count("running") == 1


def test_claim_never_starts_a_job_with_a_cancel_request(db_url: str, job_id: str) -> None:
    from service.db.models import utcnow

    with session_factory(db_url)() as s:
        # A row left queued with a cancel request (e.g. by an older worker that requeued it mid-cancel).
        s.get(Job, job_id).cancel_requested_at = utcnow()
        s.commit()
        assert not jobstate.claim(s, job_id, "w1")
        s.expire_all()
        job = s.get(Job, job_id)
        assert (job.status, job.attempt) == ("cancelled", 0)
