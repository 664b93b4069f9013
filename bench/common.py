"""Helpers shared by the benchmarks: a wall-clock timer and the machine's f32 matmul peak."""

import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes; `fn` must block until its work is done."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values) -> float:
    return float(statistics.median(values))


def matmul_peak(sizes=(1024, 2048), repeats: int = 5) -> dict[int, float]:
    """Best GFLOP/s of a jitted float32 `a @ b` for each square size (compiled and warmed first)."""
    matmul = jax.jit(jnp.matmul)
    peak = {}
    for n in sizes:
        a, b = jax.random.normal(jax.random.key(0), (2, n, n), jnp.float32)
        matmul(a, b).block_until_ready()
        best = min(timed(functools.partial(lambda x, y: matmul(x, y).block_until_ready(), a, b)) for _ in range(repeats))
        peak[n] = 2 * n**3 / best / 1e9
    return peak
