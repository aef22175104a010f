"""Per-project limits at the API: configured queues (422), allowed queues (403), concurrently running jobs
and plans in flight (429), storage (403, reserved before an upload writes), and open event streams per API
key (429). Every refusal names the limit and its value.

Each check runs under `lock_project` (a row lock on Postgres, the write lock on SQLite) and the write it
admits commits in the same transaction, so N concurrent requests pass at most the allowed number.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections import Counter
from collections.abc import Iterator

from sqlalchemy.orm import Session

from service.api.errors import ApiError
from service.crud import plans as plans_crud
from service.crud import usage
from service.crud.limits import lock_project, storage_used, unfinished_machine_count
from service.crud.projects import get_project
from service.db.models import Project
from service.settings import Settings

# Multipart framing around an uploaded file (boundaries, part headers) stays well under this.
MULTIPART_FRAMING_BYTES = 64 << 10


def check_queue(settings: Settings, queue: str) -> None:
    """422 unless `queue` is one the operator configured (PEAGLE_QUEUES): a made-up name would wait
    forever and add a metrics series."""
    if queue not in settings.queues:
        raise ApiError(
            422,
            f"unknown queue {queue!r}; this server serves: {', '.join(settings.queues)}",
            code="unknown_queue",
            param="spec.resources.queue",
        )


def _check_allowed_queue(project: Project, queue: str) -> None:
    if project.allowed_queues is not None and queue not in project.allowed_queues:
        allowed = ", ".join(project.allowed_queues) or "none"
        raise ApiError(
            403,
            f"this project may not use queue {queue!r} (limit allowed_queues: {allowed})",
            code="queue_not_allowed",
            param="spec.resources.queue",
        )


def check_new_job(db: Session, project_id: str, queue: str, machines: int = 1) -> None:
    """Raise ApiError if the project may not create a job on `queue` now. Locks the project row until the
    caller's commit, so concurrent creates are counted one after the other; a refusal rolls back at once
    (the lock is not held until the request's teardown, which needs a thread of its own)."""
    with _released_on_refusal(db):
        _check_new_job(db, project_id, queue, machines)


def _check_new_job(db: Session, project_id: str, queue: str, machines: int) -> None:
    project = lock_project(db, project_id)
    if project is None:
        return
    _check_allowed_queue(project, queue)
    limit = project.max_running_jobs
    if limit is not None and (n := unfinished_machine_count(db, project_id)) + machines > limit:
        asking = f" and this job asks for {machines}" if machines > 1 else ""
        raise ApiError(
            429,
            f"this project's queued or running jobs hold {n} machine(s){asking} (limit max_running_jobs: "
            f"{limit}; a job across N machines counts N); retry when one finishes",
            code="running_jobs_limit",
            headers={"Retry-After": "30"},
        )
    # A job is refused once the cap is reached: its checkpoints will only add to it.
    check_storage(db, project, 0)


def check_new_plan(db: Session, project_id: str, key_hash: str, queue: str, settings: Settings) -> None:
    """Raise ApiError if the project (or the API key) may not ask for another plan on `queue` now: the
    project's allowed queues hold for plans as for jobs, and plans in flight are capped per key
    (PEAGLE_MAX_PLANS_PER_KEY) and per project (PEAGLE_MAX_PLANS_PER_PROJECT, or the project's
    max_running_jobs when lower: a plan occupies a worker as a job does). Locks the project row until the
    caller's commit; a refusal rolls back at once."""
    with _released_on_refusal(db):
        _check_new_plan(db, project_id, key_hash, queue, settings)


def _check_new_plan(db: Session, project_id: str, key_hash: str, queue: str, settings: Settings) -> None:
    project = lock_project(db, project_id)
    if project is None:
        return
    _check_allowed_queue(project, queue)
    per_key = plans_crud.count_in_flight(db, key_hash=key_hash)
    if per_key >= settings.max_plans_per_key:
        raise _plans_limit(per_key, "this API key", "PEAGLE_MAX_PLANS_PER_KEY", settings.max_plans_per_key)
    limit, name = settings.max_plans_per_project, "PEAGLE_MAX_PLANS_PER_PROJECT"
    if project.max_running_jobs is not None and project.max_running_jobs < limit:
        limit, name = project.max_running_jobs, "max_running_jobs"
    per_project = plans_crud.count_in_flight(db, project_id=project_id)
    if per_project >= limit:
        raise _plans_limit(per_project, "this project", name, limit)


@contextlib.contextmanager
def _released_on_refusal(db: Session) -> Iterator[None]:
    try:
        yield
    except ApiError:
        db.rollback()
        raise


def _plans_limit(n: int, who: str, name: str, limit: int) -> ApiError:
    return ApiError(
        429,
        f"{who} has {n} plans in flight (limit {name}: {limit}); retry when one is answered",
        code="plans_limit",
        headers={"Retry-After": "10"},
    )


def _storage_error(used: int, adding: int, cap: int) -> ApiError:
    return ApiError(
        403,
        f"this project stores {used} bytes{f' and this adds {adding}' if adding else ''} "
        f"(limit storage_cap_bytes: {cap}); delete datasets or jobs to make room",
        code="storage_quota_exceeded",
    )


def check_storage(db: Session, project: Project | str, adding: int) -> None:
    """Raise 403 if everything the project stores (the ledger: datasets, checkpoints, training
    checkpoints, prepared and regenerated data, caches, tracker files, uploads in flight) plus `adding`
    passes its cap."""
    row = project if isinstance(project, Project) else get_project(db, project)
    if row is None or row.storage_cap_bytes is None:
        return
    used = storage_used(db, row.id)
    if used + adding > row.storage_cap_bytes or (adding == 0 and used >= row.storage_cap_bytes):
        raise _storage_error(used, adding, row.storage_cap_bytes)


def reserve_upload(db: Session, project_id: str, declared: int | None, max_upload: int) -> tuple[int, int]:
    """Reserve room for an upload before a byte of it is written, under the project lock, and commit.

    The reservation is the declared body size (at most the room left: the body's multipart framing is
    not stored), or without one (a chunked body) the room left, at most `max_upload`. Returns (reservation
    id, the most bytes the upload may then write); 403 when the cap has no room for it. Settle with
    `settle_upload`."""
    project = lock_project(db, project_id)
    if project is None:
        raise ApiError(401, "invalid or revoked API key", code="invalid_api_key")
    want = min(declared, max_upload) if declared is not None else max_upload
    if project.storage_cap_bytes is not None:
        used = storage_used(db, project_id)
        room = project.storage_cap_bytes - used
        least = max(1, (declared or 0) - MULTIPART_FRAMING_BYTES)  # what the file needs at the very least
        if least > room:
            db.rollback()
            raise _storage_error(used, least, project.storage_cap_bytes)
        want = min(want, room)
    row = usage.reserve(db, project, want, f"uploads/{uuid.uuid4().hex}")
    db.commit()
    return row.id, want


def settle_upload(db: Session, reservation_id: int) -> None:
    """Drop the reservation in the caller's transaction (the dataset's own ledger row replaces it)."""
    usage.release(db, reservation_id)


class StreamSlots:
    """Open SSE streams per API key in this process, capped; thread-safe (routes run in a threadpool)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    def check(self, key: str) -> None:
        """429 when `key` has no stream slot left (`acquire` still decides: this is an early refusal)."""
        with self._lock:
            self._check(key)

    def _check(self, key: str) -> None:
        if self._open[key] >= self.limit:
            raise ApiError(
                429,
                f"this API key has {self._open[key]} open event streams "
                f"(limit PEAGLE_MAX_STREAMS_PER_KEY: {self.limit}); close one first",
                code="stream_limit",
                headers={"Retry-After": "5"},
            )

    def acquire(self, key: str) -> None:
        with self._lock:
            self._check(key)
            self._open[key] += 1

    def release(self, key: str) -> None:
        with self._lock:
            self._open[key] -= 1
            if self._open[key] <= 0:
                del self._open[key]

    def open(self, key: str) -> int:
        with self._lock:
            return self._open[key]
