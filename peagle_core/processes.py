"""Ending processes: stopping a child (SIGTERM, `grace_s` seconds, then kill), and a finished process
leaving at once."""

from __future__ import annotations

import logging
import multiprocessing.process
import os
import subprocess
import sys
from typing import NoReturn


def stop_process(proc: subprocess.Popen | multiprocessing.process.BaseProcess, grace_s: float) -> int | None:
    """Terminate `proc`, wait up to `grace_s` seconds for it to exit, kill it if it has not; return its
    exit code. A process that has already exited is only reaped. Works for `subprocess.Popen` and for
    `multiprocessing` processes (which are joined instead of waited on)."""
    if isinstance(proc, subprocess.Popen):
        proc.terminate()  # a no-op once the process has exited
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=grace_s)
        if proc.is_alive():
            proc.kill()
    proc.join()
    return proc.exitcode


def exit_now(code: int) -> NoReturn:
    """End a process once its work and reports are done: flush, then `os._exit`, so that no destructor or
    teardown run at interpreter exit (torch.distributed's, vLLM's) can keep a finished process alive or
    cost it seconds."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
