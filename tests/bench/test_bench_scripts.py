"""Every bench script still runs: each one's `--help` (its imports and its parser) in one child process, and
the harness rules hold (one `emit`, no import cycle between scripts, nothing imported from tests/)."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from tests.bench.scripts import BENCH, SCRIPTS, script_help


def test_every_bench_script_answers_help() -> None:
    results = script_help()
    assert set(results) == {p.name for p in SCRIPTS}
    broken = {
        name: r["code"] for name, r in results.items() if r["code"] != 0 or "usage:" not in str(r["help"])
    }
    assert not broken, broken


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_harness_has_one_emit_no_cycles_and_no_test_imports() -> None:
    modules = {p.stem: p for p in BENCH.glob("*.py")}
    emits = sorted(
        p.name
        for p in modules.values()
        for node in ast.parse(p.read_text()).body  # module level: _suite's Suite.emit also writes its file
        if isinstance(node, ast.FunctionDef) and node.name == "emit"
    )
    assert emits == ["_common.py"]
    deps = {name: {m for m in _imports(p) if m in modules} for name, p in modules.items()}
    from_tests = sorted(
        name for name, p in modules.items() if any(m.split(".")[0] == "tests" for m in _imports(p))
    )
    assert not from_tests
    # Scripts import only helpers (`_name`), and helpers never import a script: no cycle can form.
    upward = sorted(f"{name} -> {m}" for name, ms in deps.items() for m in ms if not m.startswith("_"))
    assert not upward


def test_gate_noise_trains_its_drafter_through_the_pipeline(
    toy_verifier_dir: Path, toy_dataset_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import gate_noise

    args = argparse.Namespace(num_layers=1, num_depths=2, draft_vocab=256, seq_len=128, steps=1)
    export = gate_noise.train_drafter(toy_verifier_dir, toy_dataset_path, tmp_path / "run", args)
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()


def test_loader_disk_builds_its_cache_once_and_times_the_trainers_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import loader_disk

    dataset = loader_disk.SyntheticDataset(20_000)
    loader_disk.build(tmp_path, dataset)
    shards = sorted(tmp_path.glob("*.safetensors"))
    loader_disk.build(tmp_path, dataset)  # a second build finds it complete and writes nothing
    assert sorted(tmp_path.glob("*.safetensors")) == shards
    got = loader_disk.read(tmp_path, dataset, batches=3, seq_len=4096)
    assert got["batches"] == 3 and got["s_per_batch"] > 0 and got["mb_per_s"] > 0
