"""stop_process: SIGTERM, a grace period, then SIGKILL, for subprocess and multiprocessing children."""

from __future__ import annotations

import multiprocessing as mp
import signal
import subprocess
import sys
import time

from peagle_core.processes import stop_process


def test_a_child_that_stops_on_sigterm_is_only_terminated() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stop_process(proc, grace_s=30) == -signal.SIGTERM


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period() -> None:
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    proc.stdout.readline()  # the handler is in place
    start = time.monotonic()
    assert stop_process(proc, grace_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - start < 10


def test_an_exited_child_is_reaped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert stop_process(proc, grace_s=1) == 0


def test_a_multiprocessing_child_is_terminated_and_joined() -> None:
    proc = mp.get_context("spawn").Process(target=time.sleep, args=(60,))
    proc.start()
    assert stop_process(proc, grace_s=30) == -signal.SIGTERM
    assert not proc.is_alive()
