"""Where the time of lmzoo's train step goes, at the Shakespeare-char shape (B 12, T 64, D 128, 4 layers).

    python bench/step_profile.py [--config=configs/shakespeare_char.py] [--steps 30]

Prints (1) forward, forward+backward and the production train step (min and median ms over
interleaved repeats), (2) the op time of forward and of forward+backward by op kind (XNNPACK
matmuls, Eigen dots, loop fusions), which shows where backward's extra time goes, and (3) an XLA profile of the train step: the op time (summed over XLA's
threads) of every compiled HLO op, grouped by the module its metadata names (attention, MLP,
LayerNorm, embeddings, head + loss, optimizer), plus the 12 most
expensive ops. Op names ending in `_fusion` are loop fusions; `ynn_fusion` / `dot` are matmuls.
"""

import argparse
import collections
import glob
import json
import os
import pathlib
import re
import sys
import tempfile

import jax
import numpy as np
from jax._src.lib import _profile_data

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from lmzoo import config as config_lib  # noqa: E402
from lmzoo import models  # noqa: E402
from lmzoo.kernels import host_memory  # noqa: E402
from lmzoo.objectives import tasks  # noqa: E402

PARTS = [  # (group, pattern on the op's metadata name), first match wins
    ("head + loss", r"fused_head_loss|causal_lm|output_embedding"),
    ("attention q/k/v/out", r"/attn/(query|key|value|out)/"),
    ("attention core", r"/attn/"),
    ("mlp", r"/mlp/"),
    ("layernorm", r"/ln_"),
    ("embeddings", r"/wte/|/wpe/|GPT2/add"),
]


