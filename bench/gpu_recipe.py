"""GPT-2 124M recipe on one accelerator: lmzoo's `train.py` against nanoGPT's own `train.py`, tokens/s and MFU.

    python bench/gpu_recipe.py --store=STORE --nanogpt_dir=NANOGPT [--steps 120] [--nanogpt_iters 40] [--out DIR]

STORE is a GPT-2 BPE token store (`python -m lmzoo.data.prepare ... --tokenizer=gpt2`); NANOGPT a checkout of
nanoGPT (its `train.py`, `model.py`, `configurator.py`). Both train GPT-2 small with the OpenWebText recipe of
`configs/gpt2_124m.py` (12 x 1,024 tokens a microbatch, 40 microbatches a step, bf16 compute): lmzoo from the
store, nanoGPT from `train.bin`/`val.bin` written from the same store's tokens in its own uint16 format,
`torch.compile` on, as its README runs it. Prints the accelerator, the bf16 matmul peak measured here, each side's
steady tokens/s (the first logged window, which holds the compilation, left out), MFU by nanoGPT's formula
(6N + 12 L H Q T FLOPs a token) against the measured peak and the datasheet peak, and PASS/MISS for lmzoo >= 1.0x
nanoGPT. The last line is one JSON record of every number. Needs a GPU or TPU; on the CPU use `--tiny`, which
only checks that the pieces run. bench/device_suite.py runs these pieces as parts of one device run.
"""

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATASHEET_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense, SXM


