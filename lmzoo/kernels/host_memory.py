"""glibc malloc settings: for processes that run XLA:CPU programs, and while a checkpoint is read
(`large_blocks_unmapped_when_freed`).

XLA:CPU allocates an executable's temporary buffer anew on every call and frees it after. A train step's is tens
to hundreds of MB (43.7 MB for configs/shakespeare_char.py, 651 MB for bench/gpt2_bench.py's), more than glibc's
largest mmap threshold (32 MB), so by default malloc maps it fresh each step, the kernel zero-fills and faults in
every page of it again, and free unmaps it: 23.8 million minor page faults and 53 s of system time in that
config's 2,000-step run, a quarter of its CPU time. With mmap off (every block from a heap), heaps trimmed only
past 64 MB free at their top and padded by the step's temporaries and 64 MB more, the freed buffer stays mapped
and the next step reuses it. What the heaps keep is released between phases (the loop's `StepBuffers` hook releases it
around evaluations and before the end-of-run sample, on the CPU only).

Where the buffer comes from matters. By default JAX runs XLA:CPU programs on worker threads, whose glibc heaps
hold at most 64 MB: a larger block asked for there is mapped afresh whatever the setting. `run_on_calling_thread`
makes a one-device program run on the thread that calls it, whose heap has no such limit, so the setting keeps a
buffer of any size.

How many heaps there are matters too. glibc gives threads heaps of their own, up to eight per core; XLA compiles on a
pool of threads, and what a compile frees in one heap (most of what it allocated) is reused only by the threads
of that heap, so each later compile grows another. `one_heap_per_core` caps them (train.py, eval.py and the
server call it first; train.py through `set_up_process`, which does both).
"""

import contextlib
import ctypes
import functools
import os
from typing import Any

import jax

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8
KEPT_BYTES = 64 << 20  # kept free at a heap's top, and the padding a heap grows by
THREAD_HEAP_BYTES = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def set_up_process() -> None:
    """How lmzoo's commands set up their process before JAX's CPU client exists: one-device programs run on the
    calling thread (`run_on_calling_thread`) and malloc keeps one heap per core (`one_heap_per_core`)."""
    run_on_calling_thread()
    one_heap_per_core()


def one_heap_per_core() -> bool:
    """Caps glibc's malloc at one heap (arena) per core this process may run on, where it makes up to eight, so
    the memory a compile frees is reused by the next (docs/notes/cpu-speed.md: the peak RSS it saves). Heaps made
    before the call stay: call it before threads start. MALLOC_ARENA_MAX, where set, is left to decide. Whether it
    was set (False where the C library is not glibc, or the variable is set)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return bool(mallopt(M_ARENA_MAX, cores or 1))


def run_on_calling_thread() -> None:
    """Makes XLA:CPU run a one-device program on the thread that calls it (JAX's
    `jax_cpu_enable_async_dispatch=False`), so its temporaries come from the main heap. Takes effect only before
    JAX creates its CPU client (the first `jax.devices()` or computation); programs over several devices still run
    on worker threads. Measured neutral for the loop's speed (configs/shakespeare_char.py, 400 steps: 36.9-38.4 s
    either way): its host work between steps is small."""
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def keep_freed_buffers_mapped(step_bytes: int = 0) -> bool:
    """Sets the process's malloc to serve every block from a heap, keep up to 64 MB freed at a heap's top, and
    grow a heap by `step_bytes` + 64 MB more than asked and keep that much when trimming it (so a step buffer of
    `step_bytes` freed at the top stays mapped, and a per-thread heap holding only it is not deleted, which would
    unmap it as surely as mmap). Returns False (and changes nothing) where the C library is not glibc."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEPT_BYTES), (M_TOP_PAD, step_bytes + KEPT_BYTES))
    return all(mallopt(param, value) for param, value in settings)


def keep_step_buffers_mapped(step: Any, *args: Any) -> bool:
    """`keep_freed_buffers_mapped` for the temporaries of `step` on `args` (its compiled program, or a jitted function
    already compiled for them: this looks the executable up, ~20 ms, so call it once) when it runs on XLA:CPU and
    glibc can keep them: they fit a worker thread's heap, or `step` runs on the calling thread
    (`run_on_calling_thread`, one device). Whether it was set; a step on accelerator devices keeps nothing and is not
    looked up."""
    devices = {device for leaf in jax.tree.leaves(args) if isinstance(leaf, jax.Array) for device in leaf.devices()}
    if not devices or any(device.platform != "cpu" for device in devices):
        return False
    executable = step if isinstance(step, jax.stages.Compiled) else step.lower(*args).compile()
    temp_bytes = executable.memory_analysis().temp_size_in_bytes
    on_calling_thread = not jax.config.read("jax_cpu_enable_async_dispatch") and len(devices) == 1
    return (on_calling_thread or temp_bytes <= THREAD_HEAP_BYTES) and keep_freed_buffers_mapped(temp_bytes)


@contextlib.contextmanager
def large_blocks_unmapped_when_freed():
    """Inside the block, malloc maps every block of 1 MB or more on its own, so freeing it returns its pages at once.

    For reading a checkpoint: glibc serves blocks of up to 32 MB from its heaps once one that large has been freed, and
    keeps freed ones there for reuse, so while orbax restores, its read buffers (a parameter shard each, in several
    threads' heaps) pile up, by a share of the model that varies from run to run (bench/load_bench.py's `ckpt:`,
    docs/RESULTS.md). After the block the thresholds
    are left where glibc's own adjustment ends (mmap from 32 MB, trim past 64 MB free). Where the C library is not
    glibc, nothing is set.
    """
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        yield
        return
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, 32 << 20)
        mallopt(M_TRIM_THRESHOLD, 64 << 20)


def release_freed_memory() -> None:
    """Returns the pages of every freed block to the OS (glibc's malloc_trim), e.g. after an evaluation."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


class StepBuffers:
    """The training loop's one hook into the process's malloc, for the platform its mesh runs on.

    On the CPU: from a compiled function's first call its temporaries are kept mapped (`keep_step_buffers_mapped`,
    once per function), so only that call maps them fresh (set after it, the second call would map them again), and
    freed pages go back to the OS around evaluations and at the end. On accelerators, whose step buffers live on the
    device, every method does nothing: no lowering, no glibc call.
    """

    def __init__(self, platform: str):
        self.active = platform == "cpu"
        self._kept: set[Any] = set()

    def before_call(self, step: Any, *args: Any) -> None:
        """Called before each call of `step` (a compiled program, or a jitted function, which this compiles if it has
        not been) on `args`; acts before its first."""
        if self.active and step not in self._kept:
            keep_step_buffers_mapped(step, *args)
            self._kept.add(step)

    @contextlib.contextmanager
    def released(self):
        """Freed pages returned to the OS before and after the block (an evaluation between steps)."""
        self.release()
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        if self.active:
            release_freed_memory()
