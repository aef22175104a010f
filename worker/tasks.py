"""The RQ entry point: `worker.tasks.run_job(job_id)` runs in the forked work horse."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator

log = logging.getLogger(__name__)


def worker_identity() -> str:
    """The name this process records as `jobs.worker_name`: the RQ worker's name inside a horse."""
    return os.environ.get("RQ_WORKER_ID") or f"{socket.gethostname()}.{os.getpid()}"


def run_job(job_id: str) -> str:
    """Run one attempt of `job_id` and return its status afterwards ("skipped" when it was not queued).

    Failures are recorded on the job (status failed, `{code, message}`), so RQ sees a normal return.
    """
    from service.settings import get_settings
    from worker.runner import JobRunner

    # The RQ parent never opens a database connection (worker.pool), so the horse starts with none.
    with ended_with_the_job():
        return JobRunner(get_settings(), job_id, worker_identity()).run()


def run_plan(spec: dict, data: dict, recalibrate: bool = False) -> dict:
    """`POST /v1/jobs/plan`'s work: the plan of `spec` on this worker's device (see worker.planner)."""
    from service.settings import get_settings
    from worker.planner import plan_for_api

    with ended_with_the_job():
        return plan_for_api(get_settings(), spec, data, recalibrate=recalibrate)


def join_job(job_id: str, attempt: int, slot: int) -> str:
    """Join `attempt` of a multi-node job as member `slot` (see worker.gang); returns how it ended."""
    from service.settings import get_settings
    from worker.gang import GangMember

    with ended_with_the_job():
        return GangMember(get_settings(), job_id, attempt, slot, worker_identity()).run()


@contextlib.contextmanager
def ended_with_the_job() -> Iterator[None]:
    """In an RQ work horse, end whatever child processes the task left running once it returns or raises
    (called directly, outside RQ, nothing is touched)."""
    try:
        yield
    finally:
        from rq import get_current_job

        if get_current_job() is not None:
            from worker.leftovers import end_children

            end_children()
