"""Library tests run torch on one thread: the tensors are tiny, and extra intra-op threads only add
contention on a shared 2-core CI machine (up to 100x slower there)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
