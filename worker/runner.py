"""Run one job end to end: claim it, run `peagle_core.pipeline.stages` with this attempt's store, callbacks and
fencing, publish.

The database is the source of truth. The claim is a conditional `queued -> running` update (two workers
never run one job) that hands out the attempt number, the run's fencing token; every later write (status,
progress, metrics, events, resume point, publish) is conditional on the job still being on that attempt,
so a job the reconciler took back or a user cancelled is never overwritten with a stale result. Each
attempt trains in a scratch directory of its own and resumes from the checkpoint mirrored to the store.
"""

from __future__ import annotations

import logging
import shutil
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker

from peagle_core.data.source import InputFile
from peagle_core.errors import CheckpointError, DataError, VerifierError
from peagle_core.keys import PREPARE
from peagle_core.pipeline.stages import Callbacks, Pipeline, PipelineResult, TrainStage
from peagle_core.spec import JobSpec
from service.artifacts import ArtifactStore
from service.crud import jobstate
from service.crud.checkpoints import add_checkpoint, find_checkpoint
from service.crud.datasets import get_dataset_row
from service.crud.events import add_event
from service.crud.jobs import ACTIVE_STATUSES, find_job
from service.db.jsondata import json_safe
from service.db.models import Job, new_id
from service.db.retry import retry_transient
from service.db.session import session_factory
from service.paths import check_spec_paths
from service.queue import redis_from_url
from service.settings import Settings
from worker.attempt import AttemptContext
from worker.gang import GangLeader, NodeLost
from worker.job_io import JobReporter, error_for, submitted_spec
from worker.mirror import CheckpointMirror, restore
from worker.monitor import JobMonitor
from worker.multigpu import RankLaunch, rank_device, train_distributed
from worker.progress import ProgressWriter
from worker.trackers import JobTrackers
from worker.usage import local_bytes
from worker.usage import record as record_usage

log = logging.getLogger(__name__)

T = TypeVar("T")


