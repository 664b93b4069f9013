"""Every device number in one command on one accelerator, written as one JSON file, in under 8 minutes.

    python bench/device_suite.py --out results/ --nanogpt_dir=NANOGPT [--store=STORE] [--budget_s=480]
    python bench/device_suite.py --tiny --out /tmp/suite      # every part at toy size on the CPU (CI runs this)

The parts run in this order, each in a process of its own with a time limit:

    env             versions (python, jax, jaxlib, flax, optax, torch, the CUDA plugin), the device, its count, the
                    driver, the bf16 matmul peak measured here and the datasheet's (bench/gpu_recipe.py)
    gpu_tests       tests/test_gpu.py under pytest: each test's outcome (its tests skip without a GPU)
    tokens          the token store both GPT-2 trainers read: --store (GPT-2 BPE, as bench/gpu_recipe.py takes),
                    else this Python's standard library sources, byte-level (`python -m lmzoo.data.prepare`)
    gpt2_lmzoo      lmzoo's `train.py --config=configs/gpt2_124m.py` on those tokens (bench/gpu_recipe.py)
    gpt2_nanogpt    nanoGPT's own `train.py` on the same tokens (bench/gpu_recipe.py): a checkout the user gives as
                    --nanogpt_dir (nothing is downloaded); skipped without one
    llama_1b        the train step of `configs/llama.py:llama3_1b` (Llama 3.2 1B's shape) on random tokens
    load            bench/load_bench.py onto the accelerator: a random 0.98 GB bf16 Llama through `hf:` and its
                    converted `ckpt:`, load time and peak host RSS against reading the files
    bert_base       the MLM step of BERT-base's shape (configs/bert.py's recipe at 12 x 768, 15% masked)
    t5_base         the span-corruption step of `configs/t5.py:base` (t5-base's shape)
    steps_per_call  configs/default.py's step, one step a call against 10, dispatched as train.py's loop does

The parts that train record tokens/s, the loss (train.py's and nanoGPT's at each logged step, a step's after its
last timed call), their FLOPs a token, from which the suite adds TFLOP/s and MFU against the bf16 matmul peak `env`
measured and the datasheet peak as bench/gpu_recipe.py does, and their process's peak device memory
(`memory_stats()`; None on the CPU, and for nanoGPT, which does not report it). The steps (bench/gpu_step.py's
`StepRunner`) are the production `SupervisedTrainer` through `compile_trainer`, timed as the best of a few calls
after the compiling one; train.py's and nanoGPT's tokens/s are their steady windows' medians.

The budget (`--budget_s`, 8 minutes) is shared out as the parts run: each gets its weight's share of what is left,
at least the time it needs and no more than leaves the later parts theirs; a part that needs more than is left is
skipped with that reason, one that fails or overruns its limit records its error, and the suite goes on. OUT gets
device_suite.json (rewritten after each part) and device_suite.log (every part's output); the scratch (the store,
the workdirs) goes to --work, a temporary folder removed at the end by default. Exit status 0 when every part ran
or was skipped, 1 when one failed (GPU test failures are results: counted, not failures of the suite). `--tiny`:
toy shapes and a few steps of every part, on the CPU in 1-2 minutes on 2 cores; its numbers check that the script
works, they measure nothing.
"""

import argparse
import dataclasses
import faulthandler
import json
import math
import os
import pathlib
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUITE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(ROOT))

from bench import gpu_recipe  # noqa: E402  (numpy only: this process never starts a JAX backend)

VERSIONS = (
    "jax",
    "jaxlib",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "libtpu",
    "flax",
    "optax",
    "orbax-checkpoint",
    "numpy",
    "ml_collections",
    "nvidia-cudnn-cu12",
    "torch",
    "triton",
)
GPT2_TARGET = 1.1  # lmzoo's GPT-2 124M tokens/s through train.py over nanoGPT's (issue 39)
INNER_MARGIN_S = 10.0  # a part's inner run (train.py, nanoGPT, pytest) stops this long before the part's limit
BYTE_STORE_CHARS = {True: 200_000, False: 12_000_000}  # standard library text for the byte-level store (tiny, not)


# --- what each part runs, in its own process -------------------------------------------------------------------------


