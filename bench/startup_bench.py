"""Start-up of the base-size configs on this CPU (issue 54): one train step traced and compiled, and train.py from
launch to its first step, with an empty and with a warm persistent compilation cache, against the targets trace +
compile <= 15 s and a warm start to the first step <= 5 s, printed PASS/MISS.

    python bench/startup_bench.py                          # gpt2_124m, bert_base, t5_base, llama3_1b: ~4 minutes
    python bench/startup_bench.py --models=bert_base,t5_base --json=startup.json
    python bench/startup_bench.py --looped                 # the same with scan_layers=False: the configs before
    python bench/startup_bench.py --tiny                   # every part at toy shapes: under 2 minutes

Each model, at the shapes bench/device_suite.py runs it:
- gpt2_124m: `configs/gpt2_124m.py` as the suite's train.py run takes it (480 x 1,024 tokens a step in 40
  microbatches of 12, packed documents);
- bert_base: `configs/bert.py:base`'s model with the suite's MLM step (no pooler or sentence head, 15% of 32 x 512
  tokens masked);
- t5_base: `configs/t5.py:base`, span corruption, 32 x 512 encoder tokens;
- llama3_1b: `configs/llama.py:llama3_1b`, 8 x 4,096 tokens.

Four processes a model, each fresh, with `LMZOO_COMPILATION_CACHE` set to a new folder for the step and another for
train.py (cold: empty; warm: the same folder again, as a second run of the config finds it):
1. step, cold then warm: the production train step (`SupervisedTrainer` through `compile_trainer`, as train.py
   builds it) on the abstract state (no parameter is made: llama3_1b's would not fit here), traced to a jaxpr,
   lowered to StableHLO and compiled, each timed; a warm compile reads the program from the cache.
2. train.py, cold then warm, in a new workdir each: the config at the model's shape, but one 128-token row a step
   (what is traced and compiled depends on the model, not the batch; the suite's batch takes minutes a step on 2
   cores), timed from launch to its start summary (imports, build, parameters made, data) and to its first step
   (the first train row of metrics.jsonl), after which it is stopped. Data caches (token stores, in this run's
   LMZOO_CACHE) are built by the cold run and found by the warm one, as on a user's second run. A train.py whose
   state (float32 parameters, gradients, AdamW's moments: 16 bytes a parameter, and a quarter more) does not fit in
   the memory available is skipped, saying so. t5_base's tokenizer is trained to 4,000 pieces (The Time Machine,
   its corpus, has about 4,100; the model keeps T5's 32,128-row table).

Targets (this CPU, 2 cores, quiet): the cold step's trace + lower + compile <= 15 s, the warm train.py's start to
its first step <= 5 s, for each model. The CPU, its measured f32 matmul peak and the load average at the start and
the end are printed; a run started above QUIET_LOAD is flagged as noisy. `--json` writes every number.
"""

import argparse
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("gpt2_124m", "bert_base", "t5_base", "llama3_1b")
TRACE_COMPILE_TARGET_S = 15.0
WARM_START_TARGET_S = 5.0
QUIET_LOAD = 1.5  # the load average at start above which a run is not one for RESULTS
TRAIN_ROW_TOKENS = 128  # train.py's step: one row of this many tokens
# float32 parameters, gradients and AdamW's two moments, and a quarter more for the step's activations and buffers
STATE_BYTES_PER_PARAM = 20
TIMEOUT_S = {False: 600, True: 120}  # a process's, full-size and --tiny
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"  # gpt2_124m's token store, byte-level


def config_of(model: str, args: argparse.Namespace):
    """The model's config as its file gives it (its toy shape with --tiny; its layers looped with --looped)."""
    from lmzoo import config as config_lib

    tiny = args.tiny
    file, variant = {
        "gpt2_124m": ("gpt2_124m.py", "tiny" if tiny else None),
        "bert_base": ("bert.py", "tiny" if tiny else "base"),
        "t5_base": ("t5.py", "tiny,test" if tiny else "base"),
        "llama3_1b": ("llama.py", "llama3_1b"),
    }[model]
    config = config_lib.load_config_file(ROOT / "configs" / file, variant)
    if model == "llama3_1b" and tiny:  # the suite's toy of the variant
        config.model.update(vocab_size=512, emb_dim=64, num_heads=4, num_kv_heads=2, num_layers=2, mlp_dim=128)
    if args.looped:
        config.model.scan_layers = False
    return config


