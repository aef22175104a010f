"""The reconciler against real database rows and a real Redis (no worker needed)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from service.crud import jobstate
from service.db.models import utcnow
from service.queue import rq_status
from tests.worker.conftest import Stack, toy_spec
from worker.reconcile import reconcile_once


def _running(stack: Stack, job_id: str, *, heartbeat_age_s: float, attempt: int) -> None:
    with stack.sessions() as s:
        assert jobstate.transition(
            s,
            job_id,
            "running",
            expect=("queued",),
            attempt=attempt,
            worker_name="gone.1",
            heartbeat_at=utcnow() - timedelta(seconds=heartbeat_age_s),
        )


def test_dead_worker_requeues_then_fails_after_max_attempts(stack: Stack, tmp_path: Path) -> None:
    spec = toy_spec(tmp_path, tmp_path / "d.jsonl")
    fresh, dead, exhausted = (stack.submit(spec) for _ in range(3))
    _running(stack, fresh, heartbeat_age_s=0, attempt=1)
    _running(stack, dead, heartbeat_age_s=3600, attempt=1)
    _running(stack, exhausted, heartbeat_age_s=3600, attempt=stack.settings.max_attempts)

    report = reconcile_once(stack.settings, redis=stack.redis, min_queued_age_s=0)
    assert report.requeued == [dead]
    assert report.failed == [exhausted]
    assert stack.job(fresh).status == "running"
    job = stack.job(dead)
    assert job.status == "queued" and job.attempt == 1 and job.worker_name is None
    assert rq_status(stack.redis, dead).value == "queued"
    assert "stopped sending heartbeats" in stack.events(dead)[-1].message
    failed = stack.job(exhausted)
    assert failed.status == "failed" and failed.error["code"] == "worker_lost"


def test_overdue_cancel_is_stopped_hard(stack: Stack, tmp_path: Path) -> None:
    job_id = stack.submit(toy_spec(tmp_path, tmp_path / "d.jsonl"))
    _running(stack, job_id, heartbeat_age_s=0, attempt=1)
    with stack.sessions() as s:
        past = utcnow() - timedelta(seconds=stack.settings.cancel_grace_s + 1)
        assert jobstate.transition(s, job_id, "cancelling", cancel_requested_at=past)
    report = reconcile_once(stack.settings, redis=stack.redis)
    assert report.hard_stopped == [job_id]
    job = stack.job(job_id)
    assert job.status == "cancelled"
    assert "hard stop was needed" in stack.events(job_id)[-1].message


def test_cancel_within_grace_is_left_alone(stack: Stack, tmp_path: Path) -> None:
    job_id = stack.submit(toy_spec(tmp_path, tmp_path / "d.jsonl"))
    _running(stack, job_id, heartbeat_age_s=0, attempt=1)
    with stack.sessions() as s:
        assert jobstate.transition(s, job_id, "cancelling")
    assert not reconcile_once(stack.settings, redis=stack.redis)
    assert stack.job(job_id).status == "cancelling"


def test_a_stale_database_heartbeat_is_not_death_while_the_attempt_is_alive_in_redis(
    stack: Stack, tmp_path: Path
) -> None:
    from service.queue import mark_alive

    spec = toy_spec(tmp_path, tmp_path / "d.jsonl")
    alive, dead = stack.submit(spec), stack.submit(spec)
    for job_id in (alive, dead):
        _running(stack, job_id, heartbeat_age_s=3600, attempt=2)
        # An earlier attempt that woke up (a thawed, fenced-off worker) still refreshes its own key.
        mark_alive(stack.redis, job_id, 1, ttl_s=30)
    # This worker cannot reach the database (an outage) but marks its attempt alive in Redis.
    mark_alive(stack.redis, alive, 2, ttl_s=30)

    report = reconcile_once(stack.settings, redis=stack.redis)
    assert report.requeued == [dead]  # the stale attempt's key vouches for nobody but itself
    assert stack.job(alive).status == "running"
