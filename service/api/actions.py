"""The actions both doors take: the REST routes (`/v1`) and the dashboard (`/ui`) each call one of these,
with a typed request naming who acts and on what, so that every check, limit and error (size caps,
quotas, allowed queues and roots, idempotency) is the same whichever door a client used.

The routes add only HTTP framing (status, Location, replay headers); the dashboard adds only rendering.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from peagle_core.errors import DataError
from peagle_core.spec import JobSpec
from service.api.admission import admit_with_dataset
from service.api.errors import ApiError, not_found
from service.api.quotas import check_new_job, reserve_upload, settle_upload
from service.api.request_text import idempotency_key
from service.api.upload import SpooledFile, spool_multipart_file
from service.artifacts import ArtifactStore
from service.crud import datasets as datasets_crud
from service.crud import events as events_crud
from service.crud import idempotency, jobstate
from service.crud import jobs as jobs_crud
from service.crud.jobs import jobs_using_dataset
from service.db.models import Dataset, Job, Project, new_id
from service.db.vanished import reread
from service.lifecycle import delete_dataset_with_files, delete_job_with_files
from service.queue import enqueue_run
from service.settings import Settings

log = logging.getLogger("peagle.api")

DataFormat = Literal["auto", "messages", "sharegpt", "tokenized"]
# Where a dataset upload arrives: each streams to disk under PEAGLE_MAX_UPLOAD_BYTES, not the spec cap.
DATASET_UPLOAD_PATHS = frozenset({"/v1/datasets", "/ui/data/datasets"})


def is_dataset_upload(method: str, path: str) -> bool:
    return method == "POST" and path.rstrip("/") in DATASET_UPLOAD_PATHS


# -- requests --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateJob:
    project: Project
    spec: JobSpec
    idempotency_key: str | None = None  # the raw header or form field; checked by the action


@dataclass(frozen=True)
class JobAction:
    """Cancel or delete: a job of the project, by id."""

    project: Project
    job_id: str


@dataclass(frozen=True)
class UploadDataset:
    project: Project
    request: Request  # its body is the multipart upload, streamed
    format: DataFormat = "auto"


@dataclass(frozen=True)
class DeleteDataset:
    project: Project
    dataset_id: str


@dataclass(frozen=True)
class CreatedJob:
    job: Job
    replayed: bool  # an earlier request with the same Idempotency-Key and body created it


# -- jobs ------------------------------------------------------------------------------------------


def _job_or_404(db: Session, project_id: str, job_id: str) -> Job:
    job = jobs_crud.get_job_row(db, project_id, job_id)
    if job is None:
        raise not_found("job", job_id)
    return job


def create_job_request(req: CreateJob, *, db: Session, redis: Redis, settings: Settings) -> CreatedJob:
    """Admit the spec, honour the idempotency key, count the project's limits, store the job as queued
    (committed) and enqueue it."""
    project = req.project
    key = idempotency_key(req.idempotency_key)
    spec, _ = admit_with_dataset(db, req.spec, settings, project.id, lock=True)
    # The worker runs what the user wrote (an unset field means "the default", or the `init_from`
    # checkpoint's value); the resolved spec is what GET shows.
    submitted = spec.model_dump(mode="json", exclude_unset=True)
    body_hash = idempotency.request_hash(submitted)
    if key is not None and (replay := _replay(db, project.id, key, body_hash)) is not None:
        return CreatedJob(replay, replayed=True)
    check_new_job(db, project.id, spec.resources.queue, spec.resources.nodes_max)
    job = jobs_crud.create_job_row(
        db, project.id, spec.model_dump(mode="json"), max_attempts=settings.max_attempts, submitted=submitted
    )
    if key is not None:
        idempotency.remember(db, project.id, key, body_hash, job.id)
    try:
        db.commit()
    except IntegrityError:
        # A concurrent request with the same key won the insert: answer as its replay.
        db.rollback()
        replay = _replay(db, project.id, key or "", body_hash)
        if replay is None:
            raise
        return CreatedJob(replay, replayed=True)
    _enqueue(db, redis, settings, job)
    return CreatedJob(job, replayed=False)


def _replay(db: Session, project_id: str, key: str, body_hash: str) -> Job | None:
    row = idempotency.find(db, project_id, key)
    if row is None:
        return None
    if row.request_hash != body_hash:
        raise ApiError(
            409,
            "this Idempotency-Key was already used with a different request body",
            code="idempotency_key_reused",
            param="Idempotency-Key",
        )
    return _job_or_404(db, project_id, row.job_id)


def _enqueue(db: Session, redis: Redis, settings: Settings, job: Job) -> None:
    # The row is committed first: if Redis is down the job stays queued and the reconciler enqueues it.
    try:
        enqueue_run(redis, job.id, job.queue, settings.job_timeout_s)
    except RedisError as exc:
        log.warning(
            "enqueue of %s failed (%s); left queued for the reconciler", job.id, exc.__class__.__name__
        )
        events_crud.add_event(
            db,
            job.id,
            "warning",
            "the job queue is unavailable; the job will be enqueued when it recovers",
            level="warning",
        )
        db.commit()
        return
    jobs_crud.record_enqueued(job)
    db.commit()


def cancel_job_request(req: JobAction, *, db: Session, redis: Redis) -> Job:
    """A queued job is cancelled at once, a running one becomes `cancelling`; a finished one is a 409."""
    job = _job_or_404(db, req.project.id, req.job_id)
    # A lost race (the worker claimed or finished it meanwhile) re-reads the status and tries again; a
    # job deleted meanwhile is the 404 a later request gets (`reread`), never a 500.
    for _ in range(5):
        status = job.status
        if status == "queued":
            if jobstate.transition(
                db, req.job_id, "cancelled", expect=["queued"], event="cancelled before it started"
            ):
                _drop_from_queue(redis, req.job_id)
                break
        elif status == "running":
            if jobstate.transition(
                db, req.job_id, "cancelling", expect=["running"], event="cancel requested"
            ):
                break
        elif status != "cancelling":
            raise ApiError(409, f"job {req.job_id} already {status}", code="job_finished", param="job_id")
        else:
            break
        job = reread(db, job, "job")
    return reread(db, job, "job")


def _drop_from_queue(redis: Redis, job_id: str) -> None:
    # Best effort: a worker that still dequeues it finds the row cancelled and skips it.
    from rq.exceptions import NoSuchJobError
    from rq.job import Job as RQJob

    with contextlib.suppress(NoSuchJobError, RedisError, ValueError):
        RQJob.fetch(job_id, connection=redis).cancel()


def delete_job_request(req: JobAction, *, db: Session, store: ArtifactStore) -> None:
    """Delete a finished job's files, then its rows (committed); 409 while it is unfinished."""
    job = _job_or_404(db, req.project.id, req.job_id)
    # The deletion re-reads the job under the project lock: deleted meanwhile, it raises RowVanished (404).
    if not jobstate.is_terminal(job.status) or not delete_job_with_files(db, store, job):
        raise ApiError(
            409,
            f"job {req.job_id} is {job.status}; cancel it and wait until it ends before deleting it",
            code="job_not_finished",
            param="job_id",
        )
    db.commit()


