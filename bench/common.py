"""Helpers shared by the benchmarks: a wall-clock timer, interleaved rounds and their medians, the machine's f32
matmul peak, the two trainers and a process of its own for each, lmzoo's train step against torch's, the printed
tables and verdicts, and what the trl comparisons share."""

import argparse
import functools
import multiprocessing
import os
import pathlib
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lmzoo import decoding, sharding
from lmzoo.kernels import host_memory
from lmzoo.trainers import base as trainer_lib
from lmzoo.trainers import optim, supervised


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes; `fn` must block until its work is done."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values) -> float:
    return float(statistics.median(values))


def interleaved_ms(runs: dict[str, tuple[Callable, object]], repeats: int) -> dict[str, tuple[float, float]]:
    """name -> (fn, arg): (min, median) ms of `fn(arg)` (or `fn()` when arg is None), after two warm-up
    calls, timing the functions in alternating order so the machine's drift hits all of them alike."""

    def call(fn, arg):
        return jax.block_until_ready(fn() if arg is None else fn(arg))

    for fn, arg in runs.values():
        call(fn, arg)
        call(fn, arg)
    seconds = {name: [] for name in runs}
    for r in range(repeats):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            seconds[name].append(timed(functools.partial(call, *runs[name])))
    return {name: (1e3 * min(s), 1e3 * median(s)) for name, s in seconds.items()}


def round_order(names: list[str], r: int) -> list[str]:
    """The order in which round `r` runs `names`: rotated by one each round, so that each runs first in turn and
    the machine's drift hits all of them alike (two names alternate)."""
    shift = r % len(names)
    return names[shift:] + names[:shift]


def rates(runs: dict[str, Callable[[], object]], units_per_call: dict[str, float], r: int) -> dict[str, float]:
    """Units per second of one call of each run, timed in round `r`'s order (`round_order`), which the row keeps."""
    return {name: units_per_call[name] / timed(runs[name]) for name in round_order(list(runs), r)}


