"""A/B of two settings of lmzoo's train step: each side in a process of its own, timed in alternating rounds.

    python bench/step_ab.py --b model.scan_layers=True                      # A: the config as it is
    python bench/step_ab.py --config=configs/default.py --a model.remat_policy=none --b model.remat_policy=full
    python bench/step_ab.py --b_env XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=   # an environment change
    python bench/step_ab.py --b_tree ../lmzoo-other                          # a code change: another checkout

A side is the production train step (`compile_trainer`, as train.py runs it) of a decoder config (default
configs/shakespeare_char.py; any `FILE[:variant]` whose model takes the causal_lm objective, such as gpt2) on one
fixed random batch of the config's shape. Each side is built in a spawned process set up as train.py sets up its
own, with:
  --a/--b KEY=VALUE        config overrides, as train.py's --config.KEY=VALUE (repeatable);
  --a_env/--b_env N=V      environment variables of that side's process (read at its start: XLA_FLAGS,
                           GLIBC_TUNABLES, ...; repeatable);
  --a_tree/--b_tree DIR    a checkout (e.g. a `git worktree` of another commit) whose lmzoo and bench modules
                           that side imports instead of this one's.
Each round times --steps steps of each side, alternating which goes first. The report gives per-round ms/step (wall,
and CPU time of the side's process, which other processes on the machine disturb less), the median of the rounds,
and the median of each round's A/B ratio (> 1: B is faster): the machine's speed drifts between rounds, so each
round's ratio is taken before the median. The load average is printed because the cores may be shared. The last line
is the whole record as JSON.
"""

import argparse
import ast
import contextlib
import json
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("STEP_AB_TREE") or str(REPO))  # a side's --a_tree/--b_tree, else this checkout

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from lmzoo import config as config_lib  # noqa: E402
from lmzoo import models  # noqa: E402
from lmzoo.objectives import tasks  # noqa: E402