# -- datasets --------------------------------------------------------------------------------------


async def upload_dataset_request(
    req: UploadDataset, *, db: Session, store: ArtifactStore, settings: Settings
) -> Dataset:
    """Reserve room under the project's storage cap, stream the multipart `file` to disk under the upload
    cap (413), validate it line by line (422 naming the line), store it and record its row."""
    project_id = req.project.id
    declared = req.request.headers.get("content-length", "")
    # Room is reserved (under the project lock) before a byte is spooled: concurrent uploads each hold
    # their own share of the cap, and the upload may write no more than it reserved.
    reservation, room = await run_in_threadpool(
        reserve_upload,
        db,
        project_id,
        int(declared) if declared.isdigit() else None,
        settings.max_upload_bytes,
    )
    try:
        spool_dir = Path(settings.data_dir) / "tmp"
        spool_dir.mkdir(parents=True, exist_ok=True)
        spooled = await spool_multipart_file(
            req.request,
            "file",
            spool_dir / f"upload-{uuid.uuid4().hex}",
            min(room, settings.max_upload_bytes),
            over_limit=None if room >= settings.max_upload_bytes else _over_reservation,
        )
        try:
            return await run_in_threadpool(
                _store_and_record,
                store,
                db,
                project_id,
                spooled,
                req.format,
                settings.max_line_bytes,
                reservation,
            )
        finally:
            with contextlib.suppress(OSError):
                spooled.path.unlink()
    except BaseException:
        await run_in_threadpool(_release, db, reservation)
        raise