def matmul_peak_tflops(size: int, repeats: int = 10) -> float:
    """Measured bf16 [size, size] @ [size, size] TFLOP/s: the best of 3 timings of `repeats` products dispatched
    back to back (one wait each), after a warm-up."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0))
    a, b = (jax.random.normal(k, (size, size), jnp.bfloat16) for k in keys)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, b).block_until_ready()
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        outs = [matmul(a, b) for _ in range(repeats)]
        jax.block_until_ready(outs)
        seconds.append((time.perf_counter() - start) / repeats)
    return 2 * size**3 / min(seconds) / 1e12


def device_peaks(tiny: bool = False) -> dict:
    """The first device's kind, platform and count, the bf16 matmul peak measured on it (8192^3 products; 256^3 with
    `tiny`) and its dense bf16 datasheet peak (None for a kind DATASHEET_BF16_TFLOPS lacks), in TFLOP/s."""
    import jax

    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    return {
        "device": kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "peak_tflops": matmul_peak_tflops(256 if tiny else 8192),
        "datasheet_tflops": next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in kind), None),
    }


def mfu_fields(tokens_per_s: float, per_token: float, peak: float | None, datasheet: float | None) -> dict:
    """TFLOP/s of `tokens_per_s` tokens of `per_token` FLOPs each, and that as a share of the measured and the
    datasheet peak (None where a peak is unknown)."""
    achieved = tokens_per_s * per_token / 1e12
    return {
        "tflops": achieved,
        "mfu_measured_peak": achieved / peak if peak else None,
        "mfu_datasheet": achieved / datasheet if datasheet else None,
    }


def flops_per_token(num_layers: int, num_heads: int, emb_dim: int, seq_len: int, non_embedding_params: int) -> float:
    """nanoGPT's `estimate_mfu` count (PaLM appendix B): 6N + 12 L H Q T for a forward and backward pass."""
    return 6 * non_embedding_params + 12 * num_layers * num_heads * (emb_dim // num_heads) * seq_len


def gpt2_non_embedding_params(vocab: int, layers: int, emb: int, mlp: int, max_len: int) -> int:
    """GPT-2's parameters less the position table, as nanoGPT's `get_num_params` counts them (tied head)."""
    block = 2 * 2 * emb + emb * 3 * emb + 3 * emb + emb * emb + emb + emb * mlp + mlp + mlp * emb + emb
    return vocab * emb + layers * block + 2 * emb


def recipe_flops_per_token(tiny: bool = False) -> float:
    """nanoGPT's FLOPs a token of the recipe's GPT-2 (`configs/gpt2_124m.py`, or its `tiny` variant's shape)."""
    layers, heads, emb, mlp, seq = (1, 2, 32, 64, 64) if tiny else (12, 12, 768, 3072, 1024)
    return flops_per_token(layers, heads, emb, seq, gpt2_non_embedding_params(50304, layers, emb, mlp, seq))


def nanogpt_tokens_per_iter(tiny: bool = False) -> int:
    """Tokens of one nanoGPT iteration as `nanogpt_run` runs it: batch x block x gradient accumulation steps."""
    return 8 * 64 * 2 if tiny else 12 * 1024 * 40


def write_nanogpt_data(store: pathlib.Path, folder: pathlib.Path) -> dict:
    """The store's train and validation tokens as nanoGPT's `train.bin`/`val.bin` (flat uint16)."""
    from lmzoo.data import store as store_lib

    opened = store_lib.open_store(store)
    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, name in (("train", "train.bin"), ("validation", "val.bin")):
        tokens = opened.split(split)
        with open(folder / name, "wb") as f:
            for shard in tokens.shards:
                f.write(np.asarray(shard, np.uint16).tobytes())
        counts[split] = tokens.num_tokens
    return counts


def run_logged(command: list[str], cwd: pathlib.Path, log: pathlib.Path, timeout: float) -> tuple[int, float]:
    """Runs `command`, its output to `log` (and echoed at the end); returns (exit status, wall seconds)."""
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run(command, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
    wall = time.perf_counter() - start
    print(f"$ {' '.join(command)}\n  exit {code}, {wall:.1f} s; last lines of {log}:")
    print("\n".join("    " + line for line in log.read_text(errors="replace").splitlines()[-8:]))
    return code, wall


def lmzoo_run(
    store: pathlib.Path,
    workdir: pathlib.Path,
    log: pathlib.Path,
    *,
    steps: int,
    log_every: int,
    steps_per_call: int,
    timeout: float,
    tiny: bool = False,
    overrides: tuple[str, ...] = (),
    python: tuple[str, ...] = (sys.executable,),
) -> dict:
    """`python train.py --config=configs/gpt2_124m.py` (`:tiny`) for `steps` steps on the token store `store`, with
    the `--config.*` `overrides` after the recipe's; `python`: the interpreter (and any script that runs train.py
    for it). Exit status, wall seconds, the steady tokens/s (the median of the logged windows after the first, which
    holds the compilation), the training loss at each logged step and the last validation loss."""
    command = [*python, "train.py", f"--config=configs/gpt2_124m.py{':tiny' if tiny else ''}"]
    command += [f"--workdir={workdir}", f"--config.data.path={store}", f"--config.train.steps={steps}"]
    command += [f"--config.train.log_every={log_every}", f"--config.train.checkpoint_every={steps}"]
    command += [f"--config.train.eval_every={steps}", f"--config.train.steps_per_call={steps_per_call}"]
    if tiny:
        command += ["--config.model.vocab_size=50304"]
    command += list(overrides)
    code, wall = run_logged(command, ROOT, log, timeout)
    metrics = workdir / "metrics.jsonl"  # read on a timeout too: the windows logged so far still count
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    train = [r for r in rows if r["split"] == "train"]
    steady = [r["tokens_per_sec"] for r in train[1:]] or [r["tokens_per_sec"] for r in train]
    validation = [r for r in rows if r["split"] == "validation"]
    return {
        "exit": code,
        "wall_s": wall,
        "tokens_per_s": statistics.median(steady) if steady else float("nan"),
        "losses": [(r["step"], round(r["loss"], 4)) for r in train],
        "validation_loss": validation[-1]["loss"] if validation else None,
    }


def nanogpt_run(
    nanogpt_dir: pathlib.Path,
    data: pathlib.Path,
    out: pathlib.Path,
    log: pathlib.Path,
    *,
    iters: int,
    timeout: float,
    tiny: bool = False,
) -> dict:
    """nanoGPT's own `train.py` (run in `nanogpt_dir`) for `iters` iterations of the recipe on the `train.bin` /
    `val.bin` in `data` (`write_nanogpt_data`), its out_dir `out`. Exit status, wall seconds, the steady tokens/s and
    ms an iteration (the median after the first 5 iterations, which hold torch.compile) and the loss nanoGPT logs
    at each iteration (the last microbatch's)."""
    command = [sys.executable, "train.py", f"--dataset={data.resolve()}", f"--out_dir={out}", "--log_interval=1"]
    command += [f"--max_iters={iters}", "--eval_iters=5", "--eval_interval=100000"]
    command += ["--batch_size=12", "--block_size=1024", "--gradient_accumulation_steps=40"]
    if tiny:
        command += ["--device=cpu", "--compile=False", "--dtype=float32", "--n_layer=1", "--n_head=2", "--n_embd=32"]
        command += ["--block_size=64", "--batch_size=8", "--gradient_accumulation_steps=2"]
    code, wall = run_logged(command, nanogpt_dir, log, timeout)
    logged = re.findall(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms", log.read_text(errors="replace"), re.M)
    times = [float(ms) for _, _, ms in logged]
    steady = times[5:] or times[1:] or times
    seconds = statistics.median(steady) / 1e3 if steady else float("nan")
    return {
        "exit": code,
        "wall_s": wall,
        "tokens_per_s": nanogpt_tokens_per_iter(tiny) / seconds,
        "iter_ms": seconds * 1e3,
        "losses": [(int(i), float(loss)) for i, loss, _ in logged],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=pathlib.Path, required=True)
    parser.add_argument("--nanogpt_dir", type=pathlib.Path, required=True)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--log_every", type=int, default=10)
    parser.add_argument("--steps_per_call", type=int, default=1)
    parser.add_argument("--nanogpt_iters", type=int, default=40)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/gpu_recipe"))
    parser.add_argument("--timeout", type=float, default=400.0)
    parser.add_argument("--skip_nanogpt", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on the CPU: checks the pieces, measures nothing")
    args = parser.parse_args()
    args.store, args.out = args.store.resolve(), args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    import jax

    peaks = device_peaks(args.tiny)
    kind, peak, datasheet = peaks["device"], peaks["peak_tflops"], peaks["datasheet_tflops"]
    print(f"device: {kind} x{peaks['device_count']} ({peaks['platform']}), jax {jax.__version__}")
    print(f"bf16 matmul peak measured: {peak:.1f} TFLOP/s (datasheet dense bf16: {datasheet or 'unknown'})")

    per_token = recipe_flops_per_token(args.tiny)
    record = {"device": kind, "peak_tflops": peak, "datasheet_tflops": datasheet, "flops_per_token": per_token}

    def mfu(tokens_per_s: float) -> dict:
        return mfu_fields(tokens_per_s, per_token, peak, datasheet)

    lmzoo = lmzoo_run(
        args.store,
        args.out / "lmzoo",
        args.out / "lmzoo.log",
        steps=args.steps,
        log_every=args.log_every,
        steps_per_call=args.steps_per_call,
        timeout=args.timeout,
        tiny=args.tiny,
    )
    lmzoo.update(mfu(lmzoo["tokens_per_s"]))
    record["lmzoo"] = lmzoo
    print(
        f"lmzoo train.py: {lmzoo['tokens_per_s']:,.0f} tokens/s, {lmzoo['tflops']:.1f} TFLOP/s, "
        f"MFU {lmzoo['mfu_measured_peak']:.1%} of measured peak; losses {lmzoo['losses']}"
    )
    if not args.skip_nanogpt:
        data = args.nanogpt_dir.resolve() / "data" / "lmzoo_store"
        record["nanogpt_data_tokens"] = write_nanogpt_data(args.store, data)
        nano = nanogpt_run(
            args.nanogpt_dir.resolve(),
            data,
            data.parent / "out",
            args.out / "nanogpt.log",
            iters=args.nanogpt_iters,
            timeout=args.timeout,
            tiny=args.tiny,
        )
        nano.update(mfu(nano["tokens_per_s"]))
        record["nanogpt"] = nano
        ratio = lmzoo["tokens_per_s"] / nano["tokens_per_s"]
        record["ratio"] = ratio
        print(
            f"nanoGPT train.py: {nano['tokens_per_s']:,.0f} tokens/s ({nano['iter_ms']:.0f} ms/iter), "
            f"MFU {nano['mfu_measured_peak']:.1%} of measured peak"
        )
        print(f"lmzoo / nanoGPT tokens/s: {ratio:.3f}x  target >= 1.0x: {'PASS' if ratio >= 1.0 else 'MISS'}")
    print(json.dumps(record))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
