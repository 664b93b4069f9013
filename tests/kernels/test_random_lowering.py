"""JAX's random hash on the CPU as lmzoo lowers it (`kernels.cpu.lower_threefry_unrolled`): a large draw as one
elementwise program instead of JAX's loop, a small one still looped, both with the bits of JAX's own lowering, which a
process without lmzoo uses."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np

import lmzoo.kernels  # noqa: F401  (sets the lowering, as any lmzoo import does)

ROOT = pathlib.Path(__file__).resolve().parents[2]

DRAWS = """
import json, jax, numpy as np
key = jax.random.key(3)
normal = jax.random.normal(key, (70001,))
kept = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.9, (257, 33))
def loops(size):
    return " while(" in jax.jit(lambda k: jax.random.normal(k, (size,))).lower(key).compile().as_text()
print(json.dumps({"normal": np.asarray(normal).tolist(), "kept": np.asarray(kept).tolist(),
                  "loop": [loops(70001), loops(4099)]}))
"""


def _draws(env_imports: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", env_imports + DRAWS], capture_output=True, text=True, check=True, timeout=300, cwd=ROOT
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_random_draws_have_jax_own_bits_without_its_loop_on_the_cpu():
    jax_own, lmzoo_lowered = _draws(""), _draws("import lmzoo.kernels\n")
    assert jax_own["loop"] == [True, True] and lmzoo_lowered["loop"] == [False, True]  # JAX's CPU lowering loops
    for name in ("normal", "kept"):
        assert np.array_equal(np.asarray(jax_own[name]), np.asarray(lmzoo_lowered[name])), name
    in_process = jax.random.normal(jax.random.key(3), (70001,))
    assert np.array_equal(np.asarray(in_process, np.float64), np.asarray(jax_own["normal"]))
