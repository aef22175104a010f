"""Ranks always exit: a 4-rank gloo launch that ends the way a job's rank does (DDP freed before the process
group, then `exit_now`) exits within a bound, never left waiting in teardown. One launch: `exit_now` leaves
no destructor to race, and each launch costs five torch imports on CI's two cores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXIT_BOUND_S = 240  # a liveness bound, far above a healthy launch; a teardown hang never ends

RANK = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from peagle_core.training import distributed as dist_utils
from peagle_core.processes import exit_now

torch.set_num_threads(1)
info = dist_utils.init_distributed()
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)))
optimizer = torch.optim.AdamW(model.parameters())
for step in range(20):
    model(torch.randn(32, 256)).square().mean().backward()  # gloo all-reduces on its own threads
    optimizer.step()
    optimizer.zero_grad()
dist_utils.barrier(info)
del model, optimizer
dist_utils.shutdown()
open(f"done-{info.rank}", "w").write("ok")  # a file each: the ranks' stdout lines interleave
exit_now(0)
"""


def test_four_gloo_ranks_exit_after_their_work(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(script)]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"ranks still alive after {EXIT_BOUND_S} s\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    assert sorted(p.name for p in tmp_path.glob("done-*")) == [f"done-{r}" for r in range(4)], out[-3000:]