class JobRunner:
    """Drives one attempt of one job. `run()` returns the job's status afterwards ("skipped" if not claimed)."""

    def __init__(self, settings: Settings, job_id: str, worker_name: str):
        self.settings = settings
        self.job_id = job_id
        self.worker_name = worker_name
        self.sessions: sessionmaker[Session] = session_factory(settings.database_url)
        self.store = ArtifactStore(settings.artifact_root)
        self.stage = "claim"
        self.published_dir: Path | None = None  # the export `_publish` published (trackers upload it)
        self.attempt = 0  # set by the claim
        self.prepared_key: str | None = None  # store key of the prepared data (members of a gang fetch it)
        self.cache: tuple[str, str, Path] | None = (
            None  # (project, key, path) of the job's hidden-state cache
        )

    # -- database access: fenced by the attempt, retried through an outage ---------------------------

    def _db(self, fn: Callable[[], T], what: str) -> T:
        return retry_transient(fn, tolerance_s=self.settings.db_outage_tolerance_s, what=what)

    def _move(self, to: str, **kwargs: Any) -> bool:
        """`jobstate.transition` of this attempt (fenced), retried through a database outage."""

        def move() -> bool:
            with self.sessions() as session:
                return jobstate.transition(session, self.job_id, to, fence=self.attempt, **kwargs)

        return self._db(move, f"moving job {self.job_id} to {to}")

    # -- lifecycle ---------------------------------------------------------------------------------

    def run(self) -> str:
        job = self._claim()
        return self._attempt(job) if job is not None else "skipped"

    def _attempt(self, job: Job) -> str:
        """Run the claimed attempt of `job` with its monitor, progress writer, trackers and checkpoint
        mirror, and settle its status: one exit, whatever ended it (an interrupt re-raises)."""
        # The claim's attempt number is this run's fencing token: every write below is conditional on it.
        self.attempt = job.attempt
        spec = submitted_spec(job)
        work_dir = self._work_dir()
        ctx = AttemptContext(self.sessions, self.job_id, self.attempt)
        monitor = JobMonitor(
            ctx,
            heartbeat_s=self.settings.worker_heartbeat_s,
            redis=redis_from_url(self.settings.redis_url),
            stage_timeout_s=self.settings.stage_timeout_s,
        ).start()
        monitor.stop_on_signal()
        progress = ProgressWriter(ctx).start()
        trackers = JobTrackers(self.settings, ctx, self.store, job.project_id, spec).start()
        mirror = CheckpointMirror(
            self.store,
            ctx,
            work_dir,
            current_uri=job.resume_uri,
            on_mirrored=lambda nbytes: self._charge(
                job.project_id, "training_checkpoint", f"jobs/{self.job_id}/checkpoints", nbytes=nbytes
            ),
        )
        try:
            try:
                result = self._execute(job, spec, monitor, progress, mirror, work_dir)
            finally:
                # Every metric row and the newest checkpoint land before the job's final status is written.
                progress.close(tolerance_s=self.settings.db_outage_tolerance_s)
                mirror.close(tolerance_s=self.settings.db_outage_tolerance_s)
            self._db(monitor.check_now, f"checking job {self.job_id}")
            lost = monitor.lost.is_set() or mirror.lost.is_set() or progress.lost.is_set()
            status = self._settle(job, spec, result, monitor, lost=lost)
        except NodeLost as exc:
            status = self._requeue_node_lost(job, exc)
        except Exception as exc:
            status = self._fail(exc)
        except BaseException:
            self._hand_back()
            raise
        finally:
            monitor.stop()
            self._charge_cache()
            trackers.finish(self.published_dir)
            shutil.rmtree(work_dir, ignore_errors=True)  # the store holds the resume point
        return status

    def _settle(
        self, job: Job, spec: JobSpec, result: PipelineResult, monitor: JobMonitor, *, lost: bool
    ) -> str:
        """The job's status once its pipeline returned: dropped when the attempt lost the job, cancelled
        on request, published when it completed, failed when a stage ran out of time, requeued when the
        worker (or a member machine of a gang) drains."""
        if lost:
            log.warning("job %s is no longer attempt %d's; dropping its result", self.job_id, self.attempt)
            return "lost"
        if monitor.cancel_requested.is_set():
            return self._finish_cancelled(result)
        if result.status != "stopped":
            return self._publish(job, result)
        if monitor.timed_out_stage is not None:
            return self._fail_timed_out(monitor.timed_out_stage)
        # A member machine's drain stops the whole gang: the job goes back to the queue as well.
        if monitor.preempted.is_set() or spec.resources.nodes_max > 1:
            return self._requeue_preempted(result)
        return self._finish_cancelled(result)

    def _fail(self, exc: Exception) -> str:
        """The attempt raised: the job fails with the error, named by the stage it was in."""
        log.error("job %s failed during %s:\n%s", self.job_id, self.stage, traceback.format_exc())
        return self._record_failure(error_for(exc, stage=self.stage), self.stage)

    def _fail_timed_out(self, stage: str) -> str:
        """A stage ran past `stage_timeout_s` and stopped: the job fails (its last checkpoint is kept)."""
        limit = self.settings.stage_timeout_s
        message = f"the {stage} stage ran longer than its limit of {limit:g}s (PEAGLE_STAGE_TIMEOUT_S)"
        return self._record_failure({"code": "stage_timeout", "message": message, "param": None}, stage)

    def _record_failure(self, error: dict[str, Any], stage: str) -> str:
        moved = self._move(
            "failed",
            expect=ACTIVE_STATUSES,
            event=f"failed during {stage}: {error['message']}",
            event_data={"error": error, "stage": stage},
            level="error",
            error=error,
        )
        return "failed" if moved else "lost"

    def _hand_back(self) -> None:
        """Interrupted (shutdown, Ctrl-C): hand a running job back, the reconciler re-enqueues it. A job
        whose cancel was requested ends cancelled: a cancel is never undone."""
        if not self._move("queued", expect=("running",), event="worker interrupted; job requeued"):
            self._move(
                "cancelled",
                expect=("cancelling",),
                event="cancelled: the worker was interrupted while the job was stopping",
            )

    def _claim(self) -> Job | None:
        def claim() -> Job | None:
            with self.sessions() as session:
                claimed = jobstate.claim(session, self.job_id, self.worker_name)
                job = find_job(session, self.job_id)
                if job is None:
                    log.warning("job %s does not exist; skipping", self.job_id)
                    return None
                if not claimed:
                    log.info("job %s is %s, not queued; skipping", self.job_id, job.status)
                    # In this session: on SQLite the failed claim's UPDATE holds the write lock until commit.
                    add_event(
                        session,
                        self.job_id,
                        "log",
                        f"worker {self.worker_name} skipped the job: it is {job.status}, not queued",
                        data={"worker": self.worker_name, "status": job.status},
                    )
                    session.commit()
                    return None
                session.refresh(job)
                session.expunge(job)
                return job

        job = self._db(claim, f"claiming job {self.job_id}")
        if job is not None:
            log.info("job %s claimed by %s (attempt %d)", self.job_id, self.worker_name, job.attempt)
        return job

    def _requeue_preempted(self, result: PipelineResult) -> str:
        """The worker is shutting down: hand the job back; the reconciler re-enqueues it and the next
        attempt resumes from the checkpoint just saved."""
        moved = self._move(
            "queued",
            expect=("running",),
            event=f"worker shutting down; checkpoint saved at step {result.step}, job requeued",
            event_data={"step": result.step, "checkpoint_saved": bool(result.checkpoint_dir)},
        )
        return "queued" if moved else "lost"

    def _requeue_node_lost(self, job: Job, exc: NodeLost) -> str:
        """A machine of the gang died: hand the job back (it resumes from its last checkpoint on whatever
        machines join next), or fail it once its attempts are spent."""
        if self.attempt >= job.max_attempts:
            error = {"code": exc.code, "message": f"{exc.message}; attempts exhausted ({self.attempt})"}
            moved = self._move(
                "failed", expect=ACTIVE_STATUSES, event=error["message"], level="error", error=error
            )
            return "failed" if moved else "lost"
        moved = self._move(
            "queued",
            expect=("running",),
            event=f"requeued: {exc.message}",
            event_data={"reason": exc.code, "attempt": self.attempt},
            level="warning",
        )
        return "queued" if moved else "lost"

    def _finish_cancelled(self, result: PipelineResult) -> str:
        step = result.step
        message = (
            f"cancelled; checkpoint saved at step {step}"
            if result.checkpoint_dir
            else f"cancelled at step {step} before any checkpoint"
        )
        moved = self._move(
            "cancelled",
            expect=("cancelling",),
            event=message,
            event_data={"step": step, "checkpoint_saved": bool(result.checkpoint_dir)},
        )
        return "cancelled" if moved else "lost"

    # -- stages ------------------------------------------------------------------------------------

    def _work_dir(self) -> Path:
        """This attempt's own scratch directory (earlier attempts' are removed): two attempts of one job
        never share a directory, and a resume starts from the store's mirrored checkpoint."""
        job_dir = Path(self.settings.data_dir) / "scratch" / "jobs" / self.job_id
        for old in job_dir.glob("attempt-*"):
            if old.name != f"attempt-{self.attempt}":
                shutil.rmtree(old, ignore_errors=True)
        return job_dir / f"attempt-{self.attempt}"

    def _execute(
        self,
        job: Job,
        spec: JobSpec,
        monitor: JobMonitor,
        progress: ProgressWriter,
        mirror: CheckpointMirror,
        work_dir: Path,
    ) -> PipelineResult:
        """The pipeline with this attempt's store, callbacks and fencing."""
        self.stage = PREPARE
        _check_verifier_path(spec)
        # The operator may have narrowed the roots (or trust_remote_code) since the API accepted the job.
        spec = check_spec_paths(spec, self.settings, prefix="", project_id=job.project_id)
        if spec.resources.gpus > 1 or spec.resources.nodes_max > 1:
            rank_device(spec.resources.gpus)  # fail before any work when this worker cannot run it
        work_dir.mkdir(parents=True, exist_ok=True)
        source = self._dataset_source(job, spec, work_dir)

        # Stage outputs are shared by a project's jobs only: a project never learns (from a reuse, or its
        # speed) that another one prepared the same data.
        scope = f"projects/{job.project_id}"

        def on_stage(stage: str) -> None:
            self.stage = stage
            monitor.enter_stage(stage)
            progress.set_stage(stage)

        callbacks = Callbacks(
            reporter=JobReporter(progress, on_stage=on_stage),
            on_progress=lambda fields: progress.set_fields(**fields),
            should_stop=monitor.should_stop,
            should_stop_now=monitor.should_stop_now,
            on_stored=lambda kind, key, local: self._stored(job.project_id, kind, f"{scope}/{key}", local),
        )

        def before_train() -> None:
            resume_step = restore(self.store, job.resume_uri, work_dir)
            mirror.start()
            if resume_step is not None:
                callbacks.log(
                    "resume", f"resuming from checkpoint at step {resume_step}", resume_step=resume_step
                )

        pipeline = Pipeline.of(
            spec,
            work_dir,
            store=self.store.scoped(scope),
            source=source,
            scratch=Path(self.settings.data_dir) / "scratch" / scope,
            callbacks=callbacks,
            max_line_bytes=self.settings.max_line_bytes,
        )
        return pipeline.run(before_train=before_train, train_stage=self._train_stage(job, spec, monitor))

    def _train_stage(self, job: Job, spec: JobSpec, monitor: JobMonitor) -> TrainStage | None:
        """Where training runs: a gang of workers across nodes, torchrun on this node's GPUs, or (None)
        the pipeline's own process."""
        if spec.resources.nodes_max > 1:
            leader = GangLeader(
                self.settings, AttemptContext(self.sessions, self.job_id, self.attempt), self.worker_name,
                preempted=monitor.preempted, prepared_key=lambda: self.prepared_key,
            )  # fmt: skip
            return leader.train
        if spec.resources.gpus > 1:
            return self._train_distributed(job, monitor.preempted)
        return None

    def _train_distributed(self, job: Job, preempted: threading.Event) -> TrainStage:
        def train_stage(
            spec: JobSpec, work_dir: Path, dataset_dir: Path, cache_dir: Path, _cb: Callbacks, _resume: bool
        ) -> PipelineResult:
            # The ranks report through the database themselves (worker.multigpu).
            launch = RankLaunch(self.settings, self.job_id, spec, work_dir, dataset_dir, cache_dir, job.attempt,
                                self.worker_name)  # fmt: skip
            return train_distributed(launch, preempted=preempted)

        return train_stage

    def _dataset_source(self, job: Job, spec: JobSpec, out_dir: Path) -> InputFile:
        """The JSONL to train on, checked and hashed once (a stored dataset's sha256 is its row's)."""
        if spec.dataset.path is not None:
            return InputFile.of(spec.dataset.path, param="dataset.path", where=" on the worker")

        def dataset() -> Any:
            with self.sessions() as session:
                return get_dataset_row(session, job.project_id, spec.dataset.id)

        ds = self._db(dataset, f"reading dataset {spec.dataset.id}")
        if ds is None:
            raise DataError(f"dataset {spec.dataset.id} was not found (deleted?)", param="dataset.id")
        local = self.store.local_path(ds.uri)
        if local is None:
            local = self.store.fetch_file(ds.uri, out_dir / "data" / "data.jsonl")
        return InputFile.of(local, param="dataset.path", sha256=ds.sha256)

    # -- storage ledger ----------------------------------------------------------------------------

    def _stored(self, project_id: str, kind: str, key: str, local: Path | None) -> None:
        if kind == "prepared":
            self.prepared_key = key
        if kind == "cache":  # charged again once training built (part of) it
            self.cache = (project_id, key, local) if local is not None else None
        self._charge(project_id, kind, key, local)

    def _charge(self, project_id: str, kind: str, key: str, local: Path | None = None, *,
                nbytes: int | None = None) -> None:  # fmt: skip
        """Record the bytes under `key` for this job (from `local` when the data lives there)."""
        if nbytes is None:
            nbytes = local_bytes(local) if local is not None else self.store.size_under(key)
        record_usage(self.sessions, project_id, self.job_id, kind, key, nbytes,
                     tolerance_s=self.settings.db_outage_tolerance_s)  # fmt: skip

    def _charge_cache(self) -> None:
        """The cache's bytes once training built (part of) it; an accounting failure fails no job."""
        if self.cache is None:
            return
        project_id, key, path = self.cache
        try:
            self._charge(project_id, "cache", key, path)
        except Exception as exc:
            log.error("job %s: the cache's storage was not recorded: %s", self.job_id, exc)

    # -- publish -----------------------------------------------------------------------------------

    def _publish(self, job: Job, result: PipelineResult) -> str:
        """Copy the export under a temp key, verify, rename, and only then insert the row.

        The trainer validated the export before returning it (`peagle_core.serving.export.export_checkpoint`).
        """
        self.stage = "publish"
        if result.export_dir is None:
            raise CheckpointError(["training completed but produced no export"])
        ckpt_id = new_id("ckpt")
        key = f"checkpoints/{ckpt_id}"
        files = self.store.publish_dir(result.export_dir, key)
        metrics = dict(result.metrics)
        if result.evaluation is not None:
            metrics.setdefault("eval", result.evaluation.to_dict())

        def commit() -> bool:
            with self.sessions() as session:
                add_checkpoint(
                    session,
                    checkpoint_id=ckpt_id,
                    job_id=self.job_id,
                    project_id=job.project_id,
                    step=result.step,
                    uri=key,
                    files=files,
                    metrics=json_safe(metrics),
                    servable=result.serving.status if result.serving is not None else "unverified",
                )
                moved = jobstate.transition(
                    session,
                    self.job_id,
                    "succeeded",
                    expect=ACTIVE_STATUSES,
                    fence=self.attempt,
                    event=f"succeeded at step {result.step}; checkpoint {ckpt_id} published",
                    event_data={"checkpoint_id": ckpt_id, "step": result.step},
                    commit=False,
                    progress=done_progress(result),
                )
                if not moved:
                    session.rollback()
                    # A retry after a commit whose answer the outage swallowed finds its own row.
                    return find_checkpoint(session, ckpt_id) is not None
                session.commit()
                return True

        if not self._db(commit, f"publishing checkpoint {ckpt_id}"):
            # Someone else finished the job meanwhile: no row may point at our copy.
            self.store.delete(key)
            return "lost"
        self.published_dir = result.export_dir
        return "succeeded"


def done_progress(result: PipelineResult) -> dict[str, Any]:
    """A succeeded job's last progress, with the serving recommendation (`evaluation.measure_speedup`) so
    that `GET /v1/jobs/{id}` says how to serve the job's drafter."""
    progress: dict[str, Any] = {"stage": "done", "step": result.step, "total_steps": result.step, "eta_s": 0}
    if result.serving is not None and result.serving.recommendation is not None:
        progress["recommendation"] = result.serving.recommendation.to_dict()
    return progress


def _check_verifier_path(spec: JobSpec) -> None:
    name = spec.verifier.name_or_path
    looks_local = name.startswith(("/", "./", "../", "~")) or Path(name).exists()
    if looks_local and not Path(name).expanduser().is_dir():
        raise VerifierError(
            f"verifier.name_or_path: {name} does not exist on the worker",
            code="verifier_not_found",
            param="verifier.name_or_path",
        )
