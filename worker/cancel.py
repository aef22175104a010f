"""The stop check and heartbeat of a running job: a background thread polls the job row.

`should_stop()` is called by the trainer every step, so it only reads a flag; the thread behind it reads
the job's status at most every `poll_s` and stamps `heartbeat_at` every `heartbeat_s`, which is how the
reconciler tells a live job from one whose worker died.
"""

from __future__ import annotations

import logging
import signal
import threading

from sqlalchemy.orm import Session, sessionmaker

from service.crud.jobs import ACTIVE_STATUSES, heartbeat, holder

log = logging.getLogger(__name__)


# The signal a forking worker sends its work horse to ask for a checkpoint-and-requeue.
PREEMPT_SIGNAL = signal.SIGUSR1


class JobMonitor:
    """Watches one claimed job. `cancel_requested`: the user asked to stop; `lost`: the job is no longer
    ours (the reconciler requeued or finished it), so this worker must stop without writing results."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        job_id: str,
        worker_name: str,
        *,
        poll_s: float = 0.5,
        heartbeat_s: float = 10.0,
    ):
        self.sessions = sessions
        self.job_id = job_id
        self.worker_name = worker_name
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self.cancel_requested = threading.Event()
        self.lost = threading.Event()
        self.preempted = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"monitor-{job_id}", daemon=True)

    def should_stop(self) -> bool:
        return self.cancel_requested.is_set() or self.lost.is_set() or self.preempted.is_set()

    def stop_on_signal(self, signum: int = PREEMPT_SIGNAL) -> None:
        """Treat `signum` as "the worker is shutting down": stop at the next step with a checkpoint.

        The forking worker sends it to its work horse on a warm shutdown (Ctrl-C, SIGTERM from a
        supervisor or an orchestrator draining the node). Must be called from the main thread.
        """
        signal.signal(signum, lambda *_: self.preempted.set())

    def start(self) -> JobMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def check_now(self) -> None:
        """Read the job row once (also used before publishing, so a late cancel is never missed)."""
        with self.sessions() as session:
            row = holder(session, self.job_id)
        if row is None or row.worker_name != self.worker_name or row.status not in ACTIVE_STATUSES:
            self.lost.set()
        elif row.status == "cancelling":
            self.cancel_requested.set()

    def beat(self) -> None:
        with self.sessions() as session:
            heartbeat(session, self.job_id, self.worker_name)
            session.commit()

    def _run(self) -> None:
        since_beat = 0.0
        while not self._done.wait(self.poll_s):
            try:
                self.check_now()
                since_beat += self.poll_s
                if since_beat >= self.heartbeat_s:
                    self.beat()
                    since_beat = 0.0
            except Exception:
                # A database blip must not kill training; the next poll retries.
                log.warning("job monitor for %s: database check failed", self.job_id, exc_info=True)
