"""bench/gpu_suite.py stays runnable: its CPU dry run end to end, and the stage runner's skip and
time-cap rules (bench/_suite.py: the parts a GPU window cannot afford to debug)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bench.scripts import bench_module

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_suite.py"


def _dry_run(tmp_path_factory: pytest.TempPathFactory, toy_verifier_dir: Path) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("suite_out")
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--toy-verifier", str(toy_verifier_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {"proc": proc, "lines": lines, "by_check": {x["check"]: x for x in lines}, "out": out}


def test_dry_run_passes_every_check_on_the_cpu_and_writes_its_lines_to_out(
    tmp_path_factory: pytest.TempPathFactory, toy_verifier_dir: Path
) -> None:
    # One test, not a fixture shared by two: the dry run takes ~2 min on 2 cores, and xdist ran a
    # module-scoped fixture once per test when other modules' tests came between them.
    dry_run = _dry_run(tmp_path_factory, toy_verifier_dir)
    proc, checks = dry_run["proc"], dry_run["by_check"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert checks["summary"]["status"] == "ok" and not checks["summary"]["failed"]

    pre = checks["preflight"]
    assert pre["cuda_available"] is False and pre["torch"] and pre["flex_attention"] is True
    assert pre["capabilities"]["peagle_core"] is True
    assert checks["gemm_peak"]["peak_tflops"] > 0

    cuda = checks["cuda_tests"]  # no GPU here: the selection is collected, not run
    assert cuda["status"] == "skipped" and "no CUDA device" in cuda["reason"] and cuda["collected"] >= 4

    assert checks["overfit"]["status"] == "ok"
    assert checks["overfit"]["last_loss"] <= 0.15 * checks["overfit"]["first_loss"]
    e2e = checks["train_e2e"]  # train(), then resumed from its checkpoint, then exported
    assert e2e["status"] == "ok" and e2e["steps"] == [4, 6] and e2e["export"] == "step_6"
    lossless = checks["lossless_eval"]
    assert lossless["status"] == "ok" and lossless["mismatched_prompts"] == [] and lossless["prompts"] > 0

    for seq in (64, 128):
        for name in ("cache_build", "cached_step", "cached_loader", "online_step"):
            line = checks[f"{name}@{seq}"]
            assert line["status"] == "ok", line
            assert line["tokens_per_s"] > 0 and line["mfu"] > 0, line
    hybrid = checks["hybrid_epoch@64"]
    assert hybrid["status"] == "ok"
    assert hybrid["epoch0"]["cache_misses"] > 0 and hybrid["epoch0"]["cache_hits"] == 0
    assert hybrid["epoch1"]["cache_hits"] == hybrid["epoch0"]["cache_misses"]
    assert hybrid["epoch1"]["verifier_calls"] == 0
    throughput = checks["train_throughput"]  # bench/train_throughput.py's new path, two short steps
    assert throughput["status"] == "ok", throughput
    (figure,) = throughput["figures"]
    assert figure["variant"] == "new" and figure["shape"] == "smollm2" and figure["tokens_per_s"] > 0
    for seq in (64, 128):  # speculators' step on the same rows, as a ratio of ours (where it is installed)
        side = checks[f"speculators_step@{seq}"]
        if importlib.util.find_spec("speculators") is None:
            assert side["status"] == "skipped" and "speculators is not installed" in side["reason"]
        else:
            assert side["status"] == "ok" and side["tokens_per_s"] > 0 and side["ours_over_speculators"] > 0

    # what a GPU window brings back: every line also written to $OUT
    written = (dry_run["out"] / "gpu_suite.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in written] == dry_run["lines"]


_BLOCKER = """
import sys


class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pydantic", "speculators"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
        return None


sys.meta_path.insert(0, _Block())
"""


def test_without_the_carried_wheels_every_check_needing_them_is_skipped(tmp_path: Path) -> None:
    # The GPU image as it comes: no pydantic, no speculators. The run must say why and still finish.
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    checks = {x["check"]: x for x in map(json.loads, filter(None, proc.stdout.splitlines()))}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert checks["preflight"]["core_modules_missing"] == ["pydantic"]
    assert checks["gemm_peak"]["status"] == "ok"
    for name in ("cuda_tests", "overfit", "verifier_build", "cached_step@64", "speculators_step@128"):
        assert checks[name]["status"] == "skipped", checks[name]
        assert "missing pydantic" in checks[name]["reason"] and "gpu_wheels.sh" in checks[name]["reason"]
    assert checks["summary"]["status"] == "ok" and checks["summary"]["ok"] == ["preflight", "gemm_peak"]


def test_a_missing_piece_skips_only_the_checks_that_need_it(tmp_path: Path) -> None:
    gs = bench_module("_suite")
    suite = gs.Suite(budget_s=60, out_path=tmp_path / "s.jsonl")
    suite.have("vllm_cuda", False, "vllm is not installed")
    suite.have("device", True)
    ran = []
    suite.stage("needs_vllm", lambda cap: ran.append("vllm") or {}, needs=("device", "vllm_cuda"))
    suite.stage("plain", lambda cap: ran.append("plain") or {"figure": 1}, needs=("device",))
    suite.stage("unknown", lambda cap: ran.append("unknown") or {}, needs=("speculators",))
    lines = {x["check"]: x for x in map(json.loads, (tmp_path / "s.jsonl").read_text().splitlines())}
    assert ran == ["plain"]
    assert lines["needs_vllm"]["status"] == "skipped"
    assert lines["needs_vllm"]["reason"] == "vllm_cuda: vllm is not installed"
    assert lines["plain"] == {
        "check": "plain",
        "status": "ok",
        "seconds": lines["plain"]["seconds"],
        "figure": 1,
    }
    assert lines["unknown"]["status"] == "skipped" and "speculators" in lines["unknown"]["reason"]
    assert suite.summary() == 0  # skips are not failures


def test_a_stage_stops_at_its_cap_and_the_next_one_runs(tmp_path: Path) -> None:
    gs = bench_module("_suite")
    suite = gs.Suite(budget_s=60)

    def spin(cap: float) -> dict[str, Any]:
        while True:  # a stage that never returns on its own
            pass

    def fail(cap: float) -> dict[str, Any]:
        raise gs.CheckFailed("wrong answer", got=2)

    suite.stage("spin", spin, cap=0.3)
    suite.stage("fail", fail)
    suite.stage("after", lambda cap: {"ran": True})
    assert suite.results == {"spin": "timeout", "fail": "failed", "after": "ok"}
    assert suite.summary() == 1


def test_stages_past_the_deadline_are_skipped_as_out_of_time() -> None:
    gs = bench_module("_suite")
    suite = gs.Suite(budget_s=1)
    result = suite.stage("late", lambda cap: {"ran": True})
    assert result is None and suite.results == {"late": "skipped"}


def test_only_runs_the_named_stages_and_the_always_ones() -> None:
    gs = bench_module("_suite")
    suite = gs.Suite(budget_s=60, only=("cached",))
    for name, always in (("preflight", True), ("cache_build@64", False), ("cached_step@64", False)):
        suite.stage(name, lambda cap: {}, always=always)
    assert suite.results == {"preflight": "ok", "cached_step@64": "ok"}
