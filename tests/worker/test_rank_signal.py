"""A torchrun rank takes the drain signal on one thread: the others (gloo's, the loader's) inherit it
blocked, so none of their calls is interrupted, and the signal never kills the rank."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.worker.conftest import REPO

_RANK = """
import signal, sys, threading
from worker.multigpu import listen_for_preemption
from worker.monitor import PREEMPT_SIGNAL
preempted = threading.Event()
listen_for_preemption(preempted)
blocked = []
t = threading.Thread(target=lambda: blocked.append(PREEMPT_SIGNAL in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
t.start(); t.join()
print("ready", blocked[0], flush=True)
sys.exit(0 if preempted.wait(60) else 3)
"""


def test_a_rank_takes_the_preempt_signal_on_its_own_thread() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _RANK],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().split() == ["ready", "True"]  # a thread started later has it blocked
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=60) == 0  # the event was set, and the rank is alive to act on it
