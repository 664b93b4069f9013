"""The GPT-2 124M train step alone on one accelerator, and where its time goes: tokens/s, MFU, kernel time by kind.

    python bench/gpu_step.py [--packed] [--microbatch 12] [--accum 10] [--profile] [--attention] [--tiny]

Compiles `configs/gpt2_124m.py`'s production step (`SupervisedTrainer` through `compile_trainer`, as train.py runs
it) on random tokens, `--accum` microbatches of `--microbatch` x 1,024 a step, and times the best of `--steps`
steps after the compiling one. `--packed` gives every row documents of about 300 tokens (segment ids and
positions, as a token store's batches carry them), so attention takes a mask. Prints the accelerator, the bf16
matmul peak measured here, tokens/s and MFU (nanoGPT's 6N + 12 L H Q T FLOPs a token) against the measured and the
datasheet peak, and PASS/MISS for MFU >= 40% of the datasheet (nanoGPT's `train.py` on an H200: 40.8%).
`--profile`: one step's kernel time on the device by kind (matmuls, cuDNN attention, fusions, reductions) and
the 15 costliest kernels. `--attention`: one layer's attention forward + backward at the step's shape with packed
documents, in each form JAX offers (XLA's, cuDNN's with the mask, Pallas' Triton kernel with segment ids) against
cuDNN's causal kernel without a mask. The last line is one JSON record. `--tiny` checks the pieces on the CPU.
`StepRunner` (any task's step, one or several steps a call) is what bench/device_suite.py times its models with.
"""

import argparse
import collections
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common, step_profile  # noqa: E402
from bench.gpu_recipe import (  # noqa: E402
    device_peaks,
    flops_per_token,
    gpt2_non_embedding_params,
)
from lmzoo import config as config_lib  # noqa: E402
from lmzoo import models, sharding  # noqa: E402
from lmzoo.data import transforms  # noqa: E402
from lmzoo.layers import attention  # noqa: E402
from lmzoo.objectives import tasks  # noqa: E402
from lmzoo.trainers import base as trainer_lib  # noqa: E402
from lmzoo.trainers import optim, supervised  # noqa: E402

