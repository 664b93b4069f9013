"""Helpers shared by the benchmarks: a wall-clock timer, the machine's f32 matmul peak, the two trainers and a
process of its own for each."""

import functools
import multiprocessing
import pathlib
import statistics
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lmzoo import sharding
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


def announce(name: str, label: str, spec, rounds: int) -> dict[str, float]:
    """Prints what runs on what and warns when other processes share the cores; returns the load at start."""
    import os

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


TORCH_THREADS = 2  # the machine's cores; XLA:CPU uses them all too


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


class Isolated:
    """A trainer built and run in a process of its own, as users run each framework: its own malloc settings,
    threads and JAX client, configured as train.py configures its process (`host_memory.run_on_calling_thread`;
    torch ignores it). Without this, the malloc setting lmzoo's train step applies would apply to torch in the same
    process too. `build(*args)` (a module-level function: the process is spawned) returns an object with
    `run(steps)` and `loss`; `run` here blocks until the steps are done and returns what the trainer's returned;
    `close` ends the process."""

    def __init__(self, build: Callable, *args):
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, build, args), daemon=True)
        self._process.start()
        child.close()
        self.loss = None
        self._receive()

    def run(self, steps: int):
        self._connection.send(steps)
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
    host_memory.run_on_calling_thread()
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
            if self.buffers_kept is None:  # once, after the first step, as the loop does (the look-up takes ~20 ms)
                self.buffers_kept = host_memory.keep_step_buffers_mapped(self.compiled.step, self.state, self.batch)
        loss_sum, count = jax.device_get(metrics["loss"])
        self.loss = float(loss_sum / count)


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