def measure_rounds(label: str, rounds: int, measure: Callable[[int], dict[str, float]]) -> list[dict[str, float]]:
    """The rows `measure(r)` of each round, each printed as it comes: `  LABEL r/rounds: column value, ...`."""
    per_round = []
    for r in range(rounds):
        row = measure(r)
        per_round.append(row)
        print(f"  {label} {r + 1}/{rounds}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    return per_round


def summary(per_round: list[dict[str, float]], **fields) -> dict:
    """The rounds, then `fields`, then the median over the rounds of every column as `median_COLUMN`."""
    medians = {f"median_{k}": median(row[k] for row in per_round) for k in per_round[0]}
    return {"rounds": per_round, **fields, **medians}


def cpu_model_and_isa() -> tuple[str, str]:
    """The CPU model and the widest vector ISA it offers (XLA:CPU compiles for the host's features)."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    fields = (
        [line.split(":", 1) for line in cpuinfo.read_text().splitlines() if ":" in line] if cpuinfo.exists() else []
    )
    model = next((value.strip() for key, value in fields if key.strip() == "model name"), "unknown")
    flags = next((set(value.split()) for key, value in fields if key.strip() == "flags"), set())
    isa = [name for name in ("avx512_bf16", "avx512f", "avx2", "avx", "sse4_2") if name in flags]
    return model, "+".join(isa[:2]) or "unknown"


def matmul_peak(sizes=(1024, 2048), repeats: int = 5) -> dict[int, float]:
    """Best GFLOP/s of a jitted float32 `a @ b` for each square size (compiled and warmed first)."""
    matmul = jax.jit(jnp.matmul)
    peak = {}
    for n in sizes:
        a, b = jax.random.normal(jax.random.key(0), (2, n, n), jnp.float32)
        matmul(a, b).block_until_ready()
        best = min(
            timed(functools.partial(lambda x, y: matmul(x, y).block_until_ready(), a, b)) for _ in range(repeats)
        )
        peak[n] = 2 * n**3 / best / 1e9
    return peak


def print_matmul_peak(sizes=(1024, 2048)) -> dict[int, float]:
    """`matmul_peak` of `sizes`, printed."""
    peak = matmul_peak(sizes)
    print("matmul peak (f32, best of 5): " + ", ".join(f"{n}: {g:.1f} GFLOP/s" for n, g in peak.items()), flush=True)
    return peak


def rounds_parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """The command line of a bench timed in interleaved rounds: --rounds N (3), and --quick, a smoke run of
    `quick_help`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser


def announce(name: str, label: str, spec, rounds: int) -> dict[str, float]:
    """Prints what runs on what and warns when other processes share the cores; returns the load at start."""
    import torch

    print(
        f"{name} bench: {label} {spec}, {rounds} round(s), jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"torch {torch.__version__}",
        flush=True,
    )
    model, isa = cpu_model_and_isa()
    print(f"CPU: {model}, ISA: {isa}")
    load = {"start": os.getloadavg()[0]}
    print(f"load average at start: {load['start']:.2f} on {os.cpu_count()} cores")
    if load["start"] > 1.0:
        print(
            "WARNING: other processes compete for the cores; torch's 2 OpenMP threads slow down far more than XLA "
            "under contention, so lmzoo/torch is inflated and per-round matmul peaks are noisy"
        )
    return load


def print_table(result: dict, columns: list[tuple[str, str, str]]) -> None:
    """One line per round of `result` (a `summary`) and a median line; columns are (header, key, format)."""
    rows = [(str(i + 1), row) for i, row in enumerate(result["rounds"])]
    rows.append(("median", {key: result[f"median_{key}"] for _, key, _ in columns}))
    widths = [max(len(header), 8) for header, _, _ in columns]
    print(f"{'round':>6} " + " ".join(f"{header:>{w}}" for (header, _, _), w in zip(columns, widths, strict=True)))
    for label, row in rows:
        print(
            f"{label:>6} "
            + " ".join(f"{fmt.format(row[key]):>{w}}" for (_, key, fmt), w in zip(columns, widths, strict=True))
        )


def verdict(passed: bool) -> str:
    return "PASS" if passed else "MISS"


def report_targets(results: dict[str, float], targets: dict[str, float]) -> dict[str, dict]:
    """Prints each result against its target (PASS when >= target); returns {name: {value, target, pass}}."""
    for name, target in targets.items():
        print(f"  {name:<19} {results[name]:>8.3f}  target >= {target:<5}  {verdict(results[name] >= target)}")
    return {name: {"value": results[name], "target": t, "pass": results[name] >= t} for name, t in targets.items()}


TORCH_THREADS = 2  # the machine's cores; XLA:CPU uses them all too


def fastest_torch_threads(probe: Callable[[], object]) -> tuple[int, dict[int, float]]:
    """Runs torch with whichever of 1 or 2 threads runs `probe` faster: (that count, {threads: seconds}).

    Decoding runs many small ops, which torch's 2 OpenMP threads can slow down many-fold when other processes
    hold the cores; `probe` (a short greedy decode) is warmed up first, then timed once with each count."""
    import torch

    probe()
    seconds = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        seconds[threads] = timed(probe)
    fastest = min(seconds, key=seconds.get)
    torch.set_num_threads(fastest)
    return fastest, seconds


def hf_byte_tokenizer():
    """lmzoo's byte tokenizer as an HF fast tokenizer (ids: 256 bytes, <eos> 256, <pad> 257; prompts padded on the
    left), for the trl comparisons."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(i): i for i in range(256)} | {"<eos>": 256, "<pad>": 257}
    byte_tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    byte_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    byte_tokenizer.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_tokenizer, eos_token="<eos>", pad_token="<pad>", unk_token="<pad>", padding_side="left"
    )


def hf_gpt2_config(model):
    """An HF `GPT2Config` of lmzoo's GPT-2 `model` section (config.model), dropout off, byte-tokenizer special ids."""
    import transformers

    return transformers.GPT2Config(
        vocab_size=model.vocab_size,
        n_positions=model.max_len,
        n_embd=model.emb_dim,
        n_layer=model.num_layers,
        n_head=model.num_heads,
        n_inner=model.mlp_dim,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=256,
        eos_token_id=256,
        pad_token_id=257,
    )


TRL_ON_CPU = dict(use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=10**6)


def trl_policy(prefix: str, gpt2_config, tokenizer) -> tuple[str, str]:
    """A new folder for a trl trainer and in it the policy trl reads by path (and builds its reference model from):
    a GPT-2 of `gpt2_config` with fresh weights (seed torch first), saved with `tokenizer`. (folder, policy folder)"""
    import transformers

    workdir = tempfile.mkdtemp(prefix=prefix)
    policy_dir = os.path.join(workdir, "policy")
    transformers.GPT2LMHeadModel(gpt2_config).save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    return workdir, policy_dir


class Isolated:
    """A trainer built and run in a process of its own, as users run each framework: its own malloc settings,
    threads and JAX client, configured as train.py configures its process (`host_memory.set_up_process`;
    torch ignores it). Without this, the malloc setting lmzoo's train step applies would apply to torch in the same
    process too. `build(*args)` (a module-level function: the process is spawned) returns an object with
    `run(steps)` and `loss`; `run` here blocks until the steps are done and returns what the trainer's returned;
    `close` ends the process. `daemon=False` for a trainer that starts processes of its own (lmzoo's reward pool):
    it then ends when the pipe closes, with this process or at `close`."""

    def __init__(self, build: Callable, *args, daemon: bool = True):
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, build, args), daemon=daemon)
        self._process.start()
        child.close()
        self.loss = None
        self._receive()

    def run(self, steps: int):
        self.start(steps)
        return self.finish()

    def start(self, steps: int) -> None:
        """Starts `run(steps)` without waiting for it (`finish` waits): trainers in processes of their own can warm
        up (compile) side by side."""
        self._connection.send(steps)

    def finish(self):
        """What the `run` that `start` began returned, once it has."""
        result, self.loss = self._receive()
        return result

    def close(self) -> None:
        """Ends the trainer's process (so it holds no memory or threads while other measurements run)."""
        self._connection.close()
        self._process.join()

    def _receive(self):
        try:
            status, value = self._connection.recv()
        except EOFError:
            raise RuntimeError(f"the trainer's process died (exit code {self._process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"the trainer's process failed:\n{value}")
        return value


def _serve(connection, build: Callable, args: tuple) -> None:
    """The trainer's process: builds it, then runs the steps asked for until the pipe closes."""
    host_memory.set_up_process()
    try:
        trainer = build(*args)
        connection.send(("ok", None))
        while True:
            try:
                steps = connection.recv()
            except EOFError:
                return
            result = trainer.run(steps)
            connection.send(("ok", (result, getattr(trainer, "loss", None))))
    except Exception:
        connection.send(("error", traceback.format_exc()))


class LmzooTrainer:
    """The production train step: `SupervisedTrainer` through `compile_trainer`, exactly what `lmzoo.train.loop` runs
    (in a process set up as train.py's is: `Isolated`, or `host_memory.run_on_calling_thread` first)."""

    def __init__(self, task, batch: dict[str, np.ndarray], optim_config):
        tx, schedule = optim.make_optimizer(optim_config)
        self.compile(task, tx, schedule, batch)

    def compile(self, task, tx, schedule, batch: dict[str, np.ndarray]) -> None:
        """Compiles `task` with optimizer `tx` as the loop does and puts its state and `batch` on the mesh."""
        shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
        self.compiled = trainer_lib.compile_trainer(
            supervised.SupervisedTrainer(task, tx, schedule, shapes),
            mesh=sharding.make_mesh(),
            rules=sharding.axis_rules(),
            seed=0,
        )
        with self.compiled.context():
            self.state = self.compiled.init(jax.random.key(0))
        self.batch = sharding.put_batch(batch, self.compiled.batch_sharding)
        self.loss, self.buffers_kept = None, None

    def run(self, steps: int) -> None:
        with self.compiled.context():
            for _ in range(steps):
                self.state, metrics = self.compiled.step(self.state, self.batch)
            if self.buffers_kept is None:  # once, after the first step, when looking the program up takes ~20 ms
                self.buffers_kept = host_memory.keep_step_buffers_mapped(self.compiled.step, self.state, self.batch)
        loss_sum, count = jax.device_get(metrics["loss"])
        self.loss = float(loss_sum / count)


def next_token_batch(tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Inputs, targets and weights [B, T] (contiguous arrays) of next-token prediction on `tokens` [B, T + 1]."""
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones(tokens[:, 1:].shape, np.float32)}
    return {k: np.ascontiguousarray(v) for k, v in batch.items()}


def greedy_decode(model, params, prompt: np.ndarray, new_tokens: int, use_cache: bool) -> np.ndarray:
    """`new_tokens` greedy tokens after `prompt` by `decoding.generate`, with or without the KV cache."""
    return np.asarray(
        decoding.generate(
            model,
            params,
            prompt,
            rng=jax.random.key(0),
            max_new_tokens=new_tokens,
            temperature=0.0,
            use_cache=use_cache,
        )
    )


def trainer_rounds(
    trainers: dict[str, Isolated], label: str, rounds: int, measure: Callable[[int], dict[str, float]], **fields
) -> dict:
    """Warms the trainers up, runs `measure_rounds`, then ends their processes. The `summary` of the rounds with, first,
    compile_s (each trainer's first step, which compiles) and loss_after_warmup (after one more), then `fields`."""
    compile_s = {name: timed(functools.partial(trainer.run, 1)) for name, trainer in trainers.items()}
    for trainer in trainers.values():
        trainer.run(1)
    initial_loss = {name: trainer.loss for name, trainer in trainers.items()}
    per_round = measure_rounds(label, rounds, measure)
    for trainer in trainers.values():
        trainer.close()
    return summary(per_round, compile_s=compile_s, loss_after_warmup=initial_loss, **fields)


def train_rates(
    trainers: dict[str, Isolated], steps: dict[str, int], tokens_per_step: dict[str, int], r: int
) -> dict[str, float]:
    """Train tokens/s of each trainer over `steps[name]` steps of `tokens_per_step[name]` tokens, in round `r`'s
    order (`rates`)."""
    runs = {name: functools.partial(trainer.run, steps[name]) for name, trainer in trainers.items()}
    return rates(runs, {name: tokens_per_step[name] * steps[name] for name in trainers}, r)


class TorchTrainer:
    """The reference: an HF PyTorch model + torch AdamW with lmzoo's hyper-parameters, schedule, clipping
    and weight-decay mask. `decays(name, param)` picks the tensors that decay (lmzoo: kernels, not
    embeddings, norms or biases); `inputs` are the model's keyword tensors, returning `.loss`."""

    def __init__(self, model, inputs: dict[str, np.ndarray], optim_config, decays: Callable[[str, object], bool]):
        import torch

        torch.set_num_threads(TORCH_THREADS)
        self.torch, self.model = torch, model.train()
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            (decay if decays(name, param) else no_decay).append(param)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": optim_config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=optim_config.learning_rate,
            betas=(optim_config.b1, optim_config.b2),
            eps=optim_config.eps,
        )
        _, schedule = optim.make_optimizer(optim_config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: float(schedule(step)) / optim_config.learning_rate
        )
        self.grad_clip = optim_config.grad_clip
        self.inputs = {k: torch.from_numpy(np.ascontiguousarray(v).astype(np.int64)) for k, v in inputs.items()}
        self.loss = None

    def run(self, steps: int) -> None:
        for _ in range(steps):
            loss = self.model(**self.inputs).loss
            loss.backward()
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.loss = loss.item()


def train_vs_torch(spec, rounds: int, lmzoo_build: Callable, torch_build: Callable) -> dict:
    """Train tokens/s of lmzoo's step and the torch reference on one random next-token batch, each built by
    `build(spec, tokens)` in a process of its own (`Isolated`), in interleaved rounds with the matmul peak measured
    in each and both MFUs against it. `spec` has vocab_size, batch_size, seq_len, steps_per_round and
    flops_per_token()."""
    tokens = np.random.default_rng(0).integers(0, spec.vocab_size, (spec.batch_size, spec.seq_len + 1), dtype=np.int32)
    trainers = {"lmzoo": Isolated(lmzoo_build, spec, tokens), "torch": Isolated(torch_build, spec, tokens)}
    steps = dict.fromkeys(trainers, spec.steps_per_round)
    tokens_per_step = dict.fromkeys(trainers, spec.batch_size * spec.seq_len)

    def measure(r: int) -> dict[str, float]:
        row = train_rates(trainers, steps, tokens_per_step, r)
        row["peak_gflops"] = max(matmul_peak(repeats=3).values())
        row["ratio"] = row["lmzoo"] / row["torch"]
        row["mfu"] = spec.flops_per_token() * row["lmzoo"] / (row["peak_gflops"] * 1e9)
        row["torch_mfu"] = spec.flops_per_token() * row["torch"] / (row["peak_gflops"] * 1e9)
        return row

    return trainer_rounds(trainers, "train round", rounds, measure, flops_per_token=spec.flops_per_token())


TRAIN_VS_TORCH_COLUMNS = [
    ("lmzoo tok/s", "lmzoo", "{:.0f}"),
    ("torch tok/s", "torch", "{:.0f}"),
    ("lmzoo/torch", "ratio", "{:.3f}"),
    ("peak GFLOP/s", "peak_gflops", "{:.1f}"),
    ("lmzoo MFU", "mfu", "{:.1%}"),
    ("torch MFU", "torch_mfu", "{:.1%}"),
]


def print_train_vs_torch(spec, train: dict) -> None:
    """A `train_vs_torch` result: the shapes, compile times and losses, then its table."""
    compile_s, loss = train["compile_s"], train["loss_after_warmup"]
    print(
        f"\ntrain: B={spec.batch_size} T={spec.seq_len} ({spec.batch_size * spec.seq_len} tokens/step), "
        f"{spec.steps_per_round} steps/round, {train['flops_per_token'] / 1e6:.1f} MFLOP/token; "
        f"compile+1st step s: lmzoo {compile_s['lmzoo']:.1f}, torch {compile_s['torch']:.1f}; "
        f"loss after warm-up: lmzoo {loss['lmzoo']:.3f}, torch {loss['torch']:.3f}"
    )
    print_table(train, TRAIN_VS_TORCH_COLUMNS)