KERNEL_KINDS = [  # (kind, substrings of the kernel's name), first match wins
    ("cuDNN attention", ("cudnn", "fmha", "flash", "mha")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("reduction", ("reduce",)),
    ("scatter / gather", ("scatter", "gather")),
    ("copy / transpose", ("copy", "transpose", "memcpy", "memset", "concatenate")),
]


class StepRunner:
    """A task's production train step (`SupervisedTrainer` through `compile_trainer`, as train.py runs it) on one
    host batch, `accum` microbatches a step, with its state on the mesh. `steps_per_call` > 1 runs that many steps
    in one compiled call (`compiled.steps` on the batch stacked k times, as train.py's
    `--config.train.steps_per_call` does). `call()` runs one call and waits for it; `tokens_per_call` counts
    `tokens_per_step` (default: the batch's inputs) times the steps of a call; `loss` is the last call's."""

    def __init__(
        self,
        task,
        optim_config,
        batch: dict[str, np.ndarray],
        *,
        accum: int = 1,
        steps_per_call: int = 1,
        tokens_per_step: int | None = None,
    ):
        tx, schedule = optim.make_optimizer(optim_config)
        shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
        self.compiled = trainer_lib.compile_trainer(
            supervised.SupervisedTrainer(task, tx, schedule, shapes, grad_accum_steps=accum),
            mesh=sharding.make_mesh(),
            rules=sharding.axis_rules(),
            seed=0,
        )
        self.steps_per_call = steps_per_call
        self.tokens_per_call = (tokens_per_step or batch["inputs"].size) * steps_per_call
        if steps_per_call > 1:
            self.host_batch = {k: np.stack([v] * steps_per_call) for k, v in batch.items()}
            self.function, self.sharding = self.compiled.steps, self.compiled.stacked_batch_sharding
        else:
            self.host_batch, self.function, self.sharding = batch, self.compiled.step, self.compiled.batch_sharding
        with self.compiled.context():
            self.state = self.compiled.init(jax.random.key(0))
            self.batch = sharding.put_batch(self.host_batch, self.sharding)
        self.metrics = None

    def call(self) -> None:
        with self.compiled.context():
            self.state, self.metrics = jax.block_until_ready(self.function(self.state, self.batch))

    def throughput(self, calls: int) -> float:
        """Tokens/s of `calls` calls dispatched as train.py's loop dispatches them: the host batch put on the devices
        for each call, no wait between calls, one wait at the end."""
        with self.compiled.context():
            start = time.perf_counter()
            for _ in range(calls):
                self.state, self.metrics = self.function(self.state, sharding.put_batch(self.host_batch, self.sharding))
            jax.block_until_ready((self.state, self.metrics))
        return calls * self.tokens_per_call / (time.perf_counter() - start)

    @property
    def loss(self) -> float | None:
        """The mean training loss of the last call (None before the first)."""
        if self.metrics is None:
            return None
        loss_sum, count = jax.device_get(self.metrics["loss"])
        return float(loss_sum / count)

    def time(self, calls: int) -> dict:
        """The first call (compilation included), then `calls` more: compile_and_first_call_s, each call's ms,
        tokens/s of the best one and the loss after the last."""
        first = common.timed(self.call)
        call_ms = [common.timed(self.call) * 1e3 for _ in range(calls)]
        return {
            "compile_and_first_call_s": first,
            "call_ms": call_ms,
            "steps_per_call": self.steps_per_call,
            "tokens_per_call": self.tokens_per_call,
            "tokens_per_s": self.tokens_per_call / (min(call_ms) / 1e3),
            "loss": self.loss,
        }


def packed_documents(batch: int, length: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """segment_ids, positions [batch, length] of rows cut into documents of about 300 tokens."""
    starts = np.random.default_rng(seed).random((batch, length)) < 1 / 300
    return transforms.segment_positions(np.cumsum(starts, axis=1))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "fusion / other")


def device_kernel_ms(run) -> tuple[collections.Counter, collections.Counter, float]:
    """(ms by kernel name, launches by name, wall ms) of `run()` on the first device, from a jax.profiler trace."""
    wall = []
    data = step_profile.profile(lambda: wall.append(common.timed(run) * 1e3))
    ms, launches = collections.Counter(), collections.Counter()
    for plane in data.planes:
        if plane.name.startswith("/device:") and plane.name.endswith(":0"):
            for line in plane.lines:
                if "XLA Ops" in line.name or "Modules" in line.name:  # summaries of the kernels on the stream lines
                    continue
                for event in line.events:
                    ms[event.name] += event.duration_ns / 1e6
                    launches[event.name] += 1
    return ms, launches, wall[0]


def best_ms(fn, *args, repeats: int = 20) -> float:
    """The best of 3 timings of `repeats` calls dispatched back to back (one wait each), after a warm-up."""
    jax.block_until_ready(fn(*args))
    dispatch = lambda: jax.block_until_ready([fn(*args) for _ in range(repeats)])  # noqa: E731
    return min(common.timed(dispatch) for _ in range(3)) / repeats * 1e3


def attention_forms(shape: tuple[int, int, int, int], interpret: bool) -> dict[str, dict]:
    """Forward and forward + backward ms of one attention layer [B, T, N, H] bf16 over packed documents in each
    form, and each output's largest difference from XLA's form with the mask."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    b, t, n, h = shape
    q, k, v, cotangent = (jax.random.normal(key, shape, jnp.bfloat16) for key in jax.random.split(jax.random.key(0), 4))
    segment_ids = jnp.asarray(packed_documents(b, t)[0])
    mask = attention.attention_mask(segment_ids, segment_ids, causal=False)
    forms = {
        "XLA, mask": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True),
        "cuDNN, mask": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, implementation="cudnn"
        ),
        "Pallas, segment ids": lambda q, k, v: pallas_attention.mha(
            q, k, v, segment_ids, sm_scale=h**-0.5, causal=True, interpret=interpret
        ),
        "cuDNN causal, no mask (one document a row)": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"
        ),
    }
    results, reference = {}, None
    for name, form in forms.items():
        forward = jax.jit(form)
        backward = jax.jit(
            jax.grad(lambda q, k, v, f=form: jnp.sum(f(q, k, v).astype(jnp.float32) * cotangent), argnums=(0, 1, 2))
        )
        try:
            out = np.asarray(forward(q, k, v), np.float32)
            row = {"forward_ms": best_ms(forward, q, k, v), "forward_backward_ms": best_ms(backward, q, k, v)}
        except Exception as e:  # a form this backend lacks (cuDNN on the CPU)
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            continue
        reference = out if reference is None else reference
        if "no mask" not in name:  # the unmasked kernel computes another function
            row["max_abs_diff_from_xla"] = float(np.max(np.abs(out - reference)))
        results[name] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatch", type=int, default=12)
    parser.add_argument("--accum", type=int, default=10)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--attention", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on the CPU: checks the pieces, measures nothing")
    args = parser.parse_args()

    peaks = device_peaks(args.tiny)
    kind, peak, datasheet = peaks["device"], peaks["peak_tflops"], peaks["datasheet_tflops"]
    print(f"device: {kind} ({peaks['platform']}), jax {jax.__version__}", flush=True)
    print(f"bf16 matmul peak measured: {peak:.1f} TFLOP/s (datasheet dense bf16: {datasheet or 'unknown'})")

    config = config_lib.load_config_file(ROOT / "configs" / "gpt2_124m.py", "tiny" if args.tiny else None)
    m = config.model
    per_token = flops_per_token(
        m.num_layers,
        m.num_heads,
        m.emb_dim,
        config.data.seq_len,
        gpt2_non_embedding_params(m.vocab_size, m.num_layers, m.emb_dim, m.mlp_dim, m.max_len),
    )
    b, t = args.microbatch * args.accum, config.data.seq_len
    tokens = np.random.default_rng(0).integers(0, 50257, (b, t + 1), dtype=np.int32)
    batch = common.next_token_batch(tokens)
    if args.packed:
        batch["segment_ids"], batch["positions"] = packed_documents(b, t)
    task = tasks.causal_lm_task(models.build_model(config.model_name, config.model.to_dict()))
    runner = StepRunner(task, config.optim, batch, accum=args.accum)
    record = {"device": kind, "peak_tflops": peak, "datasheet_tflops": datasheet, "packed": args.packed}
    one_step = runner.call
    with runner.compiled.context():
        timing = runner.time(args.steps)
        compile_s, step_ms, tokens_per_s = timing["compile_and_first_call_s"], timing["call_ms"], timing["tokens_per_s"]
        achieved = tokens_per_s * per_token / 1e12
        mfu = achieved / datasheet if datasheet else None
        record.update(
            compile_and_first_step_s=compile_s, step_ms=step_ms, tokens_per_s=tokens_per_s, tflops=achieved, mfu=mfu
        )
        print(
            f"step: {args.accum} microbatches of {args.microbatch} x {t}{', packed documents' if args.packed else ''}: "
            f"best {min(step_ms):.1f} ms of {[round(x) for x in step_ms]} (first {compile_s:.1f} s), "
            f"{tokens_per_s:,.0f} tokens/s, {achieved:.1f} TFLOP/s = {achieved / peak:.1%} of measured peak"
            + (f", MFU {mfu:.1%} of datasheet: target >= 40%: {common.verdict(mfu >= 0.40)}" if mfu else "")
        )
        if args.profile:
            ms, launches, wall = device_kernel_ms(one_step)
            by_kind = collections.Counter()
            for name, value in ms.items():
                by_kind[kernel_kind(name)] += value
            busy = sum(ms.values())
            print(f"one step's device kernels: busy {busy:.1f} of {wall:.1f} ms wall")
            for name, value in by_kind.most_common():
                print(f"  {name:<18} {value:8.1f} ms {value / max(busy, 1e-9):6.1%}")
            for name, value in ms.most_common(15):
                print(f"  {value:8.2f} ms {launches[name]:5d}x  {name[:120]}")
            record["kernel_ms_by_kind"] = dict(by_kind)
    if args.attention:
        shape = (2, 128, 2, 64) if args.tiny else (args.microbatch, t, m.num_heads, m.emb_dim // m.num_heads)
        record["attention"] = attention_forms(shape, interpret=args.tiny)
        print(f"one layer's attention {list(shape)} bf16, packed documents:")
        for name, row in record["attention"].items():
            if "error" in row:
                print(f"  {name:<44} unavailable here ({row['error']})")
            else:
                diff = row.get("max_abs_diff_from_xla")
                print(
                    f"  {name:<44} forward {row['forward_ms']:.3f} ms, forward + backward "
                    f"{row['forward_backward_ms']:.3f} ms" + ("" if diff is None else f", max |out - XLA's| {diff:.3g}")
                )
    print(json.dumps(record))


if __name__ == "__main__":
    main()
