"""Stopping a child process: ask it to stop (SIGTERM), give it `grace_s` seconds, then kill it."""

from __future__ import annotations

import multiprocessing.process
import subprocess


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
