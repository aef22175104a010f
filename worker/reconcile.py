"""Crash recovery: compare the jobs table (the truth) with RQ and worker heartbeats, and repair.

- A running job whose worker died (no Redis liveness key for its attempt, and RQ says its execution ended
  or its heartbeat went stale by the database's clock) goes back to `queued` and is re-enqueued; it
  resumes from its last mirrored checkpoint. After `max_attempts` starts it fails. A false death (a
  frozen worker that wakes up) is harmless: every write of the old attempt is fenced by its attempt number.
- A `cancelling` job past the grace period is stopped hard (RQ stop-job command) and marked cancelled.
- A queued job that Redis lost (restart, flush, failed enqueue) is enqueued again.
- Housekeeping: expired idempotency keys are purged and, with `PEAGLE_RETENTION_DAYS`, finished jobs older
  than that are deleted with their files (`service.lifecycle`).

Attempt semantics: `attempt` counts claims (starts). The claim increments it; the reconciler never does.
Every change is a conditional transition, so several reconcilers (one beside each `peagle worker`, or
`peagle reconcile`) can run at once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from redis import Redis
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import JobStatus
from sqlalchemy.orm import Session

from service.crud import jobstate
from service.crud.clock import db_now
from service.crud.events import add_event
from service.crud.jobs import unfinished_jobs
from service.db.models import Job
from service.db.session import session_factory
from service.lifecycle import housekeeping
from service.queue import enqueue_run, is_alive, redis_from_url, rq_status
from service.settings import Settings
from worker.monitor import stale_after_s

log = logging.getLogger(__name__)

# RQ statuses that mean the work horse is gone: a DB row still `running` then has no one behind it.
_ENDED = frozenset({JobStatus.FAILED, JobStatus.FINISHED, JobStatus.STOPPED, JobStatus.CANCELED})
_LIVE = frozenset({JobStatus.QUEUED, JobStatus.STARTED, JobStatus.SCHEDULED, JobStatus.DEFERRED})


@dataclass
class ReconcileReport:
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    reenqueued: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    hard_stopped: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)  # finished jobs deleted by the retention period

    def __bool__(self) -> bool:
        return any(
            (self.requeued, self.failed, self.reenqueued, self.cancelled, self.hard_stopped, self.expired)
        )


def _death_reason(job: Job, redis: Redis, now: datetime, stale_s: float) -> str | None:
    """Why the worker of a running/cancelling job is presumed dead, or None while it is alive.

    Alive: the attempt holding the job refreshed its Redis liveness key within `stale_s` (Redis's clock),
    whatever RQ or the database heartbeat say, so a database outage never reads as death. Otherwise dead
    when RQ says the execution ended, or when the database heartbeat is older than `stale_s` by the
    database's own clock (`now`), so clock skew between machines never reads as death either.
    """
    if is_alive(redis, job.id, job.attempt):
        return None
    status = rq_status(redis, job.id)
    if status in _ENDED:
        return f"its worker process ended without finishing the job (RQ status {status.value})"
    beat = job.heartbeat_at or job.started_at
    if beat is None or now - beat > timedelta(seconds=stale_s):
        age = "never" if beat is None else f"{(now - beat).total_seconds():.0f}s ago"
        where = f" on {job.worker_name}" if job.worker_name else ""
        return f"its worker{where} stopped sending heartbeats (last {age})"
    return None


def reconcile_once(
    settings: Settings, *, redis: Redis | None = None, min_queued_age_s: float = 5.0
) -> ReconcileReport:
    """One pass over queued, running and cancelling jobs; returns what was repaired."""
    redis = redis or redis_from_url(settings.redis_url)
    sessions = session_factory(settings.database_url)
    report = ReconcileReport()
    stale_s = stale_after_s(settings.worker_heartbeat_s)
    with sessions() as session:
        now = db_now(session)
        jobs = unfinished_jobs(session)
        session.expunge_all()

    for job in jobs:
        with sessions() as session:
            if job.status == "queued":
                _reenqueue_if_lost(session, redis, settings, job, now, min_queued_age_s, report)
                continue
            reason = _death_reason(job, redis, now, stale_s)
            if job.status == "cancelling":
                _settle_cancel(session, redis, settings, job, now, reason, report)
            elif reason is not None:
                _recover_dead(session, redis, settings, job, reason, report)
    with sessions() as session:
        report.expired = housekeeping(session, settings)
    if report:
        log.info("reconcile: %s", report)
    return report


def _recover_dead(
    session: Session, redis: Redis, settings: Settings, job: Job, reason: str, report: ReconcileReport
) -> None:
    if job.attempt >= job.max_attempts:
        error = {
            "code": "worker_lost",
            "message": f"the job was started {job.attempt} times and its worker died each time; last: {reason}",
        }
        if jobstate.transition(
            session,
            job.id,
            "failed",
            expect=("running",),
            fence=job.attempt,
            event=error["message"],
            level="error",
            error=error,
        ):
            report.failed.append(job.id)
        return
    moved = jobstate.transition(
        session,
        job.id,
        "queued",
        expect=("running",),
        fence=job.attempt,
        event=f"requeued: {reason}; it resumes from its last checkpoint "
        f"(attempt {job.attempt} of {job.max_attempts} used)",
        event_data={"reason": reason, "attempt": job.attempt},
        level="warning",
        worker_name=None,
    )
    if moved:
        report.requeued.append(job.id)
        # A worker killed with its horse leaves the RQ job `started` forever (until RQ's own abandoned-job
        # sweep); enqueue_run would take that for a live run, so drop the stale record first.
        _drop_rq_job(redis, job.id)
        enqueue_run(redis, job.id, job.queue, settings.job_timeout_s)


def _drop_rq_job(redis: Redis, job_id: str) -> None:
    from rq.job import Job as RQJob

    with contextlib.suppress(NoSuchJobError):
        RQJob.fetch(job_id, connection=redis).delete()


def _settle_cancel(
    session: Session,
    redis: Redis,
    settings: Settings,
    job: Job,
    now: datetime,
    reason: str | None,
    report: ReconcileReport,
) -> None:
    if reason is not None:
        if jobstate.transition(
            session,
            job.id,
            "cancelled",
            expect=("cancelling",),
            fence=job.attempt,
            event=f"cancelled: {reason} while stopping; its last saved checkpoint is kept",
        ):
            report.cancelled.append(job.id)
        return
    requested = job.cancel_requested_at or now
    if now - requested < timedelta(seconds=settings.cancel_grace_s):
        return
    try:
        from rq.command import send_stop_job_command

        send_stop_job_command(redis, job.id)
    except (InvalidJobOperation, NoSuchJobError):
        log.info("job %s: no RQ execution to stop", job.id)
    if jobstate.transition(
        session,
        job.id,
        "cancelled",
        expect=("cancelling",),
        event=f"cancelled: the job did not stop within {settings.cancel_grace_s:g}s, so a hard stop was "
        "needed; results since its last checkpoint are lost",
        event_data={"hard_stop": True},
        level="warning",
    ):
        report.hard_stopped.append(job.id)


def _reenqueue_if_lost(
    session: Session,
    redis: Redis,
    settings: Settings,
    job: Job,
    now: datetime,
    min_age_s: float,
    report: ReconcileReport,
) -> None:
    # A job just inserted may not be enqueued yet (the API enqueues after commit): leave it a moment.
    since = job.queued_at or job.created_at
    if since is not None and now - since < timedelta(seconds=min_age_s):
        return
    if rq_status(redis, job.id) in _LIVE:
        return
    enqueue_run(redis, job.id, job.queue, settings.job_timeout_s)
    add_event(
        session,
        job.id,
        "reconcile",
        "re-enqueued: the queue had lost this job (Redis restart or flush)",
        level="warning",
    )
    session.commit()
    report.reenqueued.append(job.id)


def reconcile_loop(settings: Settings) -> None:
    """Run `reconcile_once` every `settings.reconcile_interval_s` until the process is stopped; a failed
    pass is logged and the next one tries again."""
    redis = redis_from_url(settings.redis_url)
    while True:
        try:
            reconcile_once(settings, redis=redis)
        except Exception:
            log.exception("reconcile pass failed; retrying in %.0fs", settings.reconcile_interval_s)
        time.sleep(settings.reconcile_interval_s)
