"""Decode-step benchmark: one KV-cache decoding step of the generation bench's model (Llama, vocabulary 2,048, D 256,
4 layers, 4 query / 2 kv heads of 64, SwiGLU 704, f32) over S rows and an L-position cache, its layers scanned and
looped, as this tree's generation paths run it, against the same in a tree of another commit, in one run.

    python bench/decode_step_bench.py --before 19b6cc7          # 64 rows x 320 positions, 3 rounds
    python bench/decode_step_bench.py --before 19b6cc7 --tiny   # smoke run: 8 rows x 64 positions, 1 round

Each (tree, layers) pair runs in a process of its own with that tree first on PYTHONPATH (the other commit's tree
is a git worktree made at /tmp/lmzoo-REV when missing): it builds the model (`scan_layers` True or False), takes
the form its tree's generation entry points decode with (`models.kinds.decoding_form` where the tree has it, the
model as it is where not), fills every row's cache to half of L, then times calls of 32 greedy decode steps in one
jitted `lax.fori_loop` (the engine's chunk: `model.apply(decode=True)` on one token a row, argmax fed back), the
cache donated; it prints the best call's milliseconds a step. The pairs run in interleaved rounds (each round in a
rotated order), medians over rounds.

Reference, measured in the same run: the machine's copy bandwidth (GB/s, the best of 5 copies of a 256 MiB f32
array with numpy), against which each step's cache traffic is set: a step reads every layer's keys and values, S x L
x 2 x K x H x 4 bytes, so `cache GB/s` = those bytes / the step's time. Targets (PASS/MISS, never asserted): the
scanned model decodes within 1.1x of the looped one in this tree (generation loops a scanned stack), and this tree's
looped step is no slower than the other commit's. The CPU model, the load average at start and end and one JSON record
of every number end the output.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIELDS = dict(vocab_size=2048, emb_dim=256, num_heads=4, num_kv_heads=2, num_layers=4, mlp_dim=704)
STEPS = 32
TARGETS = {"scanned / looped (this tree)": 1.1, "this tree / before (looped)": 1.0}


def worker(rows: int, length: int, scan_layers: bool, calls: int) -> dict:
    """ms per decode step of the model as this process's lmzoo decodes it (printed as JSON by `--worker`)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from lmzoo import models
    from lmzoo.models import kinds
    from lmzoo.serving import slots

    model = models.build_model("llama", dict(FIELDS, max_len=length, scan_layers=scan_layers))
    params = nn.unbox(model.init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"])
    decoding_form = getattr(kinds, "decoding_form", None)
    if decoding_form is not None:
        model, params = decoding_form(model, params)

    def step(carry, _):
        cache, token, position = carry
        logits, variables = model.apply(
            {"params": params, "cache": cache},
            token[:, None],
            positions=position[:, None],
            segment_ids=jnp.ones_like(token)[:, None],
            decode=True,
            mutable=["cache"],
        )
        return variables["cache"], jnp.argmax(logits[:, 0], -1).astype(jnp.int32), position + 1

    @jax.jit
    def fill(cache):  # every row's cache to L / 2: the positions a step attends to are those of a busy engine
        prompt = jnp.asarray(np.random.default_rng(0).integers(0, FIELDS["vocab_size"], (rows, length // 2)))
        positions = jnp.broadcast_to(jnp.arange(length // 2), prompt.shape)
        _, variables = model.apply(
            {"params": params, "cache": cache}, prompt, positions=positions, decode=True, mutable=["cache"]
        )
        return variables["cache"]

    chunk = jax.jit(lambda carry: jax.lax.fori_loop(0, STEPS, lambda i, c: step(c, i), carry), donate_argnums=0)
    carry = (fill(slots.init_cache(model, rows, length)), jnp.zeros((rows,), jnp.int32), None)
    best = float("inf")
    for call in range(calls + 1):
        carry = (carry[0], carry[1], jnp.full((rows,), length // 2, jnp.int32))  # the same positions each call
        start = time.perf_counter()
        carry = jax.block_until_ready(chunk(carry))
        if call:  # the first compiles
            best = min(best, time.perf_counter() - start)
    return {"ms_per_step": 1e3 * best / STEPS}


def copy_bandwidth() -> float:
    """GB/s of the best of 5 numpy copies of a 256 MiB float32 array (read + write counted)."""
    import numpy as np

    source = np.ones(64 * 2**20, np.float32)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best / 1e9


def before_tree(rev: str) -> pathlib.Path:
    tree = pathlib.Path(f"/tmp/lmzoo-{rev}")
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True)
    return tree


def run_pair(tree: pathlib.Path, rows: int, length: int, scan_layers: bool, calls: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, __file__, "--worker", f"--rows={rows}", f"--length={length}", f"--calls={calls}"]
    out = subprocess.run(command + [f"--scan_layers={int(scan_layers)}"], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"worker in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["ms_per_step"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--before", default="", help="the commit to compare with (required; a worktree at /tmp/lmzoo-REV)"
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5, help="timed calls of 32 steps per process (the best counts)")
    parser.add_argument("--tiny", action="store_true", help="8 rows x 64 positions, 1 round, 2 calls")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scan_layers", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.rows, args.length, bool(args.scan_layers), args.calls)))
        return
    if not args.before:
        parser.error("--before REV names the commit to compare with, e.g. --before 19b6cc7")
    if args.tiny:
        args.rows, args.length, args.rounds, args.calls = 8, 64, 1, 2

    sys.path.insert(0, str(ROOT))
    from bench import common

    cpu, isa = common.cpu_model_and_isa()
    load_start = os.getloadavg()[0]
    bandwidth = copy_bandwidth()
    print(
        f"decode step bench: {args.rows} rows x {args.length} positions, {args.rounds} round(s), before {args.before}"
    )
    print(f"CPU: {cpu}, ISA: {isa}; load average at start: {load_start:.2f} on {os.cpu_count()} cores")
    print(f"copy bandwidth (numpy, 256 MiB, best of 5): {bandwidth:.1f} GB/s")
    trees = {"this tree": ROOT, "before": before_tree(args.before)}
    pairs = [(tree, scan) for tree in trees for scan in (False, True)]
    per_round = {pair: [] for pair in pairs}
    for r in range(args.rounds):
        for tree, scan in common.round_order(pairs, r):
            per_round[(tree, scan)].append(run_pair(trees[tree], args.rows, args.length, scan, args.calls))
    ms = {pair: common.median(values) for pair, values in per_round.items()}
    cache_bytes = args.rows * args.length * 2 * FIELDS["num_kv_heads"] * 64 * 4 * FIELDS["num_layers"]
    print(f"\n{'tree':10} {'layers':8} {'ms/step':>8} {'tokens/s':>9} {'cache GB/s':>11} {'of copy bw':>11}")
    for (tree, scan), value in ms.items():
        gbs = cache_bytes / (value / 1e3) / 1e9
        print(
            f"{tree:10} {'scanned' if scan else 'looped':8} {value:8.2f} {args.rows / value * 1e3:9.0f} "
            f"{gbs:11.1f} {gbs / bandwidth:10.0%}"
        )
    ratios = {
        "scanned / looped (this tree)": ms[("this tree", True)] / ms[("this tree", False)],
        "this tree / before (looped)": ms[("this tree", False)] / ms[("before", False)],
    }
    print()
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x (target <= {TARGETS[name]}x): {common.verdict(ratio <= TARGETS[name])}")
    speedups = {
        f"{'scanned' if s else 'looped'} before / this tree": ms[("before", s)] / ms[("this tree", s)]
        for s in (False, True)
    }
    for name, value in speedups.items():
        print(f"{name}: {value:.2f}x")
    load_end = os.getloadavg()[0]
    print(f"load average at end: {load_end:.2f}")
    record = {
        "cpu": cpu,
        "rows": args.rows,
        "length": args.length,
        "before": args.before,
        "copy_gbs": bandwidth,
        "ms_per_step": {f"{tree}/{'scanned' if s else 'looped'}": v for (tree, s), v in ms.items()},
        "ratios": ratios,
        "speedups": speedups,
        "load": [load_start, load_end],
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
