"""Suite-wide fixtures and markers: CUDA-only tests skip without a GPU."""

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
