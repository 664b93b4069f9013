"""glibc malloc settings for processes that run XLA:CPU programs.

XLA:CPU allocates an executable's temporary buffer anew on every call and frees it after. A train step's is tens
of MB (43.7 MB for configs/shakespeare_char.py), more than glibc's largest mmap threshold (32 MB), so by default
malloc maps it fresh each step, the kernel zero-fills and faults in every page of it again, and free unmaps it:
23.8 million minor page faults and 53 s of system time in that config's 2,000-step run, a quarter of its CPU time.
With mmap off (every block from the heap) and the heap trimmed only past 64 MB free at its top, the freed buffer
stays mapped and the next step reuses it. What the heap keeps is released between phases (the loop calls
`release_freed_memory` around evaluations and before the end-of-run sample), so peak memory stays near the
default's. A buffer of more than 64 MB, asked for by one of XLA's worker threads, glibc maps afresh each time
whatever the setting (its per-thread heaps are at most 64 MB): the loop sets it only for steps whose temporaries fit.
"""

import ctypes
import functools
from typing import Any

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 64 << 20
THREAD_HEAP_BYTES = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit


@functools.cache
def keep_freed_buffers_mapped() -> bool:
    """Sets the process's malloc to serve every block from its heap and keep up to 64 MB freed at the heap's top.
    Idempotent; returns False (and changes nothing) where the C library is not glibc."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def keep_step_buffers_mapped(step: Any, *args: Any) -> bool:
    """`keep_freed_buffers_mapped` when the temporaries of jitted `step` called on `args` (already compiled for
    them: this looks the executable up) fit one of glibc's per-thread heaps; whether it was set."""
    temp_bytes = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
    return temp_bytes <= THREAD_HEAP_BYTES and keep_freed_buffers_mapped()


def release_freed_memory() -> None:
    """Returns the pages of every freed block to the OS (glibc's malloc_trim), e.g. after an evaluation."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