def peak_memory() -> dict | None:
    """This process's peak memory on its first device (`memory_stats()`): None where the backend keeps none (CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats()
    if not stats:
        return None
    peak, limit = stats.get("peak_bytes_in_use"), stats.get("bytes_limit")
    return {
        "peak_bytes_in_use": peak,
        "bytes_limit": limit,
        "peak_gib": peak / 2**30 if peak is not None else None,
    }


def run_train(memory_file: str, argv: list[str]) -> None:
    """train.py with `argv` ([script, flags...]) in this process, then its peak device memory to `memory_file`."""
    import runpy

    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        try:
            memory = peak_memory()
        except Exception as e:  # the backend never started, or would not
            memory = {"error": f"{type(e).__name__}: {e}"}
        pathlib.Path(memory_file).write_text(json.dumps(memory))


def part_env(args) -> dict:
    import jax

    versions = {"python": platform.python_version()}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    record = {"versions": versions, **gpu_recipe.device_peaks(args.tiny)}
    record["platform_version"] = getattr(jax.devices()[0].client, "platform_version", None)
    record["nvidia_smi"] = command_output(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"]
    )
    record["git_commit"] = command_output(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    record["cpu_count"] = os.cpu_count()
    record["peak_memory"] = peak_memory()
    return record


def command_output(command: list[str]) -> str | None:
    """The stripped output of `command`, None where it cannot run or fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def part_gpu_tests(args) -> dict:
    """tests/test_gpu.py: the counts and each test's outcome, from pytest's JUnit XML."""
    import xml.etree.ElementTree as ElementTree

    report = args.work / "gpu_tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    code, wall = gpu_recipe.run_logged(
        [*command, f"--junitxml={report}"], ROOT, args.work / "gpu_tests.pytest.log", inner_timeout(args)
    )
    tests, counts = [], dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    if report.is_file():
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            outcome, message = "passed", None
            for child, name in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
                found = case.find(child)
                if found is not None:
                    outcome, message = name, (found.get("message") or "")[:300]
            counts[outcome] += 1
            tests.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0))})
            if message:
                tests[-1]["message"] = message
    # pytest's own status: 0 all passed or skipped, 1 a test failed (a result, recorded), others a broken run; a run
    # that reports no test at all is broken whatever its status
    broken = code not in (0, 1) or not tests
    return {"exit": (code or 1) if broken else 0, "pytest_exit": code, "wall_s": wall, **counts, "tests": tests}


def part_tokens(args) -> dict:
    """The store the GPT-2 parts read: --store as given, else the standard library's sources byte-level."""
    from lmzoo.data import store as store_lib

    if args.store:
        folder, source = args.store, f"--store {args.store}"
    else:
        folder, source = args.work / "store", byte_level_source(args.work / "stdlib.jsonl", args.tiny)
        if folder.exists():
            shutil.rmtree(folder)
        command = [sys.executable, "-m", "lmzoo.data.prepare", f"--source={args.work / 'stdlib.jsonl'}"]
        command += [f"--out={folder}", "--tokenizer=byte", "--validation_fraction=0.05", "--document_unit=file"]
        code, _ = gpu_recipe.run_logged(command, ROOT, args.work / "tokens.prepare.log", inner_timeout(args))
        if code != 0:
            return {"exit": code, "source": source}
    opened = store_lib.open_store(folder)
    counts = {split: info["tokens"] for split, info in opened.manifest["splits"].items()}
    return {
        "exit": 0,
        "store": str(folder),
        "source": source,
        "tokens": counts,
        "vocab_size": opened.manifest["vocab_size"],
    }


def byte_level_source(path: pathlib.Path, tiny: bool) -> str:
    """This Python's standard library .py files, in path order, as one .jsonl of documents (one a file) up to
    BYTE_STORE_CHARS characters, leaving out files over an eighth of that (so the held-out last 5% of the files are
    about 5% of the text); returns what it holds."""
    import sysconfig

    library = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chars, files, limit = 0, 0, BYTE_STORE_CHARS[tiny]
    with open(path, "w") as out:
        for file in sorted(library.glob("**/*.py")):
            if chars >= limit or "site-packages" in file.parts:
                continue
            try:
                text = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if len(text) > limit // 8:
                continue
            out.write(json.dumps({"text": text}) + "\n")
            chars, files = chars + len(text), files + 1
    return f"{files} .py files of {library} (Python {platform.python_version()}), {chars:,} characters, byte-level"


