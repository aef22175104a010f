"""Deleting datasets, jobs and checkpoints, and the retention sweep: files in the store first, then rows.

Files go first so that a failure half-way leaves a row that a repeated DELETE (or the next sweep) finishes;
rows first would leave files nothing points to any more. Each function leaves the commit to the caller.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy.orm import Session

from service.artifacts import ArtifactStore
from service.crud import checkpoints as checkpoints_crud
from service.crud import datasets as datasets_crud
from service.crud import idempotency, plans, usage
from service.crud import jobs as jobs_crud
from service.crud.limits import lock_project
from service.db.models import TERMINAL_STATUSES, Checkpoint, Dataset, Job, utcnow
from service.db.vanished import RowVanished, reread
from service.settings import Settings

log = logging.getLogger(__name__)


def delete_checkpoint_with_files(session: Session, store: ArtifactStore, ckpt: Checkpoint) -> None:
    """Its files, then its row; RowVanished when a concurrent request deleted the row first.

    The project is locked first, as a job's delete locks it: both then take the ledger and checkpoint
    rows in one order (unlocked, the two deadlocked on Postgres: ledger then checkpoint, and back)."""
    lock_project(session, ckpt.project_id)
    store.delete(ckpt.uri)
    if not checkpoints_crud.delete_checkpoint_row(session, ckpt.id):
        raise RowVanished("checkpoint", ckpt.id)
    usage.forget_key(session, ckpt.project_id, ckpt.uri)


def delete_dataset_with_files(session: Session, store: ArtifactStore, ds: Dataset) -> None:
    store.delete(f"datasets/{ds.id}")
    if not ds.uri.startswith(f"datasets/{ds.id}/"):
        store.delete(ds.uri)
    datasets_crud.delete_dataset_row(session, ds.id)
    usage.forget_key(session, ds.project_id, ds.uri)


def delete_job_with_files(session: Session, store: ArtifactStore, job: Job) -> bool:
    """Delete a terminal job's checkpoints, work directory (training checkpoints, tracker files), the
    derived data no other job of its project references (prepared and regenerated data, caches), and its
    rows; False (nothing touched) otherwise, RowVanished when a concurrent request deleted it first.

    The project is locked first: a worker recording that another job reuses one of those keys
    (`usage.record_usage`) either lands before, and keeps the key alive, or after, and finds it gone."""
    lock_project(session, job.project_id)
    job = reread(session, job, "job")  # read before the lock: a concurrent request may have changed it
    if job.status not in TERMINAL_STATUSES:
        return False
    for ckpt in checkpoints_crud.list_for_job(session, job.id):
        store.delete(ckpt.uri)
    for key in usage.keys_freed_by_job(session, job.project_id, job.id):
        store.delete(key)
    store.delete(f"jobs/{job.id}")
    usage.forget_job(session, job.id)
    if not jobs_crud.delete_job_row(session, job.id):
        raise RowVanished("job", job.id)
    return True


def apply_retention(session: Session, store: ArtifactStore, days: float, batch: int = 100) -> list[str]:
    """Delete (and commit, one job at a time) terminal jobs that finished more than `days` ago."""
    cutoff = utcnow() - timedelta(days=days)
    deleted = []
    for job in jobs_crud.finished_before(session, cutoff, limit=batch):
        job_id = job.id
        try:
            done = delete_job_with_files(session, store, job)
        except RowVanished:  # a client deleted it meanwhile
            done = False
        if done:
            session.commit()
            deleted.append(job_id)
        else:
            session.rollback()  # end the project lock before the next job's
    if deleted:
        log.info("retention: deleted %d job(s) finished before %s", len(deleted), cutoff.isoformat())
    return deleted


def housekeeping(session: Session, settings: Settings) -> list[str]:
    """The reconciler's periodic clean-up: purge expired idempotency keys, stale upload reservations and
    old plans, then apply the retention period if one is set. Returns the ids of the jobs deleted."""
    idempotency.purge_expired_keys(session)
    usage.purge_expired_reservations(session)
    plans.purge_finished(session)
    session.commit()
    if settings.retention_days is None:
        return []
    return apply_retention(session, ArtifactStore(settings.artifact_root), settings.retention_days)