def step_spec(model: str, args: argparse.Namespace):
    """(task, optim config, batch of numpy arrays, microbatches a step) of the model's train step as the suite runs
    it (`config_of`)."""
    import numpy as np

    from bench import common, gpu_step
    from lmzoo import models
    from lmzoo.data import noising, transforms
    from lmzoo.objectives import tasks

    config, tiny = config_of(model, args), args.tiny
    m = config.model
    rng = np.random.default_rng(0)
    if model == "gpt2_124m":  # train.py's: the recipe's batch, packed documents from its token store
        batch_size, length, accum = config.train.batch_size, config.data.seq_len, config.train.grad_accum_steps
        tokens = rng.integers(0, m.vocab_size, (batch_size, length + 1), dtype=np.int32)
        segment_ids, positions = gpu_step.packed_documents(batch_size, length)
        batch = common.next_token_batch(tokens) | {"segment_ids": segment_ids, "positions": positions}
        return tasks.causal_lm_task(models.build_model("gpt2", m.to_dict())), config.optim, batch, accum
    if model == "bert_base":
        m.update(pooler=False, sentence_head=False)
        batch_size, length = (4, m.max_len) if tiny else (32, 512)
        pad, unknown, cls, sep, mask = 0, 100, 101, 102, 103  # bert-base-uncased's special ids
        words = rng.integers(mask + 1, m.vocab_size, (batch_size, length - 2), dtype=np.int32)
        column = np.ones((batch_size, 1), np.int32)
        batch = transforms.mask_tokens(
            np.concatenate([cls * column, words, sep * column], axis=1),
            rng=rng,
            mask_id=mask,
            vocab_size=m.vocab_size,
            special_ids=(pad, unknown, cls, sep, mask),
        )
        return tasks.masked_lm_task(models.build_model("bert", m.to_dict()), mask_rate=0.15), config.optim, batch, 1
    if model == "t5_base":
        batch_size, inputs_len = (4, 32) if tiny else (32, 512)
        targets_len = noising.span_corruption_lengths(inputs_len)[1]
        inputs = rng.integers(2, m.vocab_size, (batch_size, inputs_len), dtype=np.int32)
        targets = rng.integers(2, m.vocab_size, (batch_size, targets_len), dtype=np.int32)
        start = np.full((batch_size, 1), m.decoder_start_id, np.int32)
        batch = {
            "inputs": inputs,
            "encoder_segment_ids": np.ones_like(inputs),
            "targets": targets,
            "decoder_inputs": np.ascontiguousarray(np.concatenate([start, targets[:, :-1]], axis=1)),
            "weights": np.ones(targets.shape, np.float32),
        }
        return tasks.seq2seq_task(models.build_model("seq2seq", m.to_dict())), config.optim, batch, 1
    batch_size, length = (2, 32) if tiny else (8, 4096)
    tokens = rng.integers(0, m.vocab_size, (batch_size, length + 1), dtype=np.int32)
    return (
        tasks.causal_lm_task(models.build_model("llama", m.to_dict())),
        config.optim,
        common.next_token_batch(tokens),
        1,
    )


def step_child(model: str, args: argparse.Namespace) -> None:
    """A fresh process's trace, lowering and compile of the model's train step, as one JSON line on stdout."""
    from lmzoo.kernels import host_memory
    from lmzoo.train import compilation_cache

    host_memory.set_up_process()  # as train.py sets its process up, before JAX's CPU client exists
    cache = compilation_cache.enable()
    import jax

    from lmzoo import sharding
    from lmzoo.trainers import base as trainer_lib
    from lmzoo.trainers import optim, supervised

    task, optim_config, batch, accum = step_spec(model, args)
    tx, schedule = optim.make_optimizer(optim_config)
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    compiled = trainer_lib.compile_trainer(
        supervised.SupervisedTrainer(task, tx, schedule, shapes, grad_accum_steps=accum),
        mesh=sharding.make_mesh(),
        rules=sharding.axis_rules(),
        seed=0,
    )
    with compiled.context():
        placed = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=compiled.batch_sharding) for k, v in shapes.items()
        }
        began = time.perf_counter()
        traced = compiled.step.trace(compiled.abstract_state, placed)
        traced_at = time.perf_counter()
        lowered = traced.lower()
        lowered_at = time.perf_counter()
        lowered.compile()
        compiled_at = time.perf_counter()
    params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(compiled.abstract_state.params))
    record = {
        "trace_s": traced_at - began,
        "lower_s": lowered_at - traced_at,
        "compile_s": compiled_at - lowered_at,
        "params": params,
        "cache": cache,
        "tokens": int(batch["inputs"].size),
    }
    print(json.dumps(record), flush=True)


