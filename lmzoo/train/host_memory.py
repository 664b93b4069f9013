"""glibc malloc settings for processes that run XLA:CPU programs.

XLA:CPU allocates an executable's temporary buffer anew on every call and frees it after. A train step's is tens
of MB (43.7 MB for configs/shakespeare_char.py), more than glibc's largest mmap threshold (32 MB), so by default
malloc maps it fresh each step, the kernel zero-fills and faults in every page of it again, and free unmaps it:
23.8 million minor page faults and 53 s of system time in that config's 2,000-step run, a quarter of its CPU time.
With mmap off (every block from the heap), heaps trimmed only past 64 MB free at their top and padded by 64 MB,
the freed buffer stays mapped and the next step reuses it. What the heaps keep is released between phases (the
loop calls `release_freed_memory` around evaluations and before the end-of-run sample). A buffer of more than 64 MB, asked for by one of XLA's worker threads, glibc maps afresh each time
whatever the setting (its per-thread heaps are at most 64 MB): the loop sets it only for steps whose temporaries fit.
"""

import ctypes
import functools
from typing import Any

import jax

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_TOP_PAD = -2
M_MMAP_MAX = -4
KEPT_BYTES = 64 << 20  # kept free at a heap's top, and the padding a heap grows by
THREAD_HEAP_BYTES = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


@functools.cache
def keep_freed_buffers_mapped() -> bool:
    """Sets the process's malloc to serve every block from its heap, keep up to 64 MB freed at a heap's top, and
    grow a heap by 64 MB more than asked (so a per-thread heap holding only the freed step buffer is not deleted,
    which would unmap it as surely as mmap). Idempotent; returns False (and changes nothing) where the C library
    is not glibc."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEPT_BYTES), (M_TOP_PAD, KEPT_BYTES))
    return all(mallopt(param, value) for param, value in settings)


def keep_step_buffers_mapped(step: Any, *args: Any) -> bool:
    """`keep_freed_buffers_mapped` when jitted `step` runs on XLA:CPU and its temporaries for `args` (already
    compiled for them: this looks the executable up) fit one of glibc's per-thread heaps; whether it was set."""
    if jax.default_backend() != "cpu":
        return False
    temp_bytes = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
    return temp_bytes <= THREAD_HEAP_BYTES and keep_freed_buffers_mapped()


def release_freed_memory() -> None:
    """Returns the pages of every freed block to the OS (glibc's malloc_trim), e.g. after an evaluation."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
