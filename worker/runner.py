"""Run one job end to end: claim it, prepare data, make hidden states available, train, publish.

The database is the source of truth. The claim is a conditional `queued -> running` update (two workers
never run one job); every later write is conditional on the job still being ours, so a job the
reconciler took back or a user cancelled is never overwritten with a stale result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from peagle_core.errors import DataError, PeagleError, VerifierError
from peagle_core.io import atomic_dir, sha256_file
from peagle_core.spec import JobSpec
from service.db import jobstate
from service.db.models import Checkpoint, Dataset, Job, JobEvent, new_id
from service.db.session import session_factory
from service.settings import Settings
from worker.artifacts import ArtifactStore, manifest_sha256
from worker.cancel import JobMonitor
from worker.progress import ProgressWriter

log = logging.getLogger(__name__)

ACTIVE = ("running", "cancelling")
STAGES = ("prepare", "hidden_states", "train", "eval", "export")


@dataclass
class Outcome:
    """What the training stage returned (a TrainResult, or the same fields from the torchrun ranks)."""

    status: str
    step: int
    export_dir: str | None
    checkpoint_dir: str | None
    metrics: dict[str, Any]


def error_for(exc: BaseException, *, stage: str) -> dict[str, Any]:
    """The `{code, message}` stored on a failed job: actionable text, never a traceback."""
    if isinstance(exc, PeagleError):
        return {"code": exc.code, "message": exc.message, "param": exc.param}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError):
        return {
            "code": "cuda_oom",
            "message": f"CUDA ran out of memory during {stage}: lower training.total_seq_len, raise "
            "training.num_segments (sequence partitioning), lower model.max_anchors, or use more GPUs "
            "(resources.gpus)",
        }
    return {
        "code": "internal_error",
        "message": f"internal error during {stage} ({type(exc).__name__}); see the worker log",
    }


def add_event(
    session: Session,
    job_id: str,
    type_: str,
    message: str,
    data: dict[str, Any] | None = None,
    level: str = "info",
) -> None:
    session.add(JobEvent(job_id=job_id, type=type_, message=message, data=data, level=level))


def trainer_event(kind: str, message: str, data: dict[str, Any] | None) -> tuple[str, str, dict[str, Any]]:
    """A trainer `on_event` as a job_events row: `type="stage"` with `data.stage` for stage transitions,
    else `type="log"` with `data.kind` (e.g. "epoch", whose data carries the hidden-state counters)."""
    if kind in STAGES:
        return "stage", message, {"stage": kind, **(data or {})}
    return "log", message, {"kind": kind, **(data or {})}


def latest_checkpoint_step(out_dir: Path) -> int | None:
    """The step of `out_dir/checkpoints/latest` (the trainer's resume point), or None."""
    latest = out_dir / "checkpoints" / "latest"
    if not latest.is_file():
        return None
    name = latest.read_text().strip()
    try:
        return int(name.rsplit("_", 1)[-1])
    except ValueError:
        return None


class JobRunner:
    """Drives one attempt of one job. `run()` returns the job's status afterwards ("skipped" if not claimed)."""

    def __init__(self, settings: Settings, job_id: str, worker_name: str):
        self.settings = settings
        self.job_id = job_id
        self.worker_name = worker_name
        self.sessions: sessionmaker[Session] = session_factory(settings.database_url)
        self.store = ArtifactStore(settings.artifact_root)
        self.stage = "claim"

    # -- lifecycle ---------------------------------------------------------------------------------

    def run(self) -> str:
        job = self._claim()
        if job is None:
            return "skipped"
        spec = JobSpec.model_validate(job.spec)
        monitor = JobMonitor(
            self.sessions, self.job_id, self.worker_name, heartbeat_s=self.settings.worker_heartbeat_s
        ).start()
        monitor.stop_on_signal()
        progress = ProgressWriter(self.sessions, self.job_id, attempt=job.attempt).start()
        try:
            try:
                outcome = self._execute(job, spec, monitor, progress)
            finally:
                # Every metric row lands before the job's final status is written.
                progress.close()
            monitor.check_now()
            if monitor.lost.is_set():
                log.warning("job %s is no longer ours; dropping its result", self.job_id)
                return "lost"
            if monitor.cancel_requested.is_set():
                return self._finish_cancelled(outcome)
            if outcome.status == "stopped" and monitor.preempted.is_set():
                return self._requeue_preempted(outcome)
            if outcome.status == "stopped":
                return self._finish_cancelled(outcome)
            return self._publish(job, spec, outcome)
        except Exception as exc:
            log.error("job %s failed during %s:\n%s", self.job_id, self.stage, traceback.format_exc())
            with self.sessions() as session:
                error = error_for(exc, stage=self.stage)
                moved = jobstate.transition(
                    session,
                    self.job_id,
                    "failed",
                    expect=ACTIVE,
                    event=f"failed during {self.stage}: {error['message']}",
                    event_data={"error": error, "stage": self.stage},
                    level="error",
                    error=error,
                )
            return "failed" if moved else "lost"
        except BaseException:
            # Interrupted (shutdown, Ctrl-C): hand the job back; the reconciler re-enqueues it.
            with self.sessions() as session:
                jobstate.transition(
                    session, self.job_id, "queued", expect=ACTIVE, event="worker interrupted; job requeued"
                )
            raise
        finally:
            monitor.stop()

    def _claim(self) -> Job | None:
        with self.sessions() as session:
            claimed = jobstate.transition(
                session,
                self.job_id,
                "running",
                expect=("queued",),
                event=f"running on {self.worker_name}",
                event_data={"worker": self.worker_name},
                attempt=Job.attempt + 1,
                worker_name=self.worker_name,
                heartbeat_at=jobstate.utcnow(),
                error=None,
            )
            job = session.get(Job, self.job_id)
            if job is None:
                log.warning("job %s does not exist; skipping", self.job_id)
                return None
            if not claimed:
                log.info("job %s is %s, not queued; skipping", self.job_id, job.status)
                add_event(
                    session,
                    self.job_id,
                    "log",
                    f"worker {self.worker_name} skipped the job: it is {job.status}, not queued",
                    {"worker": self.worker_name, "status": job.status},
                )
                session.commit()
                return None
            session.refresh(job)
            session.expunge(job)
        log.info("job %s claimed by %s (attempt %d)", self.job_id, self.worker_name, job.attempt)
        return job

    def _requeue_preempted(self, outcome: Outcome) -> str:
        """The worker is shutting down: hand the job back; the reconciler re-enqueues it and the next
        attempt resumes from the checkpoint just saved."""
        with self.sessions() as session:
            moved = jobstate.transition(
                session,
                self.job_id,
                "queued",
                expect=("running",),
                event=f"worker shutting down; checkpoint saved at step {outcome.step}, job requeued",
                event_data={"step": outcome.step, "checkpoint_saved": bool(outcome.checkpoint_dir)},
            )
        return "queued" if moved else "lost"

    def _finish_cancelled(self, outcome: Outcome) -> str:
        step = outcome.step
        message = (
            f"cancelled; checkpoint saved at step {step}"
            if outcome.checkpoint_dir
            else f"cancelled at step {step} before any checkpoint"
        )
        with self.sessions() as session:
            moved = jobstate.transition(
                session,
                self.job_id,
                "cancelled",
                expect=("cancelling",),
                event=message,
                event_data={"step": step, "checkpoint_saved": bool(outcome.checkpoint_dir)},
            )
        return "cancelled" if moved else "lost"

    # -- stages ------------------------------------------------------------------------------------

    def _enter(self, stage: str, progress: ProgressWriter, message: str, **data: Any) -> None:
        self.stage = stage
        with self.sessions() as session:
            add_event(session, self.job_id, "stage", message, {"stage": stage, **data})
            session.commit()
        progress.set_stage(stage)

    def _work_dir(self) -> Path:
        key = f"jobs/{self.job_id}/work"
        local = self.store.local_path(key)
        # A remote store keeps the out_dir on this machine's disk (resume then needs the same machine).
        return local if local is not None else Path(self.settings.data_dir) / "scratch" / self.job_id / "work"

    def _execute(self, job: Job, spec: JobSpec, monitor: JobMonitor, progress: ProgressWriter) -> Outcome:
        self.stage = "prepare"
        _check_verifier_path(spec)
        if spec.resources.gpus > 1:
            from worker.multigpu import rank_device

            rank_device(spec.resources.gpus)  # fail before any work when this worker cannot run it
        out_dir = self._work_dir()
        out_dir.mkdir(parents=True, exist_ok=True)

        data_path, source_sha = self._dataset_source(job, spec, out_dir)
        self._enter("prepare", progress, "preparing data")
        dataset_dir, reused = self._prepared_dataset(spec, data_path, source_sha, out_dir)
        if reused:
            self._event("log", "reusing prepared data", {"dataset_dir": str(dataset_dir)})

        # The trainer builds a missing offline cache itself and reports it as its `hidden_states` stage.
        cache_dir = self._cache_dir(spec, dataset_dir)

        resume_step = latest_checkpoint_step(out_dir)
        if resume_step is not None:
            self._event(
                "log", f"resuming from checkpoint at step {resume_step}", {"resume_step": resume_step}
            )
        self._enter("train", progress, "training", resume_step=resume_step, gpus=spec.resources.gpus)

        def on_event(kind: str, message: str, data: dict[str, Any] | None = None) -> None:
            if kind in STAGES:
                self.stage = kind
                progress.set_stage(kind)
            self._event(*trainer_event(kind, message, data))

        if spec.resources.gpus > 1:
            from worker.multigpu import train_distributed

            return train_distributed(
                self.settings,
                self.job_id,
                spec,
                out_dir,
                dataset_dir,
                cache_dir,
                attempt=job.attempt,
                worker_name=self.worker_name,
            )
        from peagle_core.train import train

        result = train(
            spec,
            out_dir,
            on_metrics=progress.on_metrics,
            should_stop=monitor.should_stop,
            on_event=on_event,
            resume=True,
            dataset_dir=dataset_dir,
            cache_dir=cache_dir,
        )
        return Outcome(
            status=result.status,
            step=int(result.step),
            export_dir=str(result.export_dir) if result.export_dir else None,
            checkpoint_dir=str(result.checkpoint_dir) if result.checkpoint_dir else None,
            metrics=dict(result.metrics or {}),
        )

    def _event(self, type_: str, message: str, data: dict[str, Any] | None = None) -> None:
        with self.sessions() as session:
            add_event(session, self.job_id, type_, message, data)
            session.commit()

    def _dataset_source(self, job: Job, spec: JobSpec, out_dir: Path) -> tuple[Path, str]:
        """The JSONL to prepare from and its sha256 (the reuse key's data part)."""
        if spec.dataset.path is not None:
            path = Path(spec.dataset.path)
            if not path.is_file():
                raise DataError(f"dataset.path {path} does not exist on the worker", param="dataset.path")
            return path, sha256_file(path)
        with self.sessions() as session:
            ds = session.execute(
                select(Dataset).where(Dataset.id == spec.dataset.id, Dataset.project_id == job.project_id)
            ).scalar_one_or_none()
        if ds is None:
            raise DataError(f"dataset {spec.dataset.id} was not found (deleted?)", param="dataset.id")
        local = self.store.local_path(ds.uri)
        if local is None:
            local = self.store.fetch_file(ds.uri, out_dir / "data" / "data.jsonl")
        return local, ds.sha256

    def _prepared_dataset(
        self, spec: JobSpec, data_path: Path, source_sha: str, out_dir: Path
    ) -> tuple[Path, bool]:
        """Prepared data shared by every job with the same source, tokenizer and options."""
        from peagle_core.data.prepare import prepare_for_spec

        key_src = {
            "source_sha256": source_sha,
            "verifier": spec.verifier.name_or_path,
            "revision": spec.verifier.revision,
            "seq_len": spec.dataset.seq_len,
            "format": spec.dataset.format,
            "max_samples": spec.dataset.max_samples,
            "draft_vocab_size": spec.model.draft_vocab_size,
        }
        key = "prepared/" + hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:32]
        local = self.store.local_path(key)
        if local is not None:
            if (local / "manifest.json").is_file():
                return local, True
            with atomic_dir(local) as tmp:
                prepare_for_spec(spec, data_path, tmp)
            return local, False
        scratch = out_dir / "prepared"
        if self.store.exists(f"{key}/manifest.json"):
            if not (scratch / "manifest.json").is_file():
                self.store.fetch_dir(key, scratch)
            return scratch, True
        with atomic_dir(scratch) as tmp:
            prepare_for_spec(spec, data_path, tmp)
        self.store.publish_dir(scratch, key)
        return scratch, False

    def _cache_dir(self, spec: JobSpec, dataset_dir: Path) -> Path:
        if spec.hidden_states.cache_uri:
            return Path(spec.hidden_states.cache_uri)
        manifest = json.loads((dataset_dir / "manifest.json").read_text())
        key_src = {
            "verifier": spec.verifier.name_or_path,
            "revision": spec.verifier.revision,
            "layer_ids": spec.verifier.layer_ids,
            "data": manifest.get("fingerprint"),
            "dtype": spec.hidden_states.dtype,
        }
        key = "caches/hs-" + hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
        local = self.store.local_path(key)
        return local if local is not None else Path(self.settings.data_dir) / "scratch" / key

    # -- publish -----------------------------------------------------------------------------------

    def _publish(self, job: Job, spec: JobSpec, outcome: Outcome) -> str:
        """Validate the export, copy it under a temp key, verify, rename, and only then insert the row."""
        from peagle_core.errors import CheckpointError
        from peagle_core.export import validate_checkpoint

        self.stage = "publish"
        if outcome.export_dir is None:
            raise CheckpointError(["training completed but produced no export"])
        export_dir = Path(outcome.export_dir)
        problems = validate_checkpoint(export_dir)
        if problems:
            raise CheckpointError(problems, path=str(export_dir))
        ckpt_id = new_id("ckpt")
        key = f"checkpoints/{ckpt_id}"
        files = self.store.publish_dir(export_dir, key)
        metrics = dict(outcome.metrics)
        eval_json = export_dir / "eval.json"
        if eval_json.is_file():
            metrics.setdefault("eval", json.loads(eval_json.read_text()))
        with self.sessions() as session:
            session.add(
                Checkpoint(
                    id=ckpt_id,
                    job_id=self.job_id,
                    project_id=job.project_id,
                    step=outcome.step,
                    uri=key,
                    files=list(files),
                    sha256=manifest_sha256(files),
                    size=sum(f["size"] for f in files),
                    metrics=_json_safe(metrics),
                )
            )
            moved = jobstate.transition(
                session,
                self.job_id,
                "succeeded",
                expect=ACTIVE,
                event=f"succeeded at step {outcome.step}; checkpoint {ckpt_id} published",
                event_data={"checkpoint_id": ckpt_id, "step": outcome.step},
                commit=False,
                progress={"stage": "done", "step": outcome.step, "total_steps": outcome.step, "eta_s": 0},
            )
            if not moved:
                # Someone else finished the job meanwhile: no row may point at our copy.
                session.rollback()
                self.store.delete(key)
                return "lost"
            session.commit()
        return "succeeded"


def _json_safe(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def _check_verifier_path(spec: JobSpec) -> None:
    name = spec.verifier.name_or_path
    looks_local = name.startswith(("/", "./", "../", "~")) or Path(name).exists()
    if looks_local and not Path(name).expanduser().is_dir():
        raise VerifierError(
            f"verifier.name_or_path: {name} does not exist on the worker",
            code="verifier_not_found",
            param="verifier.name_or_path",
        )
