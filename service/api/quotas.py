"""Per-project limits at the API: queues (403), concurrently running jobs (429), storage (403), and open
event streams per API key (429). Every refusal names the limit and its value."""

from __future__ import annotations

import threading
from collections import Counter

from sqlalchemy.orm import Session

from service.api.errors import ApiError
from service.crud.limits import lock_project, storage_used, unfinished_job_count
from service.crud.projects import get_project
from service.db.models import Project


def check_new_job(db: Session, project_id: str, queue: str) -> None:
    """Raise ApiError if the project may not create a job on `queue` now. Locks the project row until the
    caller's commit, so concurrent creates are counted one after the other."""
    project = lock_project(db, project_id)
    if project is None:
        return
    if project.allowed_queues is not None and queue not in project.allowed_queues:
        allowed = ", ".join(project.allowed_queues) or "none"
        raise ApiError(
            403,
            f"this project may not use queue {queue!r} (limit allowed_queues: {allowed})",
            code="queue_not_allowed",
            param="spec.resources.queue",
        )
    limit = project.max_running_jobs
    if limit is not None and (n := unfinished_job_count(db, project_id)) >= limit:
        raise ApiError(
            429,
            f"this project has {n} queued or running jobs (limit max_running_jobs: {limit}); "
            "retry when one finishes",
            code="running_jobs_limit",
            headers={"Retry-After": "30"},
        )
    # A job is refused once the cap is reached: its checkpoints will only add to it.
    check_storage(db, project, 0)


def check_storage(db: Session, project: Project | str, adding: int) -> None:
    """Raise 403 if the project's stored bytes (datasets and checkpoints) plus `adding` pass its cap."""
    row = project if isinstance(project, Project) else get_project(db, project)
    if row is None or row.storage_cap_bytes is None:
        return
    used = storage_used(db, row.id)
    if used + adding > row.storage_cap_bytes or (adding == 0 and used >= row.storage_cap_bytes):
        raise ApiError(
            403,
            f"this project stores {used} bytes{f' and this adds {adding}' if adding else ''} "
            f"(limit storage_cap_bytes: {row.storage_cap_bytes}); delete datasets or jobs to make room",
            code="storage_quota_exceeded",
        )


class StreamSlots:
    """Open SSE streams per API key in this process, capped; thread-safe (routes run in a threadpool)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    def acquire(self, key: str) -> None:
        with self._lock:
            if self._open[key] >= self.limit:
                raise ApiError(
                    429,
                    f"this API key has {self._open[key]} open event streams "
                    f"(limit PEAGLE_MAX_STREAMS_PER_KEY: {self.limit}); close one first",
                    code="stream_limit",
                    headers={"Retry-After": "5"},
                )
            self._open[key] += 1

    def release(self, key: str) -> None:
        with self._lock:
            self._open[key] -= 1
            if self._open[key] <= 0:
                del self._open[key]

    def open(self, key: str) -> int:
        with self._lock:
            return self._open[key]
