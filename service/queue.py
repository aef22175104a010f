"""Redis/RQ plumbing: connect (tcp or unix socket) and enqueue "run job X" exactly once per DB job id."""

from __future__ import annotations

import math

from redis import Redis
from rq import Queue
from rq.exceptions import DuplicateJobError, NoSuchJobError
from rq.job import Job as RQJob
from rq.job import JobStatus

RUN_JOB_FUNC = "worker.tasks.run_job"
PLAN_FUNC = "worker.tasks.plan_job"

# An RQ job in one of these is waiting for or held by a worker: enqueueing again would run it twice.
_LIVE = frozenset({JobStatus.QUEUED, JobStatus.STARTED, JobStatus.SCHEDULED, JobStatus.DEFERRED})


def redis_from_url(url: str, *, socket_timeout: float | None = 5.0) -> Redis:
    """A Redis client for `url` (`redis://`, `rediss://` or `unix:///path.sock?db=0`).

    The timeouts make a dead Redis fail fast (the API answers 503) instead of hanging a request.
    """
    return Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)


def rq_status(redis: Redis, job_id: str) -> JobStatus | None:
    """The RQ status of `job_id`, or None when RQ does not know it (expired, flushed, never enqueued)."""
    try:
        return RQJob.fetch(job_id, connection=redis).get_status(refresh=False)
    except NoSuchJobError:
        return None


def enqueue_run(redis: Redis, job_id: str, queue_name: str, timeout_s: int) -> RQJob:
    """Enqueue `worker.tasks.run_job(job_id)` on `queue_name` with RQ id == `job_id`, at most once.

    A job already queued/started in RQ is returned untouched; a finished/failed RQ record of an earlier
    attempt is replaced. Raises redis.exceptions.ConnectionError when Redis is down (the caller leaves
    the DB row queued for the reconciler).
    """
    try:
        existing = RQJob.fetch(job_id, connection=redis)
    except NoSuchJobError:
        existing = None
    if existing is not None:
        if existing.get_status(refresh=False) in _LIVE:
            return existing
        existing.delete()
    queue = Queue(queue_name, connection=redis)
    try:
        return queue.enqueue_call(
            RUN_JOB_FUNC,
            args=(job_id,),
            job_id=job_id,
            timeout=timeout_s,
            result_ttl=24 * 3600,
            failure_ttl=7 * 24 * 3600,
            description=f"peagle job {job_id}",
            unique=True,
        )
    except DuplicateJobError:
        # Another process enqueued it between our check and our write: theirs is the one.
        return RQJob.fetch(job_id, connection=redis)


def enqueue_plan(redis: Redis, queue_name: str, spec: dict, data: dict, timeout_s: float, *,
                 recalibrate: bool = False) -> RQJob:  # fmt: skip
    """Ask a worker of `queue_name` for the plan of `spec`, ahead of queued jobs; dropped if nobody takes it
    within `timeout_s` (its asker has given up by then)."""
    return Queue(queue_name, connection=redis).enqueue_call(
        PLAN_FUNC,
        args=(spec, data, recalibrate),
        timeout=int(timeout_s),
        ttl=int(timeout_s) + 60,  # outlives the asker's wait, so that it can still withdraw the request
        result_ttl=600,
        failure_ttl=600,
        at_front=True,
        description="peagle plan",
    )


def withdraw_plan(redis: Redis, queue_name: str, job: RQJob) -> None:
    """Take an unanswered plan request off its queue, so that no worker computes it for nobody."""
    Queue(queue_name, connection=redis).remove(job.id)
    # one a worker took meanwhile finishes, and its result expires on its own (result_ttl)
    if job.get_status(refresh=True) in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED):
        job.delete()


def _alive_key(job_id: str, attempt: int) -> str:
    # One key per attempt: a stale attempt that wakes up can only vouch for itself, never for the newer one.
    return f"peagle:alive:{job_id}:{attempt}"


def mark_alive(redis: Redis, job_id: str, attempt: int, ttl_s: float) -> None:
    """Say in Redis that `attempt` of `job_id` is running, for `ttl_s` seconds.

    A second liveness signal beside the database heartbeat: during a database outage the worker cannot
    stamp `heartbeat_at`, but this key (expired by Redis's own clock, so immune to skew) keeps the
    reconciler from taking a healthy job for a dead one.
    """
    redis.set(_alive_key(job_id, attempt), 1, ex=max(1, math.ceil(ttl_s)))


def is_alive(redis: Redis, job_id: str, attempt: int) -> bool:
    """Whether `attempt` of `job_id` marked itself alive within its TTL."""
    return bool(redis.exists(_alive_key(job_id, attempt)))
