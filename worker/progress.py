"""Rate-limited progress reporting: buffer per-step metrics and write them, with job progress, at most ~1/s.

The trainer calls `on_metrics` every step; writing a row per step would make the database the bottleneck
of a fast loop, so rows are batched and flushed on a timer. Evaluation metrics are flushed immediately.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.orm import Session, sessionmaker

from service.db.models import Job, JobMetric, utcnow

log = logging.getLogger(__name__)


def _jsonable(value: Any) -> Any:
    # Metrics arrive as python floats, ints or 0-d tensors; JSON has no NaN/inf, so store those as null.
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class ProgressWriter:
    """Collects metrics from the training loop and persists them in batches.

    `on_metrics(m)` is the trainer's callback (a dict with `step`, `total_steps`, `eta_s`, ...);
    `set_stage(name)` records the stage shown in the job's progress. Both are cheap between flushes.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        job_id: str,
        *,
        attempt: int,
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.sessions = sessions
        self.job_id = job_id
        self.attempt = attempt
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.progress: dict[str, Any] = {"stage": "starting", "step": 0, "total_steps": None, "eta_s": None}
        self._rows: list[dict[str, Any]] = []
        self._dirty = False
        self._last_flush = clock()
        self.flushes = 0
        self.rows_written = 0

    def set_stage(self, stage: str) -> None:
        self.progress["stage"] = stage
        self._dirty = True
        self.flush()

    def on_metrics(self, metrics: dict[str, Any]) -> None:
        values = {k: _jsonable(v) for k, v in metrics.items()}
        step = int(values.get("step") or 0)
        values["attempt"] = self.attempt
        self._rows.append({"job_id": self.job_id, "step": step, "values": values, "created_at": utcnow()})
        self.progress["step"] = max(step, int(self.progress.get("step") or 0))
        for key in ("total_steps", "eta_s", "epoch"):
            if values.get(key) is not None:
                self.progress[key] = values[key]
        self._dirty = True
        is_eval = any(k.startswith("eval/") for k in values)
        if is_eval or self.clock() - self._last_flush >= self.min_interval_s:
            self.flush()

    def flush(self) -> None:
        """Write buffered rows and the current progress in one transaction."""
        if not self._dirty and not self._rows:
            return
        rows, self._rows = self._rows, []
        with self.sessions() as session:
            if rows:
                session.execute(insert(JobMetric), rows)
            session.execute(
                update(Job)
                .where(Job.id == self.job_id)
                .values(progress=dict(self.progress), updated_at=utcnow())
                .execution_options(synchronize_session=False)
            )
            session.commit()
        self._dirty = False
        self._last_flush = self.clock()
        self.flushes += 1
        self.rows_written += len(rows)
