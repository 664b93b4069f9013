"""nanoGPT's CPU recipe end to end: lmzoo's `train.py` against nanoGPT's own `train.py` (or the independent
PyTorch run), as a user waits for them.

    python bench/shakespeare_e2e.py --nanogpt_dir=NANOGPT [--rounds 2]   # a checkout of karpathy/nanoGPT
    python bench/shakespeare_e2e.py [--rounds 1] [--seed 0]              # bench/shakespeare_torch_reference.py

Each round runs, as subprocesses in alternating order, `python train.py --config=configs/shakespeare_char.py`
(fresh workdir) and the reference: with --nanogpt_dir, nanoGPT's `train.py` with its README's CPU command
(`config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64
--batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`) in a
scratch copy of the checkout whose data its own `prepare.py` made from ../shared's input.txt; without it,
`python bench/shakespeare_torch_reference.py --mode independent` (nanoGPT's eager step). Measured per process:
whole wall clock (startup, data, compile, training, evaluations) and peak RSS (`wait4`'s ru_maxrss) and CPU time;
parsed from their output: the final validation loss (lmzoo and the torch reference: the whole split; nanoGPT: its
20-batch estimate, reported, not compared). Prints PASS/MISS for the issue's targets: lmzoo wall clock <= 1.0x the
reference's (stretch 0.8x), peak memory <= 1.25x, and against the torch reference lmzoo's loss within
LOSS_TOLERANCE of its.
"""

import argparse
import json
import os
import pathlib
import re
import shutil
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
LOSS_PATTERNS = {  # the last match in the output is the final validation loss
    "lmzoo": re.compile(r"final validation .*?\bloss ([0-9.]+)"),
    "torch": re.compile(r"whole-split val loss ([0-9.]+)"),
    "nanogpt": re.compile(r"step \d+: train loss [0-9.]+, val loss ([0-9.]+)"),
}
NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")
NANOGPT_CPU_FLAGS = (  # nanoGPT's README, "I only have a macbook": the baby GPT on the CPU
    "--device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 "
    "--n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0"
).split()


def nanogpt_workspace(checkout: pathlib.Path, scratch: pathlib.Path) -> pathlib.Path:
    """A copy of nanoGPT's training files with data/shakespeare_char made by its own prepare.py from our input.txt
    (present, so it downloads nothing); not timed."""
    for name in (*NANOGPT_FILES, "data/shakespeare_char/prepare.py"):
        (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(checkout / name, scratch / name)
    shutil.copy(DATA, scratch / "data" / "shakespeare_char" / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=scratch / "data" / "shakespeare_char", check=True)
    return scratch


def command(name: str, workdir: str, seed: int) -> list[str]:
    if name == "lmzoo":
        return [
            sys.executable,
            "train.py",
            "--config=configs/shakespeare_char.py",
            f"--workdir={workdir}",
            f"--config.data.path={DATA}",
        ]
    if name == "nanogpt":
        return [
            sys.executable,
            "train.py",
            "config/train_shakespeare_char.py",
            *NANOGPT_CPU_FLAGS,
            f"--out_dir={workdir}",
        ]
    return [sys.executable, "bench/shakespeare_torch_reference.py", "--mode", "independent", "--seed", str(seed)]


def run(name: str, seed: int, log_path: pathlib.Path, extra_env: dict[str, str], cwd: pathlib.Path = ROOT) -> dict:
    """Runs one side to completion in `cwd`, its output to `log_path`; returns wall seconds, peak RSS (MiB), CPU
    seconds (user + system, all threads) and the final validation loss."""
    with tempfile.TemporaryDirectory() as workdir, open(log_path, "w+") as log:
        env = dict(os.environ, PYTHONPATH=str(ROOT), **extra_env)
        start = time.perf_counter()
        process = subprocess.Popen(command(name, workdir, seed), cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
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
    parser.add_argument("--nanogpt_dir", type=pathlib.Path, help="a nanoGPT checkout: its train.py is the reference")
    args = parser.parse_args()
    reference = "nanogpt" if args.nanogpt_dir else "torch"
    against = "nanoGPT's train.py" if args.nanogpt_dir else "torch --mode independent"
    load = common.announce("shakespeare_e2e", "configs/shakespeare_char.py", f"train.py vs {against}", args.rounds)
    scratch = tempfile.TemporaryDirectory()
    cwd = {"lmzoo": ROOT, "torch": ROOT}
    if args.nanogpt_dir:
        cwd["nanogpt"] = nanogpt_workspace(args.nanogpt_dir.resolve(), pathlib.Path(scratch.name))
    peak = common.print_matmul_peak()
    log_dir = pathlib.Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {"lmzoo": {}, reference: {}}
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
        for name in ("lmzoo", reference) if r % 2 == 0 else (reference, "lmzoo"):
            row[name] = run(name, args.seed, log_dir / f"shakespeare_e2e_{name}_{r + 1}.log", env[name], cwd[name])
            print(
                f"  round {r + 1} {name}: "
                + ", ".join(f"{k} {v:.4g}" for k, v in row[name].items())
                + f" (load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
        rounds.append(row)
    median = {
        name: {key: common.median(row[name][key] for row in rounds) for key in rounds[0][name]}
        for name in ("lmzoo", reference)
    }
    wall_ratio = median["lmzoo"]["wall_s"] / median[reference]["wall_s"]
    rss_ratio = median["lmzoo"]["peak_rss_mib"] / median[reference]["peak_rss_mib"]
    cpu_ratio = median["lmzoo"]["cpu_s"] / median[reference]["cpu_s"]
    loss_gap = median["lmzoo"]["val_loss"] - median[reference]["val_loss"]
    load["end"] = os.getloadavg()[0]
    print(f"\nmedian of {args.rounds} round(s): lmzoo {median['lmzoo']}, {reference} {median[reference]}")
    print(f"load average (1 min) at start {load['start']:.2f}, at end {load['end']:.2f}")
    print(
        f"CPU time (user + system, not a target; steadier than wall clock when the cores are shared): "
        f"{cpu_ratio:.3f}x {reference}"
    )
    print("targets:")
    if reference == "torch":
        print(
            f"  equal loss      lmzoo - torch {loss_gap:+.4f}   target <= {LOSS_TOLERANCE}    "
            f"{common.verdict(loss_gap <= LOSS_TOLERANCE)}"
        )
    else:
        print(f"  loss            lmzoo whole split - nanoGPT's 20-batch estimate {loss_gap:+.4f} (not a target)")
    print(
        f"  wall clock      {wall_ratio:.3f}x {reference}   target <= {TARGETS['wall_ratio']}x  "
        f"{common.verdict(wall_ratio <= TARGETS['wall_ratio'])}"
        f" (stretch <= {TARGETS['wall_ratio_stretch']}x: {common.verdict(wall_ratio <= TARGETS['wall_ratio_stretch'])})"
    )
    print(
        f"  peak RSS        {rss_ratio:.3f}x {reference}   target <= {TARGETS['rss_ratio']}x "
        f"{common.verdict(rss_ratio <= TARGETS['rss_ratio'])}"
    )
    scratch.cleanup()
    record = {
        "bench": "shakespeare_e2e",
        "reference": reference,
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
