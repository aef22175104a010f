"""A work horse ends the processes a job left running (RQ's os._exit would leave them behind)."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

from tests.worker.conftest import REPO

# In a process of its own: end_children ends every child of the process it runs in.
SCRIPT = """
import json, subprocess, sys
from worker.leftovers import end_children
quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
stubborn = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE)
stubborn.stdout.readline()
print(json.dumps({"started": [quiet.pid, stubborn.pid], "ended": end_children(grace_s=1.0), "after": end_children()}))
"""


def test_children_left_running_are_ended_stubborn_ones_killed() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(result["ended"]) == sorted(result["started"]) and result["after"] == []
    assert not any(psutil.pid_exists(pid) for pid in result["started"])
    assert "stopping 2 process(es) the job left running" in out.stderr


# A spawned child starts multiprocessing's resource tracker, which ignores SIGTERM; one spawned child is left
# running (it holds the tracker's pipe too), one has exited.
TRACKER_SCRIPT = """
import json, multiprocessing as mp, time
from multiprocessing import resource_tracker
from worker.leftovers import end_children

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    done = ctx.Process(target=time.sleep, args=(0,))
    done.start()
    done.join()
    leaked = ctx.Process(target=time.sleep, args=(600,))
    leaked.start()
    tracker = resource_tracker._resource_tracker._pid
    print(json.dumps({"tracker": tracker, "leaked": leaked.pid, "ended": end_children(grace_s=60)}))
"""


def test_the_resource_tracker_is_closed_not_reported_or_killed() -> None:
    out = subprocess.run(
        [sys.executable, "-c", TRACKER_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tracker"] is not None and result["ended"] == [result["leaked"]]
    assert not psutil.pid_exists(result["tracker"]) and not psutil.pid_exists(result["leaked"])
    assert "stopping 1 process(es) the job left running" in out.stderr
    assert "resource tracker" not in out.stderr  # it exited on its own once its pipe closed
