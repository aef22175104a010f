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
