"""nanoGPT's CPU recipe end to end: lmzoo's `train.py` against the independent PyTorch run, as a user waits for them.

    python bench/shakespeare_e2e.py [--rounds 1] [--seed 0]

Each round runs, as subprocesses in alternating order, `python train.py --config=configs/shakespeare_char.py`
(fresh workdir) and `python bench/shakespeare_torch_reference.py --mode independent` (nanoGPT's eager
step). Measured per process: whole wall clock (startup, data, compile, training, evaluations) and
peak RSS (`wait4`'s ru_maxrss) and CPU time; parsed from their output: the whole-split validation loss at the end.
Prints PASS/MISS for the issue's targets, compared at equal loss: lmzoo wall clock <= 1.0x torch's
(stretch 0.8x), peak memory <= 1.25x, and lmzoo's loss within LOSS_TOLERANCE of torch's.
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from bench.shakespeare_torch_reference import DATA  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGETS = {"wall_ratio": 1.0, "wall_ratio_stretch": 0.8, "rss_ratio": 1.25}
LOSS_TOLERANCE = 0.01  # seed-to-seed spread of this recipe's whole-split loss is of this order
LOSS_PATTERNS = {  # the last match in the output is the final whole-split validation loss
    "lmzoo": re.compile(r"final validation .*?\bloss ([0-9.]+)"),
    "torch": re.compile(r"whole-split val loss ([0-9.]+)"),
}


def command(name: str, workdir: str, seed: int) -> list[str]:
    if name == "lmzoo":
        return [
            sys.executable,
            "train.py",
            "--config=configs/shakespeare_char.py",
            f"--workdir={workdir}",
            f"--config.data.path={DATA}",
        ]
    return [sys.executable, "bench/shakespeare_torch_reference.py", "--mode", "independent", "--seed", str(seed)]


def run(name: str, seed: int, log_path: pathlib.Path, extra_env: dict[str, str]) -> dict:
    """Runs one side to completion, its output to `log_path`; returns wall seconds, peak RSS (MiB), CPU
    seconds (user + system, all threads) and the final whole-split validation loss."""
    with tempfile.TemporaryDirectory() as workdir, open(log_path, "w+") as log:
        env = dict(os.environ, PYTHONPATH=str(ROOT), **extra_env)
        start = time.perf_counter()
        process = subprocess.Popen(
            command(name, workdir, seed), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        log.seek(0)
        output = log.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{name} failed (exit {os.waitstatus_to_exitcode(status)}), output in {log_path}")
    losses = LOSS_PATTERNS[name].findall(output)
    if not losses:
        raise RuntimeError(f"{name}: no final validation loss in its output {log_path}")
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "val_loss": float(losses[-1]),
    }


def verdict(passed: bool) -> str:
    return "PASS" if passed else "MISS"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="the torch run's seed (lmzoo uses its config's)")
    parser.add_argument("--log-dir", default=tempfile.gettempdir(), help="where each run's output is kept")
    parser.add_argument(
        "--compilation-cache",
        default="",
        help="JAX persistent compilation cache dir for lmzoo's runs (every compile cached); a warm-up run fills it first",
    )
    args = parser.parse_args()
    load = common.announce(
        "shakespeare_e2e", "configs/shakespeare_char.py", "train.py vs torch --mode independent", args.rounds
    )
    peak = common.matmul_peak()
    print("matmul peak (f32, best of 5): " + ", ".join(f"{n}: {g:.1f} GFLOP/s" for n, g in peak.items()), flush=True)
    log_dir = pathlib.Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {"lmzoo": {}, "torch": {}}
    if args.compilation_cache:
        env["lmzoo"] = {
            "JAX_COMPILATION_CACHE_DIR": args.compilation_cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }
        warm = run("lmzoo", args.seed, log_dir / "shakespeare_e2e_warmup.log", env["lmzoo"])
        print(f"  warm-up lmzoo run filling the compilation cache: {warm}", flush=True)
    rounds = []
    for r in range(args.rounds):
        row = {}
        for name in ("lmzoo", "torch") if r % 2 == 0 else ("torch", "lmzoo"):
            row[name] = run(name, args.seed, log_dir / f"shakespeare_e2e_{name}_{r + 1}.log", env[name])
            print(
                f"  round {r + 1} {name}: "
                + ", ".join(f"{k} {v:.4g}" for k, v in row[name].items())
                + f" (load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
        rounds.append(row)
    median = {
        name: {key: common.median(row[name][key] for row in rounds) for key in rounds[0][name]}
        for name in ("lmzoo", "torch")
    }
    wall_ratio = median["lmzoo"]["wall_s"] / median["torch"]["wall_s"]
    rss_ratio = median["lmzoo"]["peak_rss_mib"] / median["torch"]["peak_rss_mib"]
    cpu_ratio = median["lmzoo"]["cpu_s"] / median["torch"]["cpu_s"]
    loss_gap = median["lmzoo"]["val_loss"] - median["torch"]["val_loss"]
    load["end"] = os.getloadavg()[0]
    print(f"\nmedian of {args.rounds} round(s): lmzoo {median['lmzoo']}, torch {median['torch']}")
    print(f"load average (1 min) at start {load['start']:.2f}, at end {load['end']:.2f}")
    print(
        f"CPU time (user + system, not a target; steadier than wall clock when the cores are shared): {cpu_ratio:.3f}x torch"
    )
    print("targets:")
    print(
        f"  equal loss      lmzoo - torch {loss_gap:+.4f}   target <= {LOSS_TOLERANCE}    {verdict(loss_gap <= LOSS_TOLERANCE)}"
    )
    print(
        f"  wall clock      {wall_ratio:.3f}x torch   target <= {TARGETS['wall_ratio']}x  {verdict(wall_ratio <= TARGETS['wall_ratio'])}"
        f" (stretch <= {TARGETS['wall_ratio_stretch']}x: {verdict(wall_ratio <= TARGETS['wall_ratio_stretch'])})"
    )
    print(
        f"  peak RSS        {rss_ratio:.3f}x torch   target <= {TARGETS['rss_ratio']}x {verdict(rss_ratio <= TARGETS['rss_ratio'])}"
    )
    record = {
        "bench": "shakespeare_e2e",
        "matmul_peak_gflops": peak,
        "rounds": rounds,
        "median": median,
        "wall_ratio": wall_ratio,
        "rss_ratio": rss_ratio,
        "cpu_ratio": cpu_ratio,
        "loss_gap": loss_gap,
        "load_average": load,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
