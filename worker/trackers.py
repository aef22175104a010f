"""A job's experiment trackers (`tracking.report_to`): TensorBoard event files and an MLflow run.

`JobTrackers` runs on its own thread beside the job: it tails the job's metric rows (the same rows the
API serves, so a tracker holds exactly the API's values, on one path for single- and multi-GPU jobs) and
forwards them to each tracker. A tracker that raises logs one warning event and is dropped for the rest of
the job; it never fails the job. A database outage does not end the thread either: reads are retried for
PEAGLE_DB_OUTAGE_TOLERANCE_S, a longer outage costs one warning event (written once the database is
back) and the next poll catches up from the same cursor. Whatever happened, the trackers are closed at
the end. Every write is fenced by the attempt: warning events, ending the MLflow run and publishing the
TensorBoard files happen only while no newer attempt owns the job.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Protocol

from peagle_core.spec import JobSpec
from service.artifacts import ArtifactStore
from service.crud.events import add_event
from service.crud.jobs import hold_attempt, holder
from service.crud.metrics import metrics_after
from service.db.retry import retry_transient
from service.settings import Settings
from service.tracking import tensorboard_key
from worker.attempt import AttemptContext
from worker.usage import record as record_usage

log = logging.getLogger(__name__)

# One value per (tracker, spec key); MLflow's limits on a param value and on a log_batch call.
_MLFLOW_PARAM_MAX = 6000
_MLFLOW_BATCH = 1000
_MLFLOW_PARAMS_BATCH = 100
# MLflow's run statuses for our terminal job statuses. An attempt that ends without one (requeued by a drain,
# or its status unreadable) ends the run KILLED; the attempt that resumes the job marks it RUNNING again.
_MLFLOW_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}


def mlflow_metric_name(key: str) -> str:
    """A metric key as MLflow accepts it (letters, digits, `_-. /:`): `eval/acceptance_length@4` becomes
    `eval/acceptance_length_4`."""
    return re.sub(r"[^\w\-. /:]", "_", key)


def numeric_values(values: dict[str, Any]) -> dict[str, float]:
    """The chartable part of a metric row: finite numbers, without the step and attempt counters."""
    return {
        k: float(v)
        for k, v in values.items()
        if k not in ("step", "attempt") and isinstance(v, int | float) and not isinstance(v, bool)
    }


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"training": {"lr": 0.1}}` -> `{"training.lr": "0.1"}`: the resolved spec as MLflow params."""
    out: dict[str, str] = {}
    for k, v in data.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{name}."))
        else:
            out[name] = (v if isinstance(v, str) else json.dumps(v))[:_MLFLOW_PARAM_MAX]
    return out


class Tracker(Protocol):
    """What the fan-out calls; any exception disables the tracker for the rest of the job."""

    name: str

    def log_metrics(self, rows: list[tuple[int, float, dict[str, float]]]) -> None:
        """Rows of (step, unix time, values), in logging order."""

    def log_checkpoint(self, path: Path) -> None:
        """The published checkpoint directory."""

    def close(self, status: str | None, *, owner: bool) -> None:
        """The job's status now (None if unknown); `owner`: no newer attempt owns the job (so its shared
        state, e.g. the MLflow run, is this attempt's to end). Called once, last."""

    def publish(self) -> None:
        """Hand local files over to the artifact store (after `close`, only while the attempt owns the
        job)."""


class TensorBoardTracker:
    """Event files under the job's artifact folder (`tensorboard --logdir` reads them as they grow)."""

    name = "tensorboard"

    def __init__(self, store: ArtifactStore, job_id: str, scratch: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.store = store
        self.key = tensorboard_key(job_id)
        local = store.local_path(self.key)
        # A remote store gets the finished folder at close; attempts add event files beside each other.
        self.log_dir = local if local is not None else scratch / "tensorboard"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.log_dir), flush_secs=5)

    def log_metrics(self, rows: list[tuple[int, float, dict[str, float]]]) -> None:
        for step, walltime, values in rows:
            for key, value in values.items():
                self.writer.add_scalar(key, value, global_step=step, walltime=walltime)
        self.writer.flush()

    def log_checkpoint(self, path: Path) -> None:
        """TensorBoard holds no files; the checkpoint is in the service."""

    def close(self, status: str | None, *, owner: bool) -> None:
        self.writer.close()

    def publish(self) -> None:
        if self.store.local_path(self.key) is None:
            self.store.delete(self.key)
            self.store.publish_dir(self.log_dir, self.key)


