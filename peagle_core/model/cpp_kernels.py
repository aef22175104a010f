"""Our C++ kernels (`peagle_core/model/csrc`), built by TorchInductor's C++ loader: its compiler, the
machine's vector-ISA flags, OpenMP and its on-disk cache (keyed by source and flags; ~1 s once per machine).
A failed build returns None and the caller keeps its PyTorch path."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from importlib import resources

log = logging.getLogger(__name__)


@functools.cache
def load(
    source: str, entries: tuple[tuple[str, tuple[str, ...]], ...]
) -> tuple[Callable[..., None], ...] | None:
    """`csrc/<source>` built once per (define, argument types) entry, each exporting its `kernel` (the
    source's `#ifdef <define>` block); the callables take tensors for pointers and ints/floats as such."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    text = resources.files("peagle_core.model").joinpath("csrc", source).read_text()
    try:
        return tuple(
            CppPythonBindingsCodeCache.load_pybinding(
                list(args), f"#define {define}\n{text}", needs_vec_isa=True
            )
            for define, args in entries
        )
    except Exception:
        log.warning("building the C++ kernels of %s failed; using the PyTorch ones", source, exc_info=True)
        return None
