"""Data-parallel training under torchrun: two CPU ranks over gloo end with identical, finite weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.core.helpers import make_spec

REPO = Path(__file__).resolve().parents[3]

_RANK_SCRIPT = """
import json, os, sys
from safetensors.torch import save_file
from peagle_core.spec import load_spec
from peagle_core.training.loop import train

rank = int(os.environ["RANK"])
losses = []
result = train(load_spec(sys.argv[1]), sys.argv[2], dataset_dir=sys.argv[3],
               on_metrics=lambda m: "loss" in m and losses.append(m["loss"]))
state = {k: v.detach().contiguous() for k, v in result.model.state_dict().items()}
save_file(state, os.path.join(sys.argv[2], f"rank{rank}.safetensors"))
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump({"status": result.status, "step": result.step, "losses": losses,
               "export": str(result.export_dir) if result.export_dir else None}, f)
"""


def test_two_gloo_ranks_train_identical_weights(
    toy_verifier_dir: Path, toy_dataset_path: Path, prepared_dataset: Path, tmp_path: Path
) -> None:
    spec = make_spec(toy_verifier_dir, toy_dataset_path, max_steps=3, checkpoint_every_steps=2)
    spec.evaluation.prompts = 1
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(spec.model_dump_json())
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(spec_file), str(out), str(prepared_dataset)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["step"] for r in reports] == [3, 3]
    assert all(r["status"] == "completed" for r in reports)
    losses = reports[0]["losses"]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert reports[1]["losses"] == []  # only rank 0 reports
    assert reports[0]["export"] and reports[1]["export"] is None

    w0, w1 = load_file(str(out / "rank0.safetensors")), load_file(str(out / "rank1.safetensors"))
    assert w0.keys() == w1.keys()
    for name in w0:
        assert torch.equal(w0[name], w1[name]), name
    ckpt = load_file(str(out / "checkpoints" / "step_00000003" / "model.safetensors"))
    assert all(torch.equal(ckpt[n], w0[n]) for n in ckpt)
