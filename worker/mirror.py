"""Training checkpoints mirrored to the artifact store, so a job resumes on any machine.

The trainer writes `checkpoints/step_N/` and then `checkpoints/latest` under the attempt's local scratch
directory. A background thread notices each new `latest`, publishes that directory to
`jobs/<id>/checkpoints/a<attempt>/step_N` (temp key, sha256 read-back, rename) and records it on the job
row as the resume point, a write fenced by the attempt number; then it deletes the previous one. A worker
with an empty scratch calls `restore()` before training, and the trainer resumes from that checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from peagle_core.io import atomic_dir, atomic_write_bytes
from service.artifacts import ArtifactStore
from service.crud.jobs import set_resume_point
from service.db.retry import retry_transient
from worker.attempt import AttemptContext

log = logging.getLogger(__name__)


def local_latest(work_dir: Path) -> str | None:
    """The name `work_dir/checkpoints/latest` points at (e.g. `step_00000040`), or None."""
    pointer = work_dir / "checkpoints" / "latest"
    with contextlib.suppress(FileNotFoundError):
        return pointer.read_text().strip() or None
    return None


def step_of(name: str) -> int:
    return int(name.rsplit("_", 1)[-1])


def restore(store: ArtifactStore, uri: str | None, work_dir: Path) -> int | None:
    """Bring the mirrored checkpoint `uri` into `work_dir/checkpoints` and point `latest` at it, unless the
    scratch already holds it (or a newer one). Returns the step training will resume from, or None."""
    if uri is None:
        return None
    name = posixpath.basename(uri)
    here = local_latest(work_dir)
    if here is not None and step_of(here) >= step_of(name):
        return step_of(here)
    ckpts = work_dir / "checkpoints"
    target = ckpts / name
    if target.exists():
        shutil.rmtree(target)
    with atomic_dir(target) as tmp:
        store.fetch_dir(uri, tmp)
    atomic_write_bytes(ckpts / "latest", (name + "\n").encode())
    return step_of(name)


class CheckpointMirror:
    """Publishes each new training checkpoint of one attempt to the store, from a background thread.

    `close()` mirrors whatever is newest once more (the checkpoint a stop or the end of training just
    wrote) and stops the thread; call it before the job's final status is written. `lost` is set when the
    job turned out to belong to a newer attempt: nothing of this attempt is recorded any more.
    """

    def __init__(
        self,
        store: ArtifactStore,
        ctx: AttemptContext,
        work_dir: Path,
        *,
        current_uri: str | None = None,
        poll_s: float = 1.0,
        on_mirrored: Callable[[int], None] | None = None,
    ):
        self.store = store
        self.ctx = ctx
        self.work_dir = work_dir
        self.poll_s = poll_s
        self.current_uri = current_uri  # the resume point recorded on the row
        self.mirrored = 0
        self.on_mirrored = on_mirrored  # called with the bytes of each checkpoint recorded (storage ledger)
        self.lost = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"mirror-{ctx.job_id}", daemon=True)

    def start(self) -> CheckpointMirror:
        self._thread.start()
        return self

    def close(self, tolerance_s: float = 0.0) -> None:
        """Stop the thread and mirror the newest checkpoint, retrying through a database outage for up to
        `tolerance_s`; a failure is logged (the previous resume point stays valid)."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            retry_transient(
                self.sync, tolerance_s=tolerance_s, what=f"recording a checkpoint of {self.ctx.job_id}"
            )
        except Exception as exc:
            log.error("job %s: the newest training checkpoint was not mirrored: %s", self.ctx.job_id, exc)

    def sync(self) -> None:
        """Mirror the newest local checkpoint if it is not the recorded resume point yet."""
        with self._lock:
            name = local_latest(self.work_dir)
            if name is None or self.lost.is_set():
                return
            if self.current_uri is not None and posixpath.basename(self.current_uri) == name:
                return  # already recorded (by this attempt, or the one it resumed from)
            key = f"jobs/{self.ctx.job_id}/checkpoints/a{self.ctx.attempt}/{name}"
            files = self.store.publish_dir(self.work_dir / "checkpoints" / name, key)
            with self.ctx.sessions() as session:
                ours = set_resume_point(session, self.ctx.job_id, self.ctx.attempt, key, step_of(name))
                session.commit()
            if not ours:
                self.lost.set()
                self.store.delete(key)
                log.warning(
                    "job %s: attempt %d no longer holds the job; mirror dropped",
                    self.ctx.job_id,
                    self.ctx.attempt,
                )
                return
            previous, self.current_uri = self.current_uri, key
            self.mirrored += 1
            if self.on_mirrored is not None:
                self.on_mirrored(sum(f["size"] for f in files))
            if previous is not None:
                self.store.delete(previous)

    def _run(self) -> None:
        while not self._done.wait(self.poll_s):
            try:
                self.sync()
            except Exception as exc:
                # A store or database blip, or the trainer pruned the directory mid-copy: the next poll
                # mirrors whatever is newest then.
                log.warning("job %s: mirroring a training checkpoint failed: %s", self.ctx.job_id, exc)