class MlflowTracker:
    """One MLflow run per job (found again by its `peagle.job_id` tag when a later attempt resumes)."""

    name = "mlflow"

    def __init__(self, settings: Settings, job_id: str, project_id: str, spec: dict[str, Any]):
        # An unreachable server must fail in seconds, not after MLflow's default minutes of retries;
        # the operator's own MLFLOW_HTTP_* settings win.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        if not settings.mlflow_tracking_uri:
            raise RuntimeError("PEAGLE_MLFLOW_TRACKING_URI is not set on the worker")
        self.client = MlflowClient(tracking_uri=settings.mlflow_tracking_uri)
        experiment_id = self._experiment(settings.mlflow_experiment)
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`peagle.job_id` = '{job_id}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            # An earlier attempt ended it (KILLED) when it was requeued; it is live again.
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(
            experiment_id,
            run_name=spec.get("name") or job_id,
            tags={"peagle.job_id": job_id, "peagle.project_id": project_id},
        )
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in flatten(spec).items()]
        for i in range(0, len(params), _MLFLOW_PARAMS_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _MLFLOW_PARAMS_BATCH])
        self.client.log_dict(self.run_id, spec, "spec.json")

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # another worker created it first
            return self.client.get_experiment_by_name(name).experiment_id

    def log_metrics(self, rows: list[tuple[int, float, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(mlflow_metric_name(k), v, int(walltime * 1000), step)
            for step, walltime, values in rows
            for k, v in values.items()
        ]
        for i in range(0, len(metrics), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _MLFLOW_BATCH])

    def log_checkpoint(self, path: Path) -> None:
        self.client.log_artifacts(self.run_id, str(path), artifact_path="checkpoint")

    def close(self, status: str | None, *, owner: bool) -> None:
        if owner:  # else a newer attempt logs to this run and ends it
            self.client.set_terminated(self.run_id, _MLFLOW_STATUS.get(status or "", "KILLED"))

    def publish(self) -> None:
        """Everything is on the MLflow server already."""


class JobTrackers:
    """Tails one attempt's metric rows into the job's trackers on a daemon thread.

    `start()` returns at once (opening a tracker may wait on the network); `finish(checkpoint_dir)`, called
    after the job's final status is written, forwards the last rows and the checkpoint, closes every
    tracker and waits for that at most `finish_timeout_s`.
    """

    def __init__(
        self,
        settings: Settings,
        ctx: AttemptContext,
        store: ArtifactStore,
        project_id: str,
        spec: JobSpec,
        *,
        poll_s: float = 2.0,
        finish_timeout_s: float = 300.0,
    ):
        self.settings, self.ctx, self.store = settings, ctx, store
        self.project_id = project_id
        self.spec = spec
        self.poll_s, self.finish_timeout_s = poll_s, finish_timeout_s
        self.trackers: list[Tracker] = []
        self._cursor: int | None = None
        self._checkpoint: Path | None = None
        self._pending: list[tuple[str, dict[str, Any]]] = []  # warning events the database has not taken yet
        self._warned_db = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"trackers-{ctx.job_id}", daemon=True)

    def start(self) -> JobTrackers:
        if self.spec.tracking.report_to:
            self._thread.start()
        return self

    def finish(self, checkpoint_dir: str | Path | None = None) -> None:
        if not self._thread.is_alive():
            return
        self._checkpoint = Path(checkpoint_dir) if checkpoint_dir else None
        self._done.set()
        self._thread.join(self.finish_timeout_s)
        if self._thread.is_alive():
            log.warning(
                "job %s: trackers still busy after %.0f s; leaving them",
                self.ctx.job_id,
                self.finish_timeout_s,
            )

    # -- the thread --------------------------------------------------------------------------------

    def _db(self, fn: Any, what: str) -> Any:
        return retry_transient(fn, tolerance_s=self.settings.db_outage_tolerance_s, what=what)

    def _open(self, name: str) -> Tracker:
        if name == "tensorboard":
            scratch = Path(self.settings.data_dir) / "scratch" / self.ctx.job_id
            return TensorBoardTracker(self.store, self.ctx.job_id, scratch)
        return MlflowTracker(
            self.settings, self.ctx.job_id, self.project_id, self.spec.model_dump(mode="json")
        )

    def _run(self) -> None:
        try:
            for name in self.spec.tracking.report_to:
                tracker = self._call(name, "start", lambda name=name: self._open(name))
                if tracker is not None:
                    self.trackers.append(tracker)
            while not self._done.wait(self.poll_s):
                self._poll()
            self._poll()
        finally:
            self._close_all()

    def _poll(self) -> None:
        """Forward new rows and write pending warnings. An outage that outlasts the retries is noted (one
        warning per attempt) and the next poll starts from the same cursor: no row is skipped."""
        try:
            self._forward()
        except Exception as exc:
            log.warning("job %s: trackers could not read new metrics: %s", self.ctx.job_id, exc)
            if not self._warned_db:
                self._warned_db = True
                self._warn(
                    f"trackers could not read this job's metrics ({type(exc).__name__}: the database was "
                    "unavailable); they catch up when it is back",
                    {"tracker": "all", "action": "metrics", "error": type(exc).__name__},
                )
        self._flush_warnings()

    def _forward(self) -> None:
        """Send the attempt's metric rows logged since the last call to every live tracker."""
        while self.trackers:

            def read(cursor: int | None = self._cursor) -> tuple[list[Any], bool]:
                with self.ctx.sessions() as session:
                    return metrics_after(session, self.ctx.job_id, cursor, 1000)

            rows, more = self._db(read, f"reading metrics of job {self.ctx.job_id} for its trackers")
            if not rows:
                return
            self._cursor = rows[-1].id
            batch = [
                (r.step, r.created_at.timestamp(), numeric_values(r.values))
                for r in rows
                if r.values.get("attempt", self.ctx.attempt) == self.ctx.attempt
            ]
            for tracker in list(self.trackers):
                self._call(tracker.name, "metrics", lambda t=tracker, b=batch: t.log_metrics(b))
            if not more:
                return

    def _final_state(self) -> tuple[str | None, bool]:
        """(the job's status, whether this attempt still owns it); (None, True) when unreadable: the
        trackers are closed all the same, and the fenced steps (publishing) then refuse on their own."""

        def read() -> Any:
            with self.ctx.sessions() as session:
                return holder(session, self.ctx.job_id)

        try:
            row = self._db(read, f"reading job {self.ctx.job_id}'s status for its trackers")
        except Exception as exc:
            log.warning("job %s: status unreadable when closing trackers: %s", self.ctx.job_id, exc)
            return None, True
        if row is None:
            return None, False
        return row.status, row.attempt == self.ctx.attempt

    def _close_all(self) -> None:
        status, owner = self._final_state()
        for tracker in list(self.trackers):
            if owner and self._checkpoint is not None and status == "succeeded":
                self._call(
                    tracker.name, "checkpoint upload", lambda t=tracker: t.log_checkpoint(self._checkpoint)
                )
            if tracker in self.trackers:
                self._call(tracker.name, "close", lambda t=tracker: t.close(status, owner=owner))
            if tracker in self.trackers and owner:
                self._call(tracker.name, "publish", lambda t=tracker: self._publish(t))
        if (
            owner and "tensorboard" in self.spec.tracking.report_to
        ):  # its event files count against the project
            key = tensorboard_key(self.ctx.job_id)
            self._call("tensorboard", "storage record", lambda: record_usage(
                self.ctx.sessions, self.project_id, self.ctx.job_id, "tracker", key, self.store.size_under(key)))  # fmt: skip
        self._flush_warnings()

    def _publish(self, tracker: Tracker) -> None:
        """`tracker.publish()` while the job row is locked on this attempt: a newer attempt's claim waits,
        and a stale attempt never replaces the files of a newer one. (On SQLite the lock is the database's
        write lock, held for the copy of a few event files.)"""

        def publish() -> bool:
            with self.ctx.sessions() as session:
                if not hold_attempt(session, self.ctx.job_id, self.ctx.attempt):
                    return False
                tracker.publish()
                session.commit()
                return True

        if not self._db(publish, f"publishing the {tracker.name} files of job {self.ctx.job_id}"):
            log.info("job %s: a newer attempt owns it; %s files not published", self.ctx.job_id, tracker.name)

    def _call(self, name: str, action: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:
            log.warning("job %s: %s tracker failed during %s: %s", self.ctx.job_id, name, action, exc)
            self.trackers = [t for t in self.trackers if t.name != name]
            reason = " ".join(str(exc).split())[:300] or type(exc).__name__
            self._warn(
                f"{name} tracker failed during {action} and is off for the rest of this job: {reason}",
                {"tracker": name, "action": action, "error": type(exc).__name__},
            )
            self._flush_warnings()
            return None

    def _warn(self, message: str, data: dict[str, Any]) -> None:
        self._pending.append((message, data))

    def _flush_warnings(self) -> None:
        """Write the pending warning events, each only if this attempt still owns the job (a stale one's
        are dropped); while the database is down they stay pending for the next poll or the close."""
        while self._pending:
            message, data = self._pending[0]

            def write(message: str = message, data: dict[str, Any] = data) -> bool:
                with self.ctx.sessions() as session:
                    if not hold_attempt(session, self.ctx.job_id, self.ctx.attempt):
                        return False
                    add_event(session, self.ctx.job_id, "warning", message, level="warning", data=data)
                    session.commit()
                    return True

            try:
                self._db(write, f"writing a tracker warning of job {self.ctx.job_id}")
            except Exception as exc:
                log.warning("job %s: tracker warning not written yet: %s", self.ctx.job_id, exc)
                return
            self._pending.pop(0)