def parse_value(text: str, current):
    """`text` as a value of the type of the field's `current` value (a Python literal where that fits)."""
    if isinstance(current, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{text!r} is not a boolean")
        return text.lower() in ("true", "1")
    if isinstance(current, str):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    if isinstance(current, float) and isinstance(value, int):
        return float(value)
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    return value


def apply_overrides(config: ml_collections.ConfigDict, overrides: list[str]) -> ml_collections.ConfigDict:
    """Sets each `KEY=VALUE` (`model.num_layers=2`; a leading `--config.` or `config.` is dropped) on `config`."""
    for item in overrides:
        key, sep, text = item.removeprefix("--").removeprefix("config.").partition("=")
        if not sep:
            raise ValueError(f"override {item!r}: expected KEY=VALUE, e.g. model.scan_layers=True")
        *sections, field = key.split(".")
        node = config
        for name in sections:
            if not isinstance(node.get(name), ml_collections.ConfigDict):
                raise ValueError(f"override {item!r}: no section {name!r}; sections: {sorted(node.keys())}")
            node = node[name]
        if field not in node:
            raise ValueError(f"override {item!r}: no field {field!r}; fields: {sorted(node.keys())}")
        node[field] = parse_value(text, node[field])
    return config


def load_config(spec: str, overrides: list[str]) -> ml_collections.ConfigDict:
    path, _, variant = spec.partition(":")
    return apply_overrides(config_lib.load_config_file(path, variant or None), overrides)


class Side:
    """One side's train step on a fixed random batch; `run(steps)` returns (wall s, CPU s) of those steps."""

    def __init__(self, spec: str, overrides: list[str]):
        config = load_config(spec, overrides)
        b, t = config.train.batch_size, config.data.seq_len
        tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (b, t + 1), dtype=np.int32)
        batch = common.next_token_batch(tokens)
        model = models.build_model(config.model_name, config.model.to_dict())
        self.trainer = common.LmzooTrainer(tasks.causal_lm_task(model), batch, config.optim)
        self.loss = None

    def run(self, steps: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        self.trainer.run(steps)
        self.loss = self.trainer.loss
        return time.perf_counter() - wall, time.process_time() - cpu


def build_side(spec: str, overrides: list[str]) -> Side:
    return Side(spec, overrides)


@contextlib.contextmanager
def environment(settings: dict[str, str]):
    """`os.environ` with `settings` while a side's process is spawned (it inherits them)."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def side_environment(pairs: list[str], tree: str | None) -> dict[str, str]:
    settings = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"environment setting {pair!r}: expected NAME=VALUE")
        settings[name] = value
    if tree:
        root = pathlib.Path(tree).resolve()
        if not (root / "lmzoo").is_dir() or not (root / "bench" / "common.py").is_file():
            raise ValueError(f"--*_tree {tree!r}: not an lmzoo checkout (no lmzoo/ or bench/common.py)")
        settings["STEP_AB_TREE"] = str(root)
    return settings


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "shakespeare_char.py"), help="FILE[:variant]")
    for side in ("a", "b"):
        parser.add_argument(
            f"--{side}",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"config override of side {side.upper()} (repeatable)",
        )
        parser.add_argument(
            f"--{side}_env",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help=f"environment variable of side {side.upper()}'s process (repeatable)",
        )
        parser.add_argument(
            f"--{side}_tree", default=None, metavar="DIR", help=f"checkout whose lmzoo side {side.upper()} imports"
        )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    sides = {
        name: {
            "overrides": getattr(args, name),
            "env": side_environment(getattr(args, f"{name}_env"), getattr(args, f"{name}_tree")),
        }
        for name in ("a", "b")
    }
    if sides["a"] == sides["b"]:
        print("note: A and B are the same setting (an A/A run: the ratios show the noise)", flush=True)
    for side in sides.values():
        load_config(args.config, side["overrides"])  # a bad key or value fails here, before anything is built
    config = load_config(args.config, [])
    label = " vs ".join(
        f"{name.upper()}[{' '.join(s['overrides'] + [f'{k}={v}' for k, v in s['env'].items()]) or 'as is'}]"
        for name, s in sides.items()
    )
    load = common.announce(
        "step_ab", f"{args.config}: {label}", f"B={config.train.batch_size} T={config.data.seq_len}", args.rounds
    )
    peak = common.print_matmul_peak()
    trainers = {}
    for name, side in sides.items():
        with environment(side["env"]):
            trainers[name] = common.Isolated(build_side, args.config, side["overrides"])
        trainers[name].run(1)  # compiles the step and keeps its buffers mapped, as the loop does after its first step
    print(f"loss after 1 step: A {trainers['a'].loss:.6f}, B {trainers['b'].loss:.6f}")
    ms = {name: [] for name in trainers}
    cpu_ms = {name: [] for name in trainers}
    for r in range(args.rounds):
        for name in list(trainers) if r % 2 == 0 else list(trainers)[::-1]:
            wall, cpu = trainers[name].run(args.steps)
            ms[name].append(1e3 * wall / args.steps)
            cpu_ms[name].append(1e3 * cpu / args.steps)
        print(
            f"  round {r + 1}: A {ms['a'][-1]:.2f} ms/step (CPU {cpu_ms['a'][-1]:.2f}), "
            f"B {ms['b'][-1]:.2f} ms/step (CPU {cpu_ms['b'][-1]:.2f}), load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    losses = {name: trainer.loss for name, trainer in trainers.items()}
    for trainer in trainers.values():
        trainer.close()
    median = {name: common.median(values) for name, values in ms.items()}
    cpu_median = {name: common.median(values) for name, values in cpu_ms.items()}
    ratio = common.median(a / b for a, b in zip(ms["a"], ms["b"], strict=True))
    cpu_ratio = common.median(a / b for a, b in zip(cpu_ms["a"], cpu_ms["b"], strict=True))
    print(f"median ms/step: A {median['a']:.2f}, B {median['b']:.2f}; rounds' A/B median {ratio:.3f}")
    print(f"median CPU ms/step: A {cpu_median['a']:.2f}, B {cpu_median['b']:.2f}; rounds' A/B median {cpu_ratio:.3f}")
    print(f"loss after all steps: A {losses['a']:.6f}, B {losses['b']:.6f}")
    load["end"] = os.getloadavg()[0]
    record = {
        "bench": "step_ab",
        "config": args.config,
        "sides": sides,
        "rounds": args.rounds,
        "steps": args.steps,
        "matmul_peak_gflops": peak,
        "ms_per_step": ms,
        "median_ms": median,
        "a_over_b": ratio,
        "cpu_ms_per_step": cpu_ms,
        "cpu_median_ms": cpu_median,
        "cpu_a_over_b": cpu_ratio,
        "loss": losses,
        "load_average": load,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