def run_step(model: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    """`step_child` in a fresh process with the environment `env` (its compilation cache)."""
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), f"--step_child={model}"]
    command += ["--tiny"] * args.tiny + ["--looped"] * args.looped
    timeout = TIMEOUT_S[args.tiny]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{model}'s step process failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def train_command(model: str, args: argparse.Namespace, workdir: pathlib.Path, store: pathlib.Path) -> list[str]:
    """train.py of the model's config at its shape, one TRAIN_ROW_TOKENS-token row a step, logging every step."""
    from lmzoo import config as config_lib

    tiny = args.tiny
    file, variant = {
        "gpt2_124m": ("gpt2_124m.py", "tiny" if tiny else ""),
        "bert_base": ("bert.py", "roberta," + ("tiny" if tiny else "base")),  # the suite's MLM, as a recipe
        "t5_base": ("t5.py", "tiny,test" if tiny else "base"),
        "llama3_1b": ("llama.py", "tiny" if tiny else "llama3_1b"),
    }[model]
    length = min(TRAIN_ROW_TOKENS, config_lib.load_config_file(ROOT / "configs" / file, variant or None).data.seq_len)
    command = [sys.executable, "train.py", f"--config=configs/{file}" + (f":{variant}" if variant else "")]
    command += [f"--workdir={workdir}", "--config.train.steps=2", "--config.train.log_every=1"]
    command += ["--config.train.batch_size=1", "--config.train.grad_accum_steps=1", f"--config.data.seq_len={length}"]
    command += ["--config.train.sample_tokens=0", "--config.train.eval_every=2", "--config.train.checkpoint_every=2"]
    if model == "gpt2_124m":
        command += [f"--config.data.path={store}"]
    if args.looped:
        command += ["--config.model.scan_layers=False"]
    if model == "t5_base" and not tiny:  # The Time Machine has ~4,100 pieces, not 32,000: the model keeps its table
        command += ["--config.data.tokenizer.vocab_size=4000"]
    return command


def run_train(command: list[str], workdir: pathlib.Path, env: dict[str, str], tiny: bool) -> dict:
    """`command` (train.py) in a fresh process with the environment `env`: seconds from launch to its start summary
    and to its first step (the first train row of metrics.jsonl), then it is stopped (SIGKILL: the rest of the run is
    not start-up)."""
    began = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, ready = [], {}

    def read_output() -> None:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("model ") and "trained parameters" in line and "summary" not in ready:
                ready["summary"] = time.perf_counter() - began

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    metrics, first_step = workdir / "metrics.jsonl", None
    try:
        while first_step is None and process.poll() is None:
            if time.perf_counter() - began > TIMEOUT_S[tiny]:
                raise RuntimeError(f"no first step within {TIMEOUT_S[tiny]} s: {' '.join(command)}")
            if metrics.is_file() and '"split": "train"' in metrics.read_text():
                first_step = time.perf_counter() - began
            time.sleep(0.02)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait()
        reader.join(timeout=5)
    if first_step is None:
        raise RuntimeError(f"train.py ended (exit {process.returncode}) before its first step:\n{''.join(lines[-30:])}")
    return {"start_summary_s": ready.get("summary"), "first_step_s": first_step}


