"""Progress reporting off the training loop: the loop enqueues metrics, a writer thread persists them ~1/s.

A database write costs tens of milliseconds, so the training thread never does one: `on_metrics` and
`set_stage` only put an item on a bounded queue. The writer thread wakes every `min_interval_s` and writes
what accumulated (metric rows and the job's progress) in one transaction; evaluation metrics, stage
changes and `flush()` wake it at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from service.crud.events import add_event
from service.crud.jobs import set_progress
from service.crud.metrics import add_metrics
from service.db.jsondata import json_safe
from service.db.models import utcnow
from service.db.retry import retry_transient
from worker.attempt import AttemptContext

log = logging.getLogger(__name__)

# Far more than the items produced between two writes; when the database stalls for that long the
# training thread waits (back-pressure) rather than dropping rows.
MAX_PENDING = 10_000


class _Flush:
    """A request to write everything queued before it; `done` is set once written (or failed)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


_STOP = object()  # queued by close(): write what is left, then end the thread


class ProgressWriter:
    """Persists the trainer's per-step metrics and the job's progress from a background thread.

    `on_metrics(m)` is the trainer's callback (a dict with `step`, `total_steps`, `eta_s`, ...) and
    `set_stage(name)` records the stage shown in the job's progress; both only enqueue. `flush()` blocks
    until everything enqueued so far is written; `close()` flushes and stops the thread. Use `start()`
    (or `with`) before reporting.
    """

    def __init__(
        self,
        ctx: AttemptContext,
        *,
        min_interval_s: float = 1.0,
        max_pending: int = MAX_PENDING,
    ):
        if min_interval_s <= 0:
            raise ValueError("min_interval_s must be positive")
        self.ctx = ctx
        self.min_interval_s = min_interval_s
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"progress-{ctx.job_id}", daemon=True)
        # Owned by the writer thread after start().
        self.progress: dict[str, Any] = {"stage": "starting", "step": 0, "total_steps": None, "eta_s": None}
        self._rows: list[dict[str, Any]] = []
        self._events: list[tuple[Any, ...]] = []
        self._dirty = False
        self.flushes = 0
        self.rows_written = 0
        self.lost = threading.Event()  # the job moved to a newer attempt: nothing more is written

    # -- training-thread side (cheap) ---------------------------------------------------------------

    def start(self) -> ProgressWriter:
        self._thread.start()
        return self

    def __enter__(self) -> ProgressWriter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_metrics(self, metrics: dict[str, Any]) -> None:
        # Metrics arrive as floats, ints or 0-d tensors, and a diverged loss is NaN: store JSON data.
        values = json_safe(metrics)
        values["attempt"] = self.ctx.attempt
        self._put(("metrics", values, utcnow()), urgent=any(k.startswith("eval/") for k in values))

    def set_stage(self, stage: str) -> None:
        self._put(("stage", stage), urgent=True)

    def set_fields(self, **fields: Any) -> None:
        """Merge `fields` into the job's progress (a stage's own counters, e.g. `regenerate`, `eta_s`)."""
        self._put(("fields", json_safe(fields)), urgent=False)

    def add_event(
        self, type_: str, message: str, data: dict[str, Any] | None = None, *, level: str = "info"
    ) -> None:
        """Queue one job event (the trainer's stage and log lines): written with the next batch, so a
        database outage delays it instead of stalling training."""
        self._put(("event", type_, message, data, utcnow(), level), urgent=True)

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything reported so far is written; re-raises the write's error."""
        if not self._thread.is_alive():
            self._drain()
            self._write()  # not started, or closed: write in the caller's thread
            return
        request = _Flush()
        self._put(request, urgent=True)
        if not request.done.wait(timeout):
            raise TimeoutError(f"progress of {self.ctx.job_id} was not written within {timeout} s")
        if request.error is not None:
            raise request.error

    def close(self, tolerance_s: float = 0.0) -> None:
        """Write what is left and stop the thread; during a database outage keep retrying for up to
        `tolerance_s`. A failed final write is logged, not raised: it must not mask the job's own outcome."""
        if not self._thread.is_alive():
            return
        self._put(_STOP, urgent=True)
        self._thread.join()
        if self._rows or self._events or self._dirty:
            try:
                retry_transient(
                    self._write, tolerance_s=tolerance_s, what=f"writing progress of {self.ctx.job_id}"
                )
            except Exception as exc:
                log.error("progress of job %s could not be written: %s", self.ctx.job_id, exc)

    def _put(self, item: Any, *, urgent: bool) -> None:
        # Routine items do not wake the writer (it drains on its timer); only urgent ones do.
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._wake.set()
            self._queue.put(item)
        if urgent:
            self._wake.set()

    # -- writer thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self.min_interval_s)
            self._wake.clear()
            stop, requests = self._drain()
            error = self._safe_write()
            for request in requests:
                request.error = error
                request.done.set()
            if stop:
                return

    def _drain(self) -> tuple[bool, list[_Flush]]:
        """Fold every queued item into the pending rows and progress; returns (stop seen, flush requests)."""
        stop, requests = False, []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return stop, requests
            if item is _STOP:
                stop = True
            elif isinstance(item, _Flush):
                requests.append(item)
            elif item[0] == "stage":
                self.progress["stage"] = item[1]
                self._dirty = True
            elif item[0] == "fields":
                self.progress.update(item[1])
                self._dirty = True
            elif item[0] == "event":
                self._events.append(item[1:])
            else:
                self._add_row(*item[1:])

    def _add_row(self, values: dict[str, Any], created_at: Any) -> None:
        step = int(values.get("step") or 0)
        self._rows.append({"step": step, "values": values, "created_at": created_at})
        self.progress["step"] = max(step, int(self.progress.get("step") or 0))
        for key in ("total_steps", "eta_s", "epoch"):
            if values.get(key) is not None:
                self.progress[key] = values[key]
        for key in ("loss", "tokens_per_s"):  # for live progress bars; a non-finite loss shows as null
            if key in values:
                self.progress[key] = values[key]
        for key, value in values.items():
            # The best acceptance length so far, for job lists (the metric rows hold the whole series).
            if key.startswith("eval/acceptance_length@") and isinstance(value, int | float):
                self.progress["acceptance_length"] = max(value, self.progress.get("acceptance_length") or 0)
        self._dirty = True

    def _safe_write(self) -> BaseException | None:
        try:
            self._write()
        except Exception as exc:  # keep the rows; the next write retries them
            log.warning("writing progress of job %s failed: %s", self.ctx.job_id, exc)
            return exc
        return None

    def _write(self) -> None:
        """Buffered rows and the current progress in one transaction."""
        if not self._dirty and not self._rows and not self._events:
            return
        rows, events = list(self._rows), list(self._events)
        with self.ctx.sessions() as session:
            # The fenced progress update first: it locks the job row, so no newer attempt can start
            # between it and the metric rows added in the same transaction.
            if not set_progress(session, self.ctx.job_id, dict(self.progress), attempt=self.ctx.attempt):
                session.rollback()
                if not self.lost.is_set():
                    log.warning(
                        "job %s is no longer attempt %d's: progress dropped",
                        self.ctx.job_id,
                        self.ctx.attempt,
                    )
                self.lost.set()
                self._rows.clear()
                self._events.clear()
                self._dirty = False
                return
            for row in rows:
                add_metrics(
                    session, self.ctx.job_id, row["step"], row["values"], created_at=row["created_at"]
                )
            for type_, message, data, created_at, level in events:
                add_event(
                    session, self.ctx.job_id, type_, message, data=data, created_at=created_at, level=level
                )
            session.commit()
        del self._rows[: len(rows)]
        del self._events[: len(events)]
        self._dirty = False
        self.flushes += 1
        self.rows_written += len(rows)
