"""What a job leaves behind in its work horse: child processes still running when the job returns are
ended with it (RQ ends the horse with os._exit, which takes the horse's threads but not its children)."""

from __future__ import annotations

import contextlib
import logging

import psutil

log = logging.getLogger(__name__)


def end_children(grace_s: float = 10.0) -> list[int]:
    """Terminate every process this one started (at any depth) that is still running, kill those still
    there after `grace_s`, and return their pids; each job's own code stops what it starts, so any pid
    here is a leak, logged as one."""
    children = psutil.Process().children(recursive=True)
    if not children:
        return []
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
    return [c.pid for c in children]


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"
