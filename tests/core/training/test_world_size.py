"""Resume at any world size: a run stopped on 2 ranks (FSDP) continues on 1 rank and on 3 (DDP) with every
remaining sample of the epoch trained exactly once, none twice, none skipped, and the losses and weights of
an uninterrupted 1-rank run; a checkpoint of the earlier format still resumes at its own world size.

Tolerance: the runs see the same rows, COD draws and learning rates in the same order, so they differ only
by where float32 sums are associated (each rank sums its rows, then the ranks' sums are added; FSDP also
reduce-scatters in pieces). One reassociation moves a sum by a few ulps (~1e-7 relative); measured here,
losses differ by <= 1.1e-7 relative and weights by <= 3e-8 absolute after 5 AdamW steps. We allow
rtol 1e-4 / atol 1e-5 on losses and weights: ~1000x that noise, and far below what a skipped or repeated
row does (a changed loss in the second significant digit). The 3-rank run also stands in for the plain
DDP test: its ranks end with identical weights, and rank 0 alone reports and exports.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peagle_core.errors import CheckpointError
from peagle_core.events import CallbackReporter
from peagle_core.spec import JobSpec
from peagle_core.training.loop import train
from peagle_core.training.resume import latest_checkpoint
from tests.core.helpers import final_weights, make_spec

REPO = Path(__file__).resolve().parents[3]
RTOL, ATOL = 1e-4, 1e-5
STOP_AFTER = 2  # the 2-rank run stops (and checkpoints) after this many steps

_RANK_SCRIPT = """
import json, os, sys
from safetensors.torch import save_file
from peagle_core.events import CallbackReporter
from peagle_core.spec import load_spec
from peagle_core.training.loop import train

spec_file, out, data, stop_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rank = int(os.environ["RANK"])
losses, consumed, evals = [], [], []
def on_metrics(m):
    if "loss" in m:
        losses.append(m["loss"])
    if "eval/acceptance_length@3" in m:
        evals.append([m["step"], m["eval/acceptance_length@3"]])
result = train(load_spec(spec_file), out, dataset_dir=data, reporter=CallbackReporter(metrics=on_metrics),
               should_stop=lambda: stop_after > 0 and len(losses) >= stop_after,
               on_consumed=lambda epoch, ids: consumed.extend(ids))
if result.status == "completed":  # (a stopped FSDP run's ranks hold shards)
    state = {k: v.detach().contiguous() for k, v in result.model.state_dict().items()}
    save_file(state, os.path.join(out, f"rank{rank}.safetensors"))
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"status": result.status, "step": result.step, "losses": losses, "consumed": consumed, "evals": evals,
               "export": str(result.export_dir) if result.export_dir else None}, f)
"""


def _torchrun(ranks: int, spec: JobSpec, out: Path, dataset: Path, stop_after: int, tmp: Path) -> list[dict]:
    """Train `spec` on `ranks` gloo ranks into `out`; each rank's report (losses on rank 0 only)."""
    spec_file, script = tmp / f"spec-{ranks}.json", tmp / "rank.py"
    spec_file.write_text(spec.model_dump_json())
    script.write_text(_RANK_SCRIPT)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           str(script), str(spec_file), str(out), str(dataset), str(stop_after)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def _in_process(spec: JobSpec, out: Path, dataset: Path, stop_after: int = 0) -> dict:
    losses: list[float] = []
    consumed: list[int] = []
    evals: list[list[float]] = []

    def on_metrics(m: dict) -> None:
        if "loss" in m:
            losses.append(m["loss"])
        if "eval/acceptance_length@3" in m:
            evals.append([m["step"], m["eval/acceptance_length@3"]])

    result = train(
        spec,
        out,
        dataset_dir=dataset,
        reporter=CallbackReporter(metrics=on_metrics),
        should_stop=lambda: stop_after > 0 and len(losses) >= stop_after,
        on_consumed=lambda epoch, ids: consumed.extend(ids),
    )
    return {
        "status": result.status,
        "step": result.step,
        "losses": losses,
        "consumed": consumed,
        "evals": evals,
    }


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=ATOL, msg=name)