def part_gpt2_lmzoo(args) -> dict:
    memory = args.work / "gpt2_lmzoo.memory.json"
    steps, log_every = (3, 1) if args.tiny else (9, 3)
    record = gpu_recipe.lmzoo_run(
        args.store,
        args.work / "gpt2_lmzoo",
        args.work / "gpt2_lmzoo.train.log",
        steps=steps,
        log_every=log_every,
        steps_per_call=1,
        timeout=inner_timeout(args),
        tiny=args.tiny,
        overrides=("--config.train.sample_tokens=0", "--config.eval.max_batches=4"),
        python=(sys.executable, str(SUITE), "--run_train", str(memory)),
    )
    record["flops_per_token"] = gpu_recipe.recipe_flops_per_token(args.tiny)
    record["steady"] = "median tokens/s of the logged windows after the first (which holds the compilation)"
    record["peak_memory"] = json.loads(memory.read_text()) if memory.is_file() else None
    return record


def part_gpt2_nanogpt(args) -> dict:
    data = args.work / "nanogpt_data"
    counts = gpu_recipe.write_nanogpt_data(args.store, data)
    record = gpu_recipe.nanogpt_run(
        args.nanogpt_dir,
        data,
        args.work / "nanogpt_out",
        args.work / "gpt2_nanogpt.train.log",
        iters=3 if args.tiny else 10,
        timeout=inner_timeout(args),
        tiny=args.tiny,
    )
    record["data_tokens"] = counts
    record["flops_per_token"] = gpu_recipe.recipe_flops_per_token(args.tiny)
    record["steady"] = "median iteration time after the first 5 (which hold torch.compile)"
    record["peak_memory"] = None  # nanoGPT's train.py does not report it
    return record


def step_record(runner, calls: int, flops_per_token: float, **fields) -> dict:
    """`runner`'s timing (`StepRunner.time`) with the FLOPs a token and `fields`, and the peak device memory."""
    return {**fields, **runner.time(calls), "flops_per_token": flops_per_token, "peak_memory": peak_memory()}


def parameter_count(compiled) -> int:
    import jax

    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(compiled.abstract_state.params))


def load_config(name: str, variant: str | None):
    from lmzoo import config as config_lib

    return config_lib.load_config_file(ROOT / "configs" / name, variant)


