"""Suite-wide fixtures and markers: CUDA-only tests skip without a GPU; tests sharing the session's vLLM
engine (or what only it needs) run on one xdist worker."""

from __future__ import annotations

import os
import sys

import pytest

# Two xdist workers share CI's two cores. A worker whose torch (and every process it starts) computes on
# two threads spin-waits against the other worker's: one thread each is faster in all (measured on this
# machine: tests/core 158 s -> 123 s wall, user CPU -26%). Set before the workers start, so they inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every process the suite starts (xdist workers, job workers, torchrun ranks, vLLM children, servers) imports
# torch, transformers or vLLM. With PYTHONDONTWRITEBYTECODE set (these machines set it) and the install's
# --no-compile, each one compiled every module it imported from source again: 11 of the 20 s a job's
# data preparation took (measured). The first import now writes the module's bytecode, as by default.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

pytest_plugins = [
    "tests.fixtures.toy",
    "tests.fixtures.stack",
    "tests.fixtures.vllm",
    "tests.fixtures.catalogue",
]


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# Session fixtures too costly to build once per worker (a vLLM child, drafters trained for the serving
# tests, SmolLM2 from its wheel): every test that uses one joins the group one worker runs.
SHARED_ON_ONE_WORKER = {"vllm_engine", "plain_greedy", "exported_drafters", "smollm2_dir"}


@pytest.hookimpl(tryfirst=True)  # before xdist's hook reads the group markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SHARED_ON_ONE_WORKER.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("vllm"))
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
