"""What a running job reports, shared by the single-process runner and the torchrun ranks.

The job's spec as submitted, the pipeline's events and metrics through a `JobReporter` (events as job_events rows), the `{code, message}` of a failure,
and the one logging format of worker processes (metrics become JSON in `service.db.jsondata`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from peagle_core.errors import PeagleError
from peagle_core.events import Event
from peagle_core.keys import STAGES
from peagle_core.spec import JobSpec
from service.crud.events import add_event
from service.crud.jobs import hold
from service.redact import redact_paths
from worker.progress import ProgressWriter


def setup_logging() -> None:
    """INFO and above to stderr, one line each: every worker process (pool, horse, rank) logs this way."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def submitted_spec(job: Any) -> JobSpec:
    """The job's spec as its user wrote it, validated once in this process: fields left unset stay unset
    (`model.init_from` keeps the checkpoint's architecture for them). Rows from before the column existed
    hold only the resolved spec."""
    stored = job.spec_submitted if job.spec_submitted is not None else job.spec
    return JobSpec.model_validate(stored)


def error_for(exc: BaseException, *, stage: str) -> dict[str, Any]:
    """The `{code, message}` stored on a failed job: actionable text, never a traceback."""
    if isinstance(exc, PeagleError):
        return {"code": exc.code, "message": redact_paths(exc.message), "param": exc.param}
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


def write_event(
    sessions: sessionmaker[Session],
    job_id: str,
    attempt: int,
    type_: str,
    message: str,
    data: dict[str, Any] | None = None,
    *,
    level: str = "info",
) -> bool:
    """Append one event to the job's log in its own transaction, if `attempt` still holds the job
    (a stale worker's events are dropped). Returns whether it was written."""
    with sessions() as session:
        if not hold(session, job_id, attempt):
            return False
        add_event(session, job_id, type_, message, level=level, data=data)
        session.commit()
    return True


class JobReporter:
    """The pipeline's and the trainer's `Reporter` in a worker: everything goes to the progress writer's
    queue (`worker.progress.ProgressWriter`), so a slow or absent database never stalls training.

    A stage transition becomes a `type="stage"` row with `data.stage` (and is passed to `on_stage`, e.g. the
    progress writer's `set_stage`); any other kind becomes `type="log"` with `data.kind` (e.g. "epoch", whose
    data carries the hidden-state counters).
    """

    def __init__(self, progress: ProgressWriter, *, on_stage: Callable[[str], None] | None = None):
        self.progress = progress
        self.on_stage = on_stage

    def on_event(self, event: Event) -> None:
        if event.kind in STAGES:
            if self.on_stage is not None:
                self.on_stage(event.kind)
            type_, data = "stage", {"stage": event.kind, **event.data}
        else:
            type_, data = "log", {"kind": event.kind, **event.data}
        self.progress.add_event(type_, event.message, data, level=event.level)

    def on_metrics(self, metrics: dict[str, Any]) -> None:
        self.progress.on_metrics(metrics)
