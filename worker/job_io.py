"""What a running job reports, shared by the single-process runner and the torchrun ranks.

The trainer's stages, its result (`Outcome`), its events as job_events rows, the `{code, message}` of a
failure, the one conversion of metrics to JSON, and the one logging format of worker processes.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from peagle_core.errors import PeagleError
from service.crud.events import add_event
from service.redact import redact_paths

# The trainer's `on_event` kinds that are stage transitions (anything else is a log line).
STAGES = ("regenerate", "prepare", "hidden_states", "train", "eval", "export")

OnEvent = Callable[[str, str, dict[str, Any] | None], None]


def setup_logging() -> None:
    """INFO and above to stderr, one line each: every worker process (pool, horse, rank) logs this way."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def json_safe(value: Any) -> Any:
    """`value` as plain JSON data: tensors and NumPy values become numbers or lists, NaN and infinities
    become null (JSON has neither, and Postgres rejects them), anything else unknown becomes its str."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist"):  # torch tensors and NumPy arrays or scalars, 0-d included
        return json_safe(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


@dataclass
class Outcome:
    """What the training stage returned: a TrainResult, or the same fields from the torchrun ranks."""

    status: str
    step: int
    export_dir: str | None
    checkpoint_dir: str | None
    metrics: dict[str, Any]

    @classmethod
    def from_train_result(cls, result: Any) -> Outcome:
        """From `peagle_core.train.TrainResult`; paths become strings and metrics JSON data."""
        return cls(
            status=result.status,
            step=int(result.step),
            export_dir=str(result.export_dir) if result.export_dir else None,
            checkpoint_dir=str(result.checkpoint_dir) if result.checkpoint_dir else None,
            metrics=json_safe(dict(result.metrics or {})),
        )


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
    type_: str,
    message: str,
    data: dict[str, Any] | None = None,
    *,
    level: str = "info",
) -> None:
    """Append one event to the job's log in its own transaction."""
    with sessions() as session:
        add_event(session, job_id, type_, message, level=level, data=data)
        session.commit()


def event_recorder(
    sessions: sessionmaker[Session], job_id: str, *, on_stage: Callable[[str], None] | None = None
) -> OnEvent:
    """The trainer's `on_event` callback for `job_id`.

    A stage transition becomes `type="stage"` with `data.stage` (and is passed to `on_stage`, e.g. the
    progress writer); any other kind becomes `type="log"` with `data.kind` (e.g. "epoch", whose data
    carries the hidden-state counters).
    """

    def on_event(kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        data = dict(data or {})
        level = data.pop("level", "info")  # the trainer flags warnings in the event's data
        if kind in STAGES:
            if on_stage is not None:
                on_stage(kind)
            write_event(sessions, job_id, "stage", message, {"stage": kind, **data}, level=level)
        else:
            write_event(sessions, job_id, "log", message, {"kind": kind, **data}, level=level)

    return on_event