def op_metadata(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its metadata op_name (the jaxpr path, e.g. transpose(jvp(GPT2))/blocks/...)."""
    pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = .*?op_name=\"([^\"]*)\"")
    return {m.group(1): m.group(2) for m in map(pattern.match, hlo_text.splitlines()) if m}


def classify(op_name: str) -> str:
    """The module an op belongs to, from its metadata name. A fusion carries its root op's name, so
    forward and backward cannot be told apart reliably (a backward fusion often ends in a forward op).
    Differentiated ops outside the model's module (`jvp(...)` without `GPT2`) are the fused head + loss,
    whose custom VJP names its chunk loop `jvp()/while`; the rest outside the model is the optimizer."""
    if "GPT2" not in op_name and "head_loss" not in op_name:
        return "head + loss" if "jvp(" in op_name else "optimizer + other"
    return next((group for group, pattern in PARTS if re.search(pattern, op_name)), "other model ops")


def op_kind(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> what runs it: an XNNPACK matmul (`ynn_fusion`), an Eigen `dot`, a loop fusion
    (elementwise work and reductions), or another op."""
    pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = \S+ ([\w-]+)\(")
    kinds = {}
    for match in map(pattern.match, hlo_text.splitlines()):
        if match:
            name, opcode = match.groups()
            if "ynn_fusion" in name:
                kinds[name] = "matmul (XNNPACK)"
            elif opcode == "dot":
                kinds[name] = "matmul (Eigen dot)"
            else:
                kinds[name] = "loop fusion (elementwise, reductions)" if opcode == "fusion" else f"other ({opcode})"
    return kinds


def profile(run) -> _profile_data.ProfileData:
    """The jax.profiler trace of `run()`: planes (host threads, devices) of lines of timed events."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            run()
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        return _profile_data.ProfileData.from_file(path)


def op_ms(run, names, steps: int) -> collections.Counter:
    """Per-step time (ms, summed over threads) of each compiled op in `names`, from a jax.profiler trace of `run(steps)`."""
    op_ns = collections.Counter()
    for plane in profile(lambda: run(steps)).planes:
        for line in plane.lines:
            for event in line.events:
                if event.name in names:
                    op_ns[event.name] += event.duration_ns
    return collections.Counter({name: ns / steps / 1e6 for name, ns in op_ns.items()})


def profile_ops(run, hlo_text: str, steps: int) -> tuple[dict, list]:
    """Per-step op time (ms) by module and the top ops, from a jax.profiler trace of `run(steps)`."""
    metadata = op_metadata(hlo_text)
    times = op_ms(run, metadata, steps)
    groups = collections.Counter()
    for name, ms in times.items():
        groups[classify(metadata[name])] += ms
    top = [(name, ms, metadata[name]) for name, ms in times.most_common(12)]
    return dict(groups), top


def profile_by_kind(fn, arg, steps: int) -> tuple[dict, int]:
    """Per-call op time (ms) of jitted `fn(arg)` by op kind (`op_kind`), and how many distinct ops ran."""
    kinds = op_kind(fn.lower(arg).compile().as_text())
    times = op_ms(lambda n: [jax.block_until_ready(fn(arg)) for _ in range(n)], kinds, steps)
    by_kind = collections.Counter()
    for name, ms in times.items():
        by_kind[kinds[name]] += ms
    return dict(by_kind), len(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", default=str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.py")
    )
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    host_memory.set_up_process()  # as train.py runs its steps
    config = config_lib.load_config_file(args.config)
    load = common.announce(
        "step_profile", args.config, f"B={config.train.batch_size} T={config.data.seq_len}", args.steps
    )
    peak = common.print_matmul_peak()
    b, t = config.train.batch_size, config.data.seq_len
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (b, t + 1), dtype=np.int32)
    batch = common.next_token_batch(tokens)
    task = tasks.causal_lm_task(models.build_model(config.model_name, config.model.to_dict()))
    trainer = common.LmzooTrainer(task, batch, config.optim)
    params, rng = trainer.state.params, jax.random.key(0)

    def loss(p):
        return task.loss(p, {}, {}, batch, rng, step=0, train=True)[0]

    forward, forward_backward = jax.jit(loss), jax.jit(jax.grad(loss))
    with trainer.compiled.context():
        timings = common.interleaved_ms(
            {"forward": (forward, params), "forward+backward": (forward_backward, params)}, args.steps
        )
        by_kind = {  # before the train steps, which donate (delete) these params
            name: profile_by_kind(fn, params, args.steps)
            for name, fn in (("forward", forward), ("forward+backward", forward_backward))
        }
    timings["train step"] = common.interleaved_ms({"train step": (lambda: trainer.run(1), None)}, args.steps)[
        "train step"
    ]
    for name, (fastest, median) in timings.items():
        print(f"{name:>18}: min {fastest:7.2f} ms, median {median:7.2f} ms")
    print(f"backward/forward (min): {timings['forward+backward'][0] / timings['forward'][0] - 1:.2f}")

    print("\nop time per call by kind (summed over threads), forward | forward+backward:")
    for kind in sorted(set(by_kind["forward"][0]) | set(by_kind["forward+backward"][0])):
        print(
            f"  {kind:<40} {by_kind['forward'][0].get(kind, 0.0):7.2f} | {by_kind['forward+backward'][0].get(kind, 0.0):7.2f} ms"
        )
    print(
        f"  {'total':<40} {sum(by_kind['forward'][0].values()):7.2f} | {sum(by_kind['forward+backward'][0].values()):7.2f} ms"
        f"  ({by_kind['forward'][1]} | {by_kind['forward+backward'][1]} ops)"
    )

    hlo_text = trainer.compiled.step.lower(trainer.state, trainer.batch).compile().as_text()
    groups, top = profile_ops(trainer.run, hlo_text, args.steps)
    total = sum(groups.values())
    print(f"\nop time per train step (summed over threads): {total:.2f} ms")
    for part, ms in sorted(groups.items(), key=lambda item: -item[1]):
        print(f"  {part:<20} {ms:7.2f} ms {ms / total:6.1%}")
    print("top ops:")
    for name, ms, op_name in top:
        print(f"  {ms:7.2f} ms  {name:<28} {op_name[-90:]}")
    load["end"] = os.getloadavg()[0]
    record = {
        "bench": "step_profile",
        "config": args.config,
        "matmul_peak_gflops": peak,
        "timings_ms": timings,
        "load_average": load,
        "op_ms": groups,
        "op_ms_by_kind": {name: kinds for name, (kinds, _) in by_kind.items()},
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
