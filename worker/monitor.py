"""The stop check and heartbeat of a running job: a background thread polls the job row.

`should_stop()` is called by the trainer every step, so it only reads a flag; the thread behind it reads
the job's status at most every `poll_s` and, every `heartbeat_s`, stamps `heartbeat_at` (database time)
and refreshes the job's liveness key in Redis: how the reconciler tells a live job from one whose worker
died. Every check and stamp is for the attempt this worker claimed (its fencing token): once the job is
claimed again by someone else, this worker's job is `lost`. A stage that runs past `stage_timeout_s` asks
the job to stop too (`timed_out_stage`). A member machine of a multi-node job
(`slot`) stamps its own `job_nodes` row instead: the job's heartbeat stays its leader's.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from redis import Redis

from service.crud.gang import node_heartbeat
from service.crud.jobs import ACTIVE_STATUSES, heartbeat, holder
from service.queue import mark_alive
from worker.attempt import AttemptContext

log = logging.getLogger(__name__)


# The signal a forking worker sends its work horse to ask for a checkpoint-and-requeue.
PREEMPT_SIGNAL = signal.SIGUSR1


def stale_after_s(heartbeat_s: float) -> float:
    """How old a heartbeat may get before its worker is presumed dead (a few missed beats, plus slack
    for a machine so busy that the monitor thread runs late); also the TTL of the Redis liveness key."""
    return 3 * heartbeat_s + 5.0


class JobMonitor:
    """Watches one claimed attempt of one job. `cancel_requested`: the user asked to stop; `lost`: the job
    is no longer this attempt's (the reconciler requeued or finished it), so this worker must stop without
    writing results (its writes are fenced anyway)."""

    def __init__(
        self,
        ctx: AttemptContext,
        *,
        poll_s: float = 0.5,
        heartbeat_s: float = 10.0,
        redis: Redis | None = None,
        slot: int | None = None,
        stage_timeout_s: float | None = None,
    ):
        self.ctx = ctx
        self.slot = slot
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self.redis = redis
        self.cancel_requested = threading.Event()
        self.lost = threading.Event()
        self.preempted = threading.Event()
        # The stage that ran past `stage_timeout_s` (set once): the job stops there and fails.
        self.stage_timeout_s = stage_timeout_s
        self.timed_out_stage: str | None = None
        self._stage = ("starting", time.monotonic())
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"monitor-{ctx.job_id}", daemon=True)
        # Its own thread: a database call stuck in its connect timeout must not delay the Redis beat.
        self._alive_thread = threading.Thread(target=self._run_alive, name=f"alive-{ctx.job_id}", daemon=True)

    def should_stop(self) -> bool:
        return (
            self.cancel_requested.is_set()
            or self.lost.is_set()
            or self.preempted.is_set()
            or self.timed_out_stage is not None
        )

    def enter_stage(self, stage: str) -> None:
        """`stage` starts now: its time limit counts from here."""
        self._stage = (stage, time.monotonic())

    def check_stage_time(self) -> None:
        """Mark the current stage timed out once it has run longer than `stage_timeout_s`."""
        stage, since = self._stage
        limit = self.stage_timeout_s
        if limit is not None and self.timed_out_stage is None and time.monotonic() - since > limit:
            log.warning(
                "job %s: the %s stage ran past its %gs limit; stopping it", self.ctx.job_id, stage, limit
            )
            self.timed_out_stage = stage
            # Ranks under torchrun and a gang's members stop on `preempted`; the runner tells a timeout apart.
            self.preempted.set()

    def should_stop_now(self) -> bool:
        """`should_stop`, after reading the job row here and now: for stages whose units of work are long
        (a batch of generations), so no unit starts after a cancel that is already committed. A failed
        read falls back to the flags; the poller retries."""
        try:
            self.check_now()
        except Exception as exc:
            log.warning("job monitor for %s: database check failed: %s", self.ctx.job_id, exc)
        return self.should_stop()

    def stop_on_signal(self, signum: int = PREEMPT_SIGNAL) -> None:
        """Treat `signum` as "the worker is shutting down": stop at the next step with a checkpoint.

        The forking worker sends it to its work horse on a warm shutdown (Ctrl-C, SIGTERM from a
        supervisor or an orchestrator draining the node). Must be called from the main thread.
        """
        signal.signal(signum, lambda *_: self.preempted.set())

    def start(self) -> JobMonitor:
        self._thread.start()
        if self.redis is not None:
            self._alive_thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)
        if self._alive_thread.is_alive():
            self._alive_thread.join(timeout=10)

    def check_now(self) -> None:
        """Read the job row once (also used before publishing, so a late cancel is never missed)."""
        with self.ctx.sessions() as session:
            row = holder(session, self.ctx.job_id)
        if row is None or row.attempt != self.ctx.attempt or row.status not in ACTIVE_STATUSES:
            self.lost.set()
        elif row.status == "cancelling":
            self.cancel_requested.set()

    def beat(self) -> None:
        """Stamp the row's heartbeat (database time) if this attempt still holds the job."""
        with self.ctx.sessions() as session:
            if self.slot is None:
                ours = heartbeat(session, self.ctx.job_id, self.ctx.attempt)
            else:
                ours = node_heartbeat(session, self.ctx.job_id, self.ctx.attempt, self.slot)
            session.commit()
        if not ours:
            self.lost.set()

    def _run(self) -> None:
        since_beat = self.heartbeat_s  # beat at once: the claim's stamp may already be a few seconds old
        while not self._done.wait(self.poll_s):
            since_beat += self.poll_s
            self.check_stage_time()
            try:
                if since_beat >= self.heartbeat_s:
                    since_beat = 0.0
                    self.beat()
                self.check_now()
            except Exception as exc:
                # A database blip must not kill training; the next poll retries.
                log.warning("job monitor for %s: database check failed: %s", self.ctx.job_id, exc)

    def _run_alive(self) -> None:
        assert self.redis is not None
        ttl = stale_after_s(self.heartbeat_s)
        while not self.lost.is_set():
            try:
                mark_alive(self.redis, self.ctx.job_id, self.ctx.attempt, ttl)
            except Exception as exc:
                log.warning("job %s: liveness key not refreshed: %s", self.ctx.job_id, exc)
            if self._done.wait(self.heartbeat_s):
                return
