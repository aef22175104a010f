"""What a job leaves behind in its work horse: child processes still running when the job returns are
ended with it (RQ ends the horse with os._exit, which takes the horse's threads but not its children)."""

from __future__ import annotations

import contextlib
import logging
import os

import psutil

log = logging.getLogger(__name__)


def end_children(grace_s: float = 10.0) -> list[int]:
    """Terminate every process this one started (at any depth) that is still running, kill those still
    there after `grace_s`, and return their pids; each job's own code stops what it starts, so any pid
    here is a leak, logged as one. multiprocessing's resource tracker is not a leak: it is closed last."""
    tracker = _resource_tracker_pid()
    children = [c for c in psutil.Process().children(recursive=True) if c.pid != tracker]
    if children:
        log.warning("stopping %d process(es) the job left running: %s", len(children),
                    ", ".join(f"{c.pid} ({_name(c)})" for c in children))  # fmt: skip
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.terminate()
        _, alive = psutil.wait_procs(children, timeout=grace_s)
        for child in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(alive, timeout=5)
    _stop_resource_tracker(tracker, grace_s)
    return [c.pid for c in children]


def _resource_tracker_pid() -> int | None:
    """The pid of the resource tracker this process started (a spawned child starts it), if running."""
    from multiprocessing import resource_tracker

    pid = resource_tracker._resource_tracker._pid  # no public accessor
    if pid is None or pid not in {c.pid for c in psutil.Process().children()}:
        return None  # none, or a parent's tracker this process inherited a handle to: not ours to stop
    return pid


def _stop_resource_tracker(pid: int | None, grace_s: float) -> None:
    """Close this process's pipe to its resource tracker, which then unlinks whatever the job's processes
    leaked and exits. It ignores SIGTERM by design, so terminating it would only wait out the grace before
    a SIGKILL that skips that clean-up (10 s at the end of every job that started a vLLM child). Run after
    the other children are gone: each spawned child holds the pipe open too."""
    if pid is None:
        return
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    with tracker._lock:
        os.close(tracker._fd)
        tracker._fd = tracker._pid = None
    with contextlib.suppress(psutil.NoSuchProcess):
        proc = psutil.Process(pid)
        try:
            proc.wait(grace_s)
        except psutil.TimeoutExpired:  # a process outside this tree still holds the pipe
            log.warning("multiprocessing's resource tracker (pid %d) did not exit; killing it", pid)
            proc.kill()
            proc.wait(5)


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"
