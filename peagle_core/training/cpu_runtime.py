"""Process settings that CPU training needs to run at speed: glibc's allocator keeps freed memory, up to a cap.

Every step frees and re-allocates the same large buffers (gradients, logits chunks, attention outputs).
By default glibc returns each block over 32 MiB (and the heap's free top) to the kernel, so the next
step page-faults all of it in again: 0.5-0.7 s of a 3 s step at SmolLM2's drafter shape (measured,
bench/train_throughput.py). Serving the heap from brk and never trimming it keeps the pages mapped.

On real data the step's buffers change size from step to step (COD rows, documents per row), and a heap
that is never trimmed fragments: a 0.75M-token run on SmolLM2 held 11.6 GB of anonymous memory after 180
steps, of which `malloc_trim` gave back 9.5 GB at once. `trim_freed_memory` therefore returns the free
memory glibc holds whenever it passes a cap (4 GiB by default), so the common case keeps its pages and
the heap cannot grow without bound.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)

# mallopt(3) parameters
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_applied = False
# Free bytes glibc may hold before `trim_freed_memory` returns them; PEAGLE_MAX_FREED_MEMORY_MB overrides.
DEFAULT_MAX_FREED_BYTES = 4 << 30


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33+): every field a size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]  # fmt: skip


@functools.cache  # called after every step: load libc once
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Tell glibc malloc to keep freed memory for reuse (once per process); False where it is not glibc,
    or where PEAGLE_KEEP_FREED_MEMORY=0 leaves glibc's defaults (a process sharing the machine's memory)."""
    global _applied
    if _applied:
        return True
    if os.environ.get("PEAGLE_KEEP_FREED_MEMORY", "1") == "0":
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
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


def resident_free_bytes() -> int | None:
    """Resident memory glibc holds free: the process's anonymous RSS less the bytes malloc has handed out
    (`mallinfo2().uordblks`). Trimmed free chunks stay in malloc's bins but leave the RSS, so this (not
    `fordblks`) is what a trim lowers. Python's own small-object arenas count here too (a few hundred MB at
    most). None where glibc or /proc is not there."""
    libc = _libc()
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.argtypes, mallinfo2.restype = [], _MallInfo2
    try:
        with open("/proc/self/status") as f:
            anon_kb = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
    except (OSError, StopIteration, ValueError):
        return None
    return max(0, (anon_kb << 10) - int(mallinfo2().uordblks))


def max_freed_bytes() -> int:
    """The cap `trim_freed_memory` keeps the held free memory under (PEAGLE_MAX_FREED_MEMORY_MB, MiB)."""
    raw = os.environ.get("PEAGLE_MAX_FREED_MEMORY_MB")
    return DEFAULT_MAX_FREED_BYTES if raw is None else max(0, int(raw)) << 20


def trim_freed_memory(cap: int | None = None) -> int:
    """Give the kernel back the free memory glibc holds resident when it exceeds `cap` bytes (default
    `max_freed_bytes()`); the bytes returned (0 when under the cap, or when `keep_freed_memory` is not in
    force, since glibc then trims by itself)."""
    if not _applied:
        return 0
    held = resident_free_bytes()
    if held is None or held <= (max_freed_bytes() if cap is None else cap):
        return 0
    libc = _libc()
    if libc is None:
        return 0
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.malloc_trim(0)
    after = resident_free_bytes()
    return max(0, held - (after if after is not None else held))
