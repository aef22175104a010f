"""Redis/RQ plumbing: connect (tcp or unix socket) and enqueue "run job X" exactly once per DB job id."""

from __future__ import annotations

import contextlib
import math

from redis import Redis
from rq import Queue
from rq.exceptions import DuplicateJobError, NoSuchJobError
from rq.job import Job as RQJob
from rq.job import JobStatus

RUN_JOB_FUNC = "worker.tasks.run_job"
PLAN_FUNC = "worker.tasks.run_plan"
JOIN_FUNC = "worker.tasks.join_job"
PLAN_RESULT_TTL_S = 24 * 3600  # a plan's answer waits this long in Redis for the API to read it

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


def enqueue_join(
    redis: Redis, job_id: str, attempt: int, slot: int, queue_name: str, *, timeout_s: int, wait_s: float
) -> RQJob:
    """Ask a worker of `queue_name` to join `attempt` of a multi-node job as member `slot`. Joins go ahead
    of queued jobs (a gang holds its leader's machine while it waits); one nobody takes within `wait_s` is
    dropped, and a late one for an older attempt is dropped by the worker (`worker.gang`)."""
    return Queue(queue_name, connection=redis).enqueue_call(
        JOIN_FUNC,
        args=(job_id, attempt, slot),
        job_id=f"{job_id}-a{attempt}-node{slot}",
        timeout=timeout_s,
        ttl=max(1, math.ceil(wait_s)),
        result_ttl=3600,
        failure_ttl=24 * 3600,
        at_front=True,
        description=f"peagle job {job_id} attempt {attempt}: node {slot}",
    )


def enqueue_plan(redis: Redis, queue_name: str, plan_id: str, spec: dict, data: dict, timeout_s: float, *,
                 recalibrate: bool = False) -> RQJob:  # fmt: skip
    """Ask a worker of `queue_name` for the plan of `spec` (RQ id == `plan_id`). Plans go ahead of queued
    jobs (they are short, and each project has only a few in flight); one nobody takes within `timeout_s`
    is dropped, and its answer is kept for the asker to read (`plan_outcome`)."""
    return Queue(queue_name, connection=redis).enqueue_call(
        PLAN_FUNC,
        args=(spec, data, recalibrate),
        job_id=plan_id,
        timeout=max(1, int(timeout_s)),
        ttl=max(1, int(timeout_s)),
        result_ttl=PLAN_RESULT_TTL_S,
        failure_ttl=PLAN_RESULT_TTL_S,
        at_front=True,
        description="peagle plan",
    )


def plan_outcome(redis: Redis, plan_id: str) -> tuple[str, object]:
    """Where the plan's RQ job stands: ("queued"|"running", None), ("succeeded", its return value),
    ("failed", None) or ("missing", None) when RQ no longer knows it."""
    try:
        job = RQJob.fetch(plan_id, connection=redis)
    except NoSuchJobError:
        return "missing", None
    status = job.get_status(refresh=False)
    if status == JobStatus.FINISHED:
        return "succeeded", job.return_value()
    if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
        return "failed", None
    if status == JobStatus.STARTED:
        return "running", None
    return "queued", None


def withdraw_plan(redis: Redis, queue_name: str, plan_id: str) -> None:
    """Take an unanswered plan request off its queue, so that no worker computes it for nobody."""
    Queue(queue_name, connection=redis).remove(plan_id)
    # one a worker took meanwhile finishes, and its result expires on its own (result_ttl)
    with contextlib.suppress(NoSuchJobError):
        job = RQJob.fetch(plan_id, connection=redis)
        if job.get_status(refresh=False) in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED):
            job.delete()


def queue_depths(redis: Redis, queue_names: list[str]) -> dict[str, int]:
    """Jobs waiting in each configured queue (only those: a made-up name never becomes a series)."""
    return {name: Queue(name, connection=redis).count for name in queue_names}


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
