"""Suite-wide fixtures and markers: CUDA-only tests skip without a GPU; tests sharing the session's vLLM
engine (or what only it needs) run on one xdist worker."""

from __future__ import annotations

import pytest

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


def _uses_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d[-1].scope == "module" for d in defs if d)


@pytest.hookimpl(tryfirst=True)  # before xdist's hook reads the group markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A module-scoped fixture (a running stack, trained drafters) is built once per worker that runs one of
    # its tests: xdist's load scheduling split such modules over both workers and built them twice. So a
    # module whose tests share one runs on one worker, inside the vLLM group when any of its tests is in it.
    by_module: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    for module, members in by_module.items():
        if any(SHARED_ON_ONE_WORKER.intersection(getattr(i, "fixturenames", ())) for i in members):
            group = "vllm"
        elif any(_uses_module_fixture(i) for i in members):
            group = module
        else:
            continue
        for item in members:
            if group == "vllm" or _uses_module_fixture(item):
                item.add_marker(pytest.mark.xdist_group(group))
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