def _over_reservation(limit: int) -> ApiError:
    return ApiError(
        403,
        f"the upload passes the {limit} bytes left under this project's storage cap "
        "(limit storage_cap_bytes); delete datasets or jobs to make room",
        code="storage_quota_exceeded",
        param="file",
    )


def _release(db: Session, reservation: int) -> None:
    db.rollback()
    with contextlib.suppress(SQLAlchemyError):  # an unsettled reservation expires on its own
        settle_upload(db, reservation)
        db.commit()


def _chunks(path: Path, size: int = 1 << 20) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(size):
            yield block


def _store_and_record(
    store: ArtifactStore,
    db: Session,
    project_id: str,
    spooled: SpooledFile,
    fmt: str,
    max_line_bytes: int,
    reservation: int,
) -> Dataset:
    """Validate (line by line), copy to the store, insert the row and settle the reservation (its ledger
    row replaced by the dataset's); runs on a worker thread."""
    from peagle_core.data import validate_jsonl

    try:
        # Prompts-only conversations are stored and counted: a job trains on them only with regeneration.
        report = validate_jsonl(spooled.path, fmt=fmt, max_line_bytes=max_line_bytes, prompts_only_ok=True)
    except DataError as exc:
        raise ApiError(422, exc.message, code=exc.code, param="file") from None
    dataset_id = new_id("ds")
    key = f"datasets/{dataset_id}/data.jsonl"
    sha, size = store.write_stream(key, _chunks(spooled.path))
    if sha != spooled.sha256 or size != spooled.size:
        store.delete(key)
        raise ApiError(500, "stored dataset failed its checksum", code="checksum_mismatch")
    settle_upload(db, reservation)
    row = datasets_crud.add_dataset(
        db,
        dataset_id=dataset_id,
        project_id=project_id,
        filename=spooled.filename or "data.jsonl",
        uri=key,
        sha256=sha,
        size=size,
        num_records=report.rows,
        format=str(report.format),
        prompts_only_records=report.prompts_only_rows,
    )
    try:
        db.commit()
    except BaseException:
        db.rollback()
        store.delete(key)
        raise
    return row


def delete_dataset_request(req: DeleteDataset, *, db: Session, store: ArtifactStore) -> None:
    """Delete a dataset's file, then its row (committed); 409 while an unfinished job will read it."""
    # Locked before the in-use check: a job create naming it waits, then finds it gone (or we see its job).
    row = datasets_crud.lock_dataset(db, req.project.id, req.dataset_id)
    if row is None:
        raise not_found("dataset", req.dataset_id)
    if users := jobs_using_dataset(db, req.project.id, req.dataset_id):
        raise ApiError(
            409,
            f"dataset {req.dataset_id} is used by unfinished job {users[0]}; cancel it or wait until it ends",
            code="dataset_in_use",
            param="dataset_id",
        )
    delete_dataset_with_files(db, store, row)
    db.commit()