def test_a_two_rank_fsdp_run_resumes_on_one_and_on_three_ranks(
    toy_verifier_dir: Path, toy_dataset_path: Path, prepared_dataset: Path, tmp_path: Path
) -> None:
    # 4 rows a step (grad_accum 2 x 2 GPUs) at any world size: 3 ranks take 2, 1 and 1 rows, with pads.
    spec = make_spec(
        toy_verifier_dir,
        toy_dataset_path,
        grad_accum=2,
        checkpoint_every_steps=1000,
        eval_every_steps=STOP_AFTER,
        # fp32: in bf16 a 1e-7 difference in the ranks' reduction order flips a bf16 rounding now and
        # then, and the runs drift apart by more than these tolerances; the invariance is the algorithm's.
        precision="fp32",
    )
    spec.resources.gpus = 2
    spec.evaluation.prompts = 1
    fsdp = spec.model_copy(deep=True)
    fsdp.training.sharding = "fsdp"

    reference = _in_process(spec, tmp_path / "ref", prepared_dataset)
    assert reference["status"] == "completed" and reference["step"] > STOP_AFTER + 1
    epoch = reference["consumed"]
    assert len(epoch) == len(set(epoch))  # the uninterrupted run sees each training sample once

    two = _torchrun(2, fsdp, tmp_path / "two", prepared_dataset, STOP_AFTER, tmp_path)
    assert [r["status"] for r in two] == ["stopped", "stopped"] and two[0]["step"] == STOP_AFTER
    # FSDP on 2 ranks follows DDP on 1: same loss curve.
    torch.testing.assert_close(two[0]["losses"], reference["losses"][:STOP_AFTER], rtol=RTOL, atol=ATOL)
    # Its evaluation gathered the sharded drafter onto rank 0 and decoded as the 1-rank run's did.
    assert two[0]["evals"] == reference["evals"][:1] and two[1]["evals"] == []
    before = two[0]["consumed"] + two[1]["consumed"]
    for name in ("one", "three"):
        shutil.copytree(tmp_path / "two" / "checkpoints", tmp_path / name / "checkpoints")

    one = _in_process(spec, tmp_path / "one", prepared_dataset)
    three = _torchrun(3, spec, tmp_path / "three", prepared_dataset, 0, tmp_path)

    for after in (one["consumed"], [i for r in three for i in r["consumed"]]):
        assert sorted(before + after) == sorted(epoch), "a sample was seen twice or skipped"
    for losses in (one["losses"], three[0]["losses"]):
        torch.testing.assert_close(losses, reference["losses"][STOP_AFTER:], rtol=RTOL, atol=ATOL)
    want = final_weights(tmp_path / "ref")
    _close(final_weights(tmp_path / "one"), want)
    _close(final_weights(tmp_path / "three"), want)

    # The 3-rank DDP run: every rank ends with the same weights, rank 0 alone reports and exports.
    assert all(r["status"] == "completed" for r in three)
    assert three[1]["losses"] == three[2]["losses"] == []
    assert three[0]["export"] and three[1]["export"] is None
    weights = [load_file(str(tmp_path / "three" / f"rank{r}.safetensors")) for r in range(3)]
    for other in weights[1:]:
        assert all(torch.equal(weights[0][n], other[n]) for n in weights[0])
    ckpt = load_file(str(latest_checkpoint(tmp_path / "three" / "checkpoints") / "model.safetensors"))
    assert all(torch.equal(ckpt[n], weights[0][n]) for n in ckpt)


def _to_earlier_format(ckpt: Path, spec: JobSpec, dataset: Path, verifier, ranks: int) -> None:
    """Rewrite a checkpoint in the pre-DCP layout (model.safetensors + state.pt + meta.json with a per-rank
    micro-batch index), as `ranks` ranks of the earlier trainer wrote it."""
    import math

    from peagle_core.data import PreparedDataset
    from peagle_core.training.builders import build_model, build_optimizer, count_steps
    from peagle_core.training.distributed import DistInfo
    from peagle_core.training.resume import restore_latest
    from peagle_core.training.schedule import build_scheduler

    tc, ds = spec.training, PreparedDataset.open(dataset)
    model = build_model(spec, verifier, ds, torch.device("cpu"))
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay)
    train_idx, _ = ds.split(spec.dataset.val_fraction, tc.seed)
    total = count_steps(spec, train_idx, list(ds.lengths))
    scheduler = build_scheduler(optimizer, warmup_steps=math.ceil(tc.warmup_ratio * total), total_steps=total,
                                min_lr_ratio=tc.min_lr_ratio)  # fmt: skip
    state = restore_latest(
        ckpt.parent, module=model, optimizer=optimizer, scheduler=scheduler, info=DistInfo()
    )
    for f in ckpt.iterdir():
        if f.name not in ("model.safetensors", "meta.json"):
            f.unlink()
    rng = {"torch": torch.get_rng_state(), "cod": torch.Generator().get_state()}
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": {"ranks": [rng] * ranks}}, ckpt / "state.pt")  # fmt: skip
    per_rank = state.position.bins_done // ranks
    position = {"step": state.position.step, "epoch": state.position.epoch, "batch_index": per_rank}
    (ckpt / "meta.json").write_text(json.dumps({"position": position, "metrics": {}}))


def test_a_checkpoint_of_the_earlier_format_resumes_at_its_own_world_size(
    toy_verifier_dir: Path, toy_dataset_path: Path, prepared_dataset: Path, toy_verifier, tmp_path: Path
) -> None:
    spec = make_spec(
        toy_verifier_dir, toy_dataset_path, max_steps=4, grad_accum=2, checkpoint_every_steps=1000
    )
    spec.evaluation.prompts = 1
    reference = _in_process(spec, tmp_path / "ref", prepared_dataset)
    first = _in_process(spec, tmp_path / "run", prepared_dataset, stop_after=2)
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    shutil.copytree(tmp_path / "run", tmp_path / "two-ranks")

    _to_earlier_format(ckpt, spec, prepared_dataset, toy_verifier, ranks=1)
    resumed = _in_process(spec, tmp_path / "run", prepared_dataset)
    assert resumed["step"] == 4
    assert sorted(first["consumed"] + resumed["consumed"]) == sorted(reference["consumed"])
    torch.testing.assert_close(resumed["losses"], reference["losses"][2:], rtol=RTOL, atol=ATOL)
    _close(final_weights(tmp_path / "run"), final_weights(tmp_path / "ref"))

    # Written by 2 ranks, it does not resume on 1: its rows were dealt out per rank.
    ckpt2 = latest_checkpoint(tmp_path / "two-ranks" / "checkpoints")
    _to_earlier_format(ckpt2, spec, prepared_dataset, toy_verifier, ranks=2)
    with pytest.raises(CheckpointError, match="written by 2 ranks; it resumes only at that world size"):
        train(spec, tmp_path / "two-ranks", dataset_dir=prepared_dataset)
