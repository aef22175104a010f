"""Keeps the verifier's forward on the loader's thread out of the windows in which torch.compile traces.

While torch.fx traces, it swaps `torch.nn.Module.__call__` for its own wrapper, process-wide: a module
called on another thread meanwhile is taken for part of the traced program. Inductor's first compile in a
process traces a bare function (`torch._inductor.loop_body`), and an online job's verifier forward on the
loader's thread that overlapped it, while the training thread compiled the loss kernels, failed with
"NameError: module is not installed as a submodule". `outside_compiles()` around that forward, and
dynamo's compile callbacks, keep the two apart: each waits for the other to finish.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch._dynamo.callback import callback_handler

# A compile that cannot start after this long goes ahead (the race again, rather than a hang): a verifier
# whose forward compiles something itself would otherwise wait for its own guarded call.
COMPILE_WAIT_S = 120.0

_cond = threading.Condition()
_compiling = 0
_running = 0


def _compile_started(_args: Any) -> None:
    global _compiling
    with _cond:
        _cond.wait_for(lambda: _running == 0, timeout=COMPILE_WAIT_S)
        _compiling += 1


def _compile_ended(_args: Any) -> None:
    global _compiling
    with _cond:
        _compiling = max(0, _compiling - 1)  # a compile that began before the callbacks were installed
        _cond.notify_all()


# Installed on import, before anything compiles: the loader imports this module before training starts.
# Dynamo runs these once per outermost compile, on the thread that compiles.
callback_handler.register_start_callback(_compile_started)
callback_handler.register_end_callback(_compile_ended)


@contextmanager
def outside_compiles() -> Iterator[None]:
    """Run the block once no torch.compile is compiling in this process; a compile that starts meanwhile
    waits until the block is done."""
    global _running
    with _cond:
        _cond.wait_for(lambda: _compiling == 0)
        _running += 1
    try:
        yield
    finally:
        with _cond:
            _running -= 1
            _cond.notify_all()
