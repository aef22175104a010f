"""Process settings that CPU training needs to run at speed: glibc's allocator keeps freed memory.

Every step frees and re-allocates the same large buffers (gradients, logits chunks, attention outputs).
By default glibc returns each block over 32 MiB (and the heap's free top) to the kernel, so the next
step page-faults all of it in again: 0.5-0.7 s of a 3 s step at SmolLM2's drafter shape (measured,
bench/train_throughput.py). Serving the heap from brk and never trimming it keeps the pages mapped; the
peak RSS stays that of the largest step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

# mallopt(3) parameters
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_applied = False


def keep_freed_memory() -> bool:
    """Tell glibc malloc to keep freed memory for reuse (once per process); False where it is not glibc,
    or where PEAGLE_KEEP_FREED_MEMORY=0 leaves glibc's defaults (a process sharing the machine's memory)."""
    global _applied
    if _applied:
        return True
    if os.environ.get("PEAGLE_KEEP_FREED_MEMORY", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = (
        mallopt(_M_MMAP_MAX, 0) == 1
        and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
        and mallopt(_M_TOP_PAD, 64 * 2**20) == 1
    )
    if not ok:
        log.warning("mallopt refused the training allocator settings; CPU steps may page-fault more")
    _applied = ok
    return ok