def make_store(scratch: pathlib.Path, tiny: bool) -> pathlib.Path:
    """gpt2_124m's token store: CORPUS byte-level (the suite's stores are byte-level too), made once, untimed."""
    store = scratch / "store"
    source = scratch / "corpus.txt"
    source.write_text(CORPUS.read_text()[: 100_000 if tiny else None])
    command = [sys.executable, "-m", "lmzoo.data.prepare", f"--source={source}", f"--out={store}", "--tokenizer=byte"]
    command += ["--validation_fraction=0.05", "--document_unit=paragraph"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    return store


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (0 where there is none)."""
    meminfo = pathlib.Path("/proc/meminfo")
    for line in meminfo.read_text().splitlines() if meminfo.exists() else ():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(model: str, args: argparse.Namespace, scratch: pathlib.Path, store: pathlib.Path, env: dict) -> dict:
    """The model's step and train.py, cold then warm, each cache a new folder under `scratch`."""
    folder = scratch / model
    record = {"step": {}, "train": {}}
    for kind in ("cold", "warm"):
        record["step"][kind] = run_step(model, args, env | {"LMZOO_COMPILATION_CACHE": str(folder / "xla_step")})
        print(f"  {model} step {kind}: {json.dumps(record['step'][kind])}", flush=True)
    needed = STATE_BYTES_PER_PARAM * record["step"]["cold"]["params"]
    if needed > available_bytes():
        record["train"] = {
            "skipped": f"it needs about {needed / 2**30:.1f} GiB; {available_bytes() / 2**30:.1f} GiB available"
        }
        print(f"  {model} train.py: skipped ({record['train']['skipped']})", flush=True)
        return record
    for kind in ("cold", "warm"):
        workdir = folder / f"run_{kind}"
        command = train_command(model, args, workdir, store)
        caches = {"LMZOO_COMPILATION_CACHE": str(folder / "xla_train"), "LMZOO_CACHE": str(scratch / "data_cache")}
        record["train"][kind] = run_train(command, workdir, env | caches, args.tiny)
        print(f"  {model} train.py {kind}: {json.dumps(record['train'][kind])}", flush=True)
    record["train"]["command"] = " ".join(command[1:])
    return record


def report(results: dict, load: dict) -> dict[str, bool]:
    """The table and each model's verdicts; returns {target line: passed}."""
    print(
        f"\nseconds; load average at start {load['start']:.2f}, at end {load['end']:.2f} (the bench's own process "
        "adds about 1)"
    )
    header = ["model", "params", "trace", "lower", "compile", "t+l+c", "warm comp", "py ready", "py 1st", "warm ready"]
    header.append("warm 1st")
    print(" ".join(f"{h:>10}" for h in header))
    verdicts = {}
    for model, record in results.items():
        cold, warm = record["step"]["cold"], record["step"]["warm"]
        total = cold["trace_s"] + cold["lower_s"] + cold["compile_s"]
        train = record["train"]
        cells = [model, f"{cold['params'] / 1e6:.0f}M"]
        cells += [f"{cold[k]:.2f}" for k in ("trace_s", "lower_s", "compile_s")] + [f"{total:.2f}"]
        cells.append(f"{warm['compile_s']:.2f}")
        for kind in ("cold", "warm"):
            row = train.get(kind)
            summary = row and row["start_summary_s"]
            cells += [f"{summary:.2f}" if summary else "-", f"{row['first_step_s']:.2f}" if row else "-"]
        print(" ".join(f"{c:>10}" for c in cells))
        verdicts[f"{model}: trace + lower + compile {total:.2f} s <= {TRACE_COMPILE_TARGET_S:g} s"] = (
            total <= TRACE_COMPILE_TARGET_S
        )
        if "warm" in train:
            first = train["warm"]["first_step_s"]
            verdicts[f"{model}: warm train.py to its first step {first:.2f} s <= {WARM_START_TARGET_S:g} s"] = (
                first <= WARM_START_TARGET_S
            )
        else:
            print(f"  {model}: no train.py start measured ({train['skipped']})")
    from bench import common

    print("\ntargets:")
    for line, passed in verdicts.items():
        print(f"  {line}  {common.verdict(passed)}")
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="every model's toy shape: under 2 minutes")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument(
        "--looped", action="store_true", help="every model's layers looped (scan_layers=False): the configs before"
    )
    parser.add_argument("--json", help="write every number to this file")
    parser.add_argument("--step_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step_child:
        return step_child(args.step_child, args)
    chosen = [m for m in args.models.split(",") if m]
    if not chosen or set(chosen) - set(MODELS):
        parser.error(f"--models {args.models!r}: choose from {','.join(MODELS)}")

    from bench import common

    model_name, isa = common.cpu_model_and_isa()
    load = {"start": os.getloadavg()[0]}
    shapes = "tiny" if args.tiny else "base-size"
    print(
        f"startup bench ({shapes} shapes, layers {'looped' if args.looped else 'as configured'}): {', '.join(chosen)}"
    )
    print(f"CPU: {model_name}, ISA: {isa}, {os.cpu_count()} cores; load average at start {load['start']:.2f}")
    peak = common.print_matmul_peak()
    env = dict(os.environ)
    if args.tiny:  # XLA's quickest CPU pipeline, the test suite's: --tiny checks the script, it measures nothing
        from lmzoo import testing

        env["XLA_FLAGS"] = " ".join(
            [*testing.accepted_xla_flags(testing.FAST_COMPILE_XLA_FLAGS), env.get("XLA_FLAGS", "")]
        )
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="startup_bench_"))
    try:
        store = make_store(scratch, args.tiny) if "gpt2_124m" in chosen else None
        results = {model: measure(model, args, scratch, store, env) for model in chosen}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load["end"] = os.getloadavg()[0]
    verdicts = report(results, load)
    if load["start"] > QUIET_LOAD:
        print(
            f"WARNING: load average {load['start']:.2f} > {QUIET_LOAD} at start: other processes shared the cores; "
            "a noisy row, not one for RESULTS (rerun on a quiet machine)"
        )
    if args.json:
        record = {"cpu": model_name, "isa": isa, "matmul_peak_gflops": peak, "load": load, "tiny": args.tiny}
        record["looped"] = args.looped
        record |= {"models": results, "targets": verdicts}
        pathlib.Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