def part_llama_1b(args) -> dict:
    """Llama 3.2 1B's shape (its parameters counted abstractly even with --tiny, where a toy of the variant runs)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench import common, gpu_step
    from lmzoo import models
    from lmzoo.objectives import tasks

    config = load_config("llama.py", "llama3_1b")
    full = models.build_model("llama", config.model.to_dict())
    shapes = jax.eval_shape(lambda: full.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    variant_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))
    if args.tiny:
        config.model.update(vocab_size=512, emb_dim=64, num_heads=4, num_kv_heads=2, num_layers=2, mlp_dim=128)
    m = config.model
    batch_size, length = (2, 32) if args.tiny else (8, 4096)
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (batch_size, length + 1), dtype=np.int32)
    runner = gpu_step.StepRunner(
        tasks.causal_lm_task(models.build_model("llama", m.to_dict())), config.optim, common.next_token_batch(tokens)
    )
    params = parameter_count(runner.compiled)
    head_size = m.head_dim or m.emb_dim // m.num_heads
    per_token = 6 * params + 12 * m.num_layers * m.num_heads * head_size * length  # tied head: counted once, in N
    shape = f"{batch_size} x {length} tokens a step, {m.num_layers} layers, D {m.emb_dim}, vocabulary {m.vocab_size}"
    return step_record(
        runner, 2 if args.tiny else 4, per_token, params=params, variant_params=variant_params, shape=shape
    )


def part_load(args) -> dict:
    """bench/load_bench.py on this accelerator (--tiny: its toy checkpoint on 8 simulated CPU devices): a random
    0.98 GB bf16 Llama loaded through `hf:` and its converted `ckpt:`, time and peak host RSS against the reads."""
    out = args.work / "load_bench.json"
    command = [sys.executable, "bench/load_bench.py", "--rounds=1", f"--scratch={args.work}", f"--json={out}"]
    command += ["--tiny", "--platforms=cpu"] if args.tiny else ["--platforms=accelerator"]
    code, wall = gpu_recipe.run_logged(command, ROOT, args.work / "load.bench.log", inner_timeout(args))
    record = json.loads(out.read_text()) if out.is_file() else {}
    return {"exit": code, "wall_s": wall, **record}


def part_bert_base(args) -> dict:
    """MLM (RoBERTa's objective, no sentence head) at BERT-base's shape with configs/bert.py's recipe (dropout 0.1):
    [CLS] random word pieces [SEP] rows, 15% of each masked as BERT does; logits only at the masked positions."""
    import numpy as np

    from bench import gpu_step
    from lmzoo import models
    from lmzoo.data import transforms
    from lmzoo.objectives import tasks

    config = load_config("bert.py", "bert,tiny" if args.tiny else "bert")
    if not args.tiny:
        config.model.update(emb_dim=768, num_heads=12, num_layers=12, mlp_dim=3072, max_len=512)
    config.model.update(pooler=False, sentence_head=False)
    m = config.model
    batch_size, length = (4, m.max_len) if args.tiny else (32, 512)
    pad, unknown, cls, sep, mask = 0, 100, 101, 102, 103  # bert-base-uncased's special ids
    rng = np.random.default_rng(0)
    words = rng.integers(mask + 1, m.vocab_size, (batch_size, length - 2), dtype=np.int32)
    column = lambda i: np.full((batch_size, 1), i, np.int32)  # noqa: E731
    tokens = np.concatenate([column(cls), words, column(sep)], axis=1)
    batch = transforms.mask_tokens(
        tokens, rng=rng, mask_id=mask, vocab_size=m.vocab_size, special_ids=(pad, unknown, cls, sep, mask)
    )
    runner = gpu_step.StepRunner(
        tasks.masked_lm_task(models.build_model("bert", m.to_dict()), mask_rate=0.15), config.optim, batch
    )
    d, f, layers = m.emb_dim, m.mlp_dim, m.num_layers
    predicted = tasks.num_predictions(length, 0.15) / length  # the share of positions the head runs at
    per_token = (
        6 * layers * (4 * d * d + 2 * d * f) + 12 * layers * d * length + 6 * (d * d + m.vocab_size * d) * predicted
    )
    shape = f"{batch_size} x {length} tokens a step, {layers} layers, D {d}, vocabulary {m.vocab_size}"
    return step_record(runner, 2 if args.tiny else 4, per_token, params=parameter_count(runner.compiled), shape=shape)


def part_t5_base(args) -> dict:
    """configs/t5.py:base (T5 v1.0's base shape) on random span-corruption shaped batches: encoder inputs [B, S]
    and decoder targets [B, T], T from T5's span lengths at S; tokens/s counts encoder and decoder tokens."""
    import numpy as np

    from bench import gpu_step
    from lmzoo import models
    from lmzoo.data import noising
    from lmzoo.objectives import tasks

    config = load_config("t5.py", "tiny,test" if args.tiny else "base")
    cfg = models.make_config("seq2seq", config.model.to_dict())
    batch_size, inputs_len = (4, 32) if args.tiny else (32, 512)
    targets_len = noising.span_corruption_lengths(inputs_len)[1]
    rng = np.random.default_rng(0)
    inputs = rng.integers(2, cfg.vocab_size, (batch_size, inputs_len), dtype=np.int32)
    targets = rng.integers(2, cfg.vocab_size, (batch_size, targets_len), dtype=np.int32)
    start = np.full((batch_size, 1), cfg.decoder_start_id, np.int32)
    batch = {
        "inputs": inputs,
        "encoder_segment_ids": np.ones_like(inputs),
        "targets": targets,
        "decoder_inputs": np.ascontiguousarray(np.concatenate([start, targets[:, :-1]], axis=1)),
        "weights": np.ones(targets.shape, np.float32),
    }
    tokens = batch_size * (inputs_len + targets_len)
    runner = gpu_step.StepRunner(
        tasks.seq2seq_task(models.build_model("seq2seq", cfg)), config.optim, batch, tokens_per_step=tokens
    )
    per_token = seq2seq_step_flops(cfg, batch_size, inputs_len, targets_len) / tokens
    shape = (
        f"{batch_size} x ({inputs_len} encoder + {targets_len} decoder) tokens a step, "
        f"{cfg.num_encoder_layers} + {cfg.num_decoder_layers} layers, D {cfg.emb_dim}, vocabulary {cfg.vocab_size}"
    )
    return step_record(runner, 2 if args.tiny else 4, per_token, params=parameter_count(runner.compiled), shape=shape)


def seq2seq_step_flops(cfg, batch_size: int, inputs_len: int, targets_len: int) -> float:
    """Train FLOPs of one encoder-decoder step: 6 x the matmul parameters each token passes, plus attention.

    encoder token: 6 (L_e (4 D H + m D F) + L_d 2 D H) + 12 L_e S H  (its block; the decoder's cross-attention K, V)
    decoder token: 6 (L_d (6 D H + m D F) + V D) + 12 L_d (T + S) H  (self q/k/v/o, cross q/o, MLP, tied head)

    with H = heads x head size, m the MLP's matrices (2; 3 gated), S encoder and T decoder positions."""
    d, f, v = cfg.emb_dim, cfg.mlp_dim, cfg.vocab_size
    h = cfg.num_heads * (cfg.head_dim or d // cfg.num_heads)
    matrices = len(cfg.activations) + 1
    enc, dec, s, t = cfg.num_encoder_layers, cfg.num_decoder_layers, inputs_len, targets_len
    encoder = 6 * (enc * (4 * d * h + matrices * d * f) + dec * 2 * d * h) + 12 * enc * s * h
    decoder = 6 * (dec * (6 * d * h + matrices * d * f) + v * d) + 12 * dec * (t + s) * h
    return batch_size * (s * encoder + t * decoder)


def part_steps_per_call(args) -> dict:
    """configs/default.py's step (a 4-layer D 128 GPT-2, 16 x 128 tokens), `steps` steps as one step a call and as
    k steps a call, each call's host batch put on the device as train.py's loop does and no wait between calls,
    in alternating rounds; tokens/s of each round and the median speed-up."""
    import numpy as np

    from bench import common, gpu_step
    from lmzoo import models
    from lmzoo.objectives import tasks

    config = load_config("default.py", "tiny" if args.tiny else None)
    k, steps, rounds = (4, 8, 2) if args.tiny else (10, 300, 3)
    tokens = np.random.default_rng(0).integers(
        0, config.model.vocab_size, (config.train.batch_size, config.data.seq_len + 1), dtype=np.int32
    )
    task = tasks.causal_lm_task(models.build_model(config.model_name, config.model.to_dict()))
    runners = {
        f"steps_per_call={n}": gpu_step.StepRunner(
            task, config.optim, common.next_token_batch(tokens), steps_per_call=n
        )
        for n in (1, k)
    }
    compile_s = {name: common.timed(runner.call) for name, runner in runners.items()}
    per_round = []
    for r in range(rounds):
        order = list(runners) if r % 2 == 0 else list(runners)[::-1]
        per_round.append({name: runners[name].throughput(steps // runners[name].steps_per_call) for name in order})
    medians = {name: statistics.median(row[name] for row in per_round) for name in runners}
    off, on = medians["steps_per_call=1"], medians[f"steps_per_call={k}"]
    return {
        "steps_per_call": k,
        "steps_a_measurement": steps,
        "tokens_per_step": config.train.batch_size * config.data.seq_len,
        "compile_and_first_call_s": compile_s,
        "tokens_per_s_by_round": per_round,
        "tokens_per_s": {"off": off, "on": on},
        "speedup": on / off,
        "losses": {name: runner.loss for name, runner in runners.items()},
        "peak_memory": peak_memory(),
    }


def inner_timeout(args) -> float:
    """Seconds a part's inner run (train.py, nanoGPT, pytest, prepare) may take: its limit less a margin."""
    return max(args.limit_s - INNER_MARGIN_S, 1.0)


# --- the parts, their needs and shares -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    run: Callable[[argparse.Namespace], dict]
    need_s: float  # the least it needs on an accelerator (start, compilation and its steps)
    tiny_need_s: float  # the same at --tiny on the CPU
    weight: float  # its share of what is left
    needs_store: bool = False


PARTS = (
    Part("env", part_env, 15, 5, 1.0),
    Part("gpu_tests", part_gpu_tests, 30, 5, 1.0),
    Part("tokens", part_tokens, 20, 5, 1.0),
    Part("gpt2_lmzoo", part_gpt2_lmzoo, 120, 15, 4.0, needs_store=True),
    Part("gpt2_nanogpt", part_gpt2_nanogpt, 100, 10, 4.0, needs_store=True),
    Part("llama_1b", part_llama_1b, 60, 8, 2.5),
    Part("load", part_load, 90, 15, 1.5),
    Part("bert_base", part_bert_base, 45, 8, 1.5),
    Part("t5_base", part_t5_base, 45, 8, 1.5),
    Part("steps_per_call", part_steps_per_call, 30, 8, 1.0),
)
BY_NAME = {part.name: part for part in PARTS}


def allot(left_s: float, need_s: float, weight: float, later: list[tuple[float, float]]) -> float | None:
    """Seconds for a part that needs `need_s` and has `weight`, with `left_s` of the budget left and the later parts'
    (need, weight) `later`: its weight's share of what is left, at least its need, at most what leaves the later parts
    their needs, never more than is left. None (skip) when less than its need is left."""
    if left_s < need_s:
        return None
    share = left_s * weight / (weight + sum(w for _, w in later))
    spare = left_s - sum(n for n, _ in later)
    return min(left_s, max(need_s, min(share, spare)))


# --- the suite --------------------------------------------------------------------------------------------------------


def clean(value):
    """`value` as strict JSON holds it: NaN and infinities as None, tuples as lists, paths as strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if isinstance(value, pathlib.Path):
        return str(value)
    return value


def tail(path: pathlib.Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


def run_part(part: Part, args, limit_s: float, store: pathlib.Path | None) -> dict:
    """Runs `part` in a process of its own (this script with --part), killed at `limit_s` (its inner runs stop
    INNER_MARGIN_S before, so that it reports them); its result, with status ok / error / timeout, wall seconds and
    the limit."""
    result_file, log = args.work / "parts" / f"{part.name}.json", args.work / "logs" / f"{part.name}.log"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, str(SUITE), "--part", part.name, "--work", str(args.work), f"--limit_s={limit_s:.1f}"]
    command += ["--tiny"] if args.tiny else []
    command += [f"--store={store}"] if store else []
    command += [f"--nanogpt_dir={args.nanogpt_dir}"] if args.nanogpt_dir else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    with open(log, "w") as out:
        # a session of its own, so that a part killed at its limit takes its train.py or nanoGPT process with it
        child = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = child.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if child.poll() is None:  # over its limit, or this process interrupted
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    wall = time.perf_counter() - start
    record = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if code is None:
        record.update(status="timeout", error=f"killed at its limit, {limit_s:.0f} s\n{tail(log)}")
    elif code != 0 or "status" not in record:
        record.update(status="error", error=record.get("error") or f"exit status {code}\n{tail(log)}")
    record.update(wall_s=wall, limit_s=limit_s)
    return record


def part_main(args) -> int:
    """In a part's process: runs it and writes its result (status ok, or error with the inner run's log tail)."""
    part = BY_NAME[args.part]
    (args.work / "parts").mkdir(parents=True, exist_ok=True)
    if args.limit_s > 2 * INNER_MARGIN_S:  # a part killed at its limit leaves in its log where each thread was
        faulthandler.dump_traceback_later(args.limit_s - INNER_MARGIN_S / 2)
    try:
        record = part.run(args)
        code = record.get("exit", 0)
        record["status"] = "ok" if code == 0 else ("timeout" if code == 124 else "error")
        if code != 0:
            logs = sorted(args.work.glob(f"{part.name}.*.log"))
            record["error"] = f"inner run exit status {code}\n" + (tail(logs[-1]) if logs else "")
    except Exception as e:
        import traceback

        traceback.print_exc()
        record = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    (args.work / "parts" / f"{part.name}.json").write_text(json.dumps(clean(record)))
    return 0


def add_mfu(record: dict, env: dict) -> None:
    """TFLOP/s and MFU of a part that trained (tokens_per_s, flops_per_token) against env's peaks, in place."""
    rate, per_token = record.get("tokens_per_s"), record.get("flops_per_token")
    if isinstance(rate, int | float) and per_token:
        record.update(gpu_recipe.mfu_fields(rate, per_token, env.get("peak_tflops"), env.get("datasheet_tflops")))


def summary(parts: dict) -> dict:
    """The headline numbers: lmzoo / nanoGPT tokens/s (target >= GPT2_TARGET), each model's MFU, the load's
    verdicts."""
    lmzoo, nano = parts.get("gpt2_lmzoo", {}), parts.get("gpt2_nanogpt", {})
    result = {"statuses": {name: record.get("status") for name, record in parts.items()}}
    tests = parts.get("gpu_tests", {})
    if "tests" in tests:
        result["gpu_tests"] = {k: tests[k] for k in ("passed", "failed", "errors", "skipped")}
    if lmzoo.get("tokens_per_s") and nano.get("tokens_per_s"):
        ratio = lmzoo["tokens_per_s"] / nano["tokens_per_s"]
        result["gpt2_lmzoo_vs_nanogpt_tokens_per_s"] = {
            "ratio": ratio,
            "target": GPT2_TARGET,
            "pass": ratio >= GPT2_TARGET,
        }
    for where, load in parts.get("load", {}).get("platforms", {}).items():
        result[f"load_{where}"] = {key: load[key] for key in ("load_s", "read_s", "peak_rss", "rss_pass", "time_pass")}
    result["mfu_datasheet"] = {name: r["mfu_datasheet"] for name, r in parts.items() if r.get("mfu_datasheet")}
    result["mfu_measured_peak"] = {
        name: r["mfu_measured_peak"] for name, r in parts.items() if r.get("mfu_measured_peak")
    }
    result["peak_gib"] = {
        name: r["peak_memory"].get("peak_gib") for name, r in parts.items() if isinstance(r.get("peak_memory"), dict)
    }
    return result


def headline(name: str, record: dict) -> str:
    """One line of a part's outcome for the terminal."""
    status = record["status"]
    if status == "skipped":
        return f"{name}: skipped ({record['reason']})"
    if status != "ok":
        first = (record.get("error") or "").strip().splitlines()
        return f"{name}: {status.upper()} after {record['wall_s']:.0f} s ({first[0] if first else 'no output'})"
    bits = [f"{record['wall_s']:.0f} s"]
    rate = record.get("tokens_per_s")
    if isinstance(rate, int | float):
        bits.append(f"{rate:,.0f} tokens/s")
    elif isinstance(rate, dict):
        bits.append(f"off {rate['off']:,.0f} / on {rate['on']:,.0f} tokens/s, {record['speedup']:.2f}x")
    if record.get("mfu_datasheet") is not None:
        bits.append(f"MFU {record['mfu_datasheet']:.1%} of datasheet")
    elif record.get("mfu_measured_peak") is not None:
        bits.append(f"{record['mfu_measured_peak']:.1%} of measured peak")
    if "peak_tflops" in record:
        bits.append(f"{record['device']}, bf16 peak {record['peak_tflops']:.1f} TFLOP/s")
    if "tests" in record:
        bits.append(", ".join(f"{record[k]} {k}" for k in ("passed", "failed", "errors", "skipped")))
    if isinstance(record.get("peak_memory"), dict) and record["peak_memory"].get("peak_gib") is not None:
        bits.append(f"peak {record['peak_memory']['peak_gib']:.1f} GiB")
    for where, load in record.get("platforms", {}).items():
        bits.append(
            f"{where} hf: {load['load_s']:.2f} s ({load['load_s'] / load['read_s']:.1f}x the read), peak host RSS "
            f"{load['peak_rss'] / 1e9:.2f} GB"
        )
    return f"{name}: ok, " + ", ".join(bits)


def suite_main(args) -> int:
    started, began = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    made_work = args.work is None
    args.work = pathlib.Path(tempfile.mkdtemp(prefix="device_suite-")) if made_work else args.work.resolve()
    for folder in ("parts", "logs"):
        (args.work / folder).mkdir(parents=True, exist_ok=True)
    chosen = args.parts.split(",") if args.parts else [part.name for part in PARTS]
    unknown = sorted(set(chosen) - set(BY_NAME))
    if unknown:
        print(f"error: --parts names {unknown}; the parts are {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    record = {
        "suite": {
            "command": [sys.executable, *sys.argv],
            "started": started,
            "budget_s": args.budget_s,
            "tiny": args.tiny,
            "nanogpt_dir": args.nanogpt_dir,
            "store": args.store,
        },
        "parts": {},
    }
    log = args.out / "device_suite.log"
    log.write_text("")

    def skip(part: Part) -> str | None:
        """Why `part` cannot run (it is not chosen, or lacks its inputs), None when it can."""
        if part.name not in chosen:
            return "not in --parts"
        if part.needs_store and store is None:
            return "no token store: the tokens part did not make one" + (
                "" if "tokens" in chosen else " (it is not in --parts)"
            )
        if part.name == "gpt2_nanogpt" and args.nanogpt_dir is None:
            return "no nanoGPT checkout given (--nanogpt_dir=NANOGPT: its train.py, model.py, configurator.py)"
        return None

    store, env = None, {}
    for index, part in enumerate(PARTS):
        reason = skip(part)
        if part.name == "gpt2_nanogpt" and reason is None and not (args.nanogpt_dir / "train.py").is_file():
            result = {"status": "error", "error": f"--nanogpt_dir {args.nanogpt_dir} has no train.py", "wall_s": 0.0}
        elif reason is not None:
            result = {"status": "skipped", "reason": reason}
        else:
            need = part.tiny_need_s if args.tiny else part.need_s
            later = [
                (p.tiny_need_s if args.tiny else p.need_s, p.weight)
                for p in PARTS[index + 1 :]
                if p.name in chosen and not (p.name == "gpt2_nanogpt" and args.nanogpt_dir is None)
            ]
            left = args.budget_s - (time.perf_counter() - began)
            limit = allot(left, need, part.weight, later)
            if limit is None:
                result = {
                    "status": "skipped",
                    "reason": f"needs about {need:.0f} s; {max(left, 0):.0f} s of the {args.budget_s:.0f} s budget left",
                }
            else:
                given = args.store if part.name == "tokens" else store if part.needs_store else None
                result = run_part(part, args, limit, given)
                if part.name == "tokens" and result["status"] == "ok":
                    store = pathlib.Path(result["store"])
        if part.name == "env" and result["status"] == "ok":
            env = result
        add_mfu(result, env)
        record["parts"][part.name] = result
        with open(log, "a") as out:
            out.write(f"=== {part.name}: {result['status']} ===\n")
            for part_log in [args.work / "logs" / f"{part.name}.log", *sorted(args.work.glob(f"{part.name}.*.log"))]:
                if part_log.is_file():
                    out.write(f"--- {part_log.name}\n{part_log.read_text(errors='replace')}\n")
        print(headline(part.name, result), flush=True)
        record["suite"]["wall_s"] = time.perf_counter() - began
        record["summary"] = summary(record["parts"])
        (args.out / "device_suite.json").write_text(json.dumps(clean(record), indent=1, allow_nan=False))
    failed = [name for name, r in record["parts"].items() if r["status"] not in ("ok", "skipped")]
    print(
        f"{args.out / 'device_suite.json'}: {len(record['parts'])} parts in {time.perf_counter() - began:.0f} s"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    if made_work and not args.keep_work:
        shutil.rmtree(args.work, ignore_errors=True)
    return 1 if failed else 0


def main() -> int:
    if sys.argv[1:2] == ["--run_train"]:  # train.py for the gpt2_lmzoo part, its peak memory written after
        run_train(sys.argv[2], sys.argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, help="folder for device_suite.json and device_suite.log")
    parser.add_argument("--nanogpt_dir", type=pathlib.Path, default=None, help="a nanoGPT checkout (not downloaded)")
    parser.add_argument(
        "--store", type=pathlib.Path, default=None, help="a GPT-2 BPE token store (default: byte-level)"
    )
    parser.add_argument("--budget_s", type=float, default=480.0, help="seconds for every part together")
    parser.add_argument("--parts", default="", help=f"comma-separated subset of {','.join(BY_NAME)}")
    parser.add_argument("--work", type=pathlib.Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--keep_work", action="store_true", help="keep the temporary scratch folder")
    parser.add_argument("--tiny", action="store_true", help="toy shapes, a few steps, on the CPU: checks the script")
    parser.add_argument("--part", choices=list(BY_NAME), help=argparse.SUPPRESS)  # a part's own process
    parser.add_argument("--limit_s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("nanogpt_dir", "store"):
        if getattr(args, name) is not None:
            setattr(args, name, getattr(args, name).resolve())
    if args.part:
        return part_main(args)
    if args.out is None:
        parser.error("--out is required")
    return suite_main(args)


if __name__ == "__main__":
    sys.exit(main())
