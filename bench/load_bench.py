"""HF checkpoint loading benchmark (issue 38): peak host RSS and wall time of `init_from=hf:` on a 1 GB checkpoint.

    python bench/load_bench.py [--tiny] [--rounds=2] [--scratch=/tmp] [--keep] [--cold] [--platforms=cpu,accelerator]

Generates, in a temporary folder under --scratch, a random LlamaForCausalLM (transformers, random weights, no
download) of 491M parameters saved in bfloat16 as 4 safetensors shards (0.98 GB; --tiny: 2M parameters). Then, for
each of --platforms (`cpu`, the default: 8 simulated CPU devices, XLA_FLAGS=--xla_force_host_platform_device_count=8;
`accelerator`: the GPUs or TPUs JAX finds, the mesh's FSDP axis over all of them), each in a fresh process,
--rounds interleaved rounds of:
  read: every byte of the shard files read once into one reused buffer (as `cat` reads: the floor), and, for
        reference, each file read whole into fresh memory (`Path.read_bytes`, as the whole-file loader did), and as
        many bytes placed on the devices by the plainest path there is (the floor of placing them): on the CPU,
        written into fresh memory by the loader's copy threads (the simulated devices' buffers are host memory a
        process has not touched before); on an accelerator, put on the first device from the reused buffer in
        64 MB transfers;
  load: `lmzoo.weights.merge_pretrained(target, "hf:DIR", "llama", cfg)`, what `init_from=hf:` and the frozen models
        (PPO reference, distillation teacher) call, into a bfloat16 lmzoo Llama with scanned layers (as
        configs/llama.py:llama3_8b) whose target parameters are ShapeDtypeStructs sharded over an FSDP mesh
        (1, devices, 1); timed until every parameter is on its devices;
  ckpt: the same into the same targets from the checkpoint converted once (as `python -m lmzoo.cli.convert` writes
        it: the hf: load above, saved by orbax at step 0, not timed), `merge_pretrained(target, "ckpt:DIR", ...)`:
        orbax restores each parameter straight into its sharding.
Both read the files from the page cache (just written), or with --cold (Linux, as root) from the disk: the page cache
is dropped before each process and between read's two reads, as for a checkpoint's first load on a host; wall and
CPU times (all threads) are printed, as other processes sharing the cores inflate wall time. Peak RSS is the load
process's VmHWM; the bytes it read from files, /proc/self/io's rchar. The simulated devices' buffers are host memory,
so on the CPU the peak includes the loaded parameters themselves (on an accelerator they live in device memory); that
share is printed beside it.
Targets, printed as PASS/MISS (never asserted): peak host RSS <= 1.5 GB + 1.2 x the largest single tensor; load
time <= 2 x the read time (the reused-buffer read; medians over the rounds).
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from lmzoo import checkpoint, sharding, weights  # noqa: E402
from lmzoo.convert import llama as llama_convert  # noqa: E402
from lmzoo.convert import mapping, safetensors_reader  # noqa: E402
from lmzoo.models import build_model, make_config  # noqa: E402

GB = 1e9
COLD_VARIABLE = "LMZOO_LOAD_BENCH_COLD"  # set in a child of --cold: it drops the page cache between its two reads
ACCELERATOR_VARIABLE = "LMZOO_LOAD_BENCH_ACCELERATOR"  # set in a child on --platforms=accelerator
RSS_BASE_GB, RSS_TENSOR_FACTOR, TIME_FACTOR = 1.5, 1.2, 2.0
CPU_DEVICES = 8  # simulated, on --platforms=cpu
PLATFORMS = ("cpu", "accelerator")
# A Llama of 491M parameters: 8 layers of hidden 2048, MLP 5632, 16 heads, 4 kv heads; untied 32000-token embeddings.
FULL = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)
TINY = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
SHARD_SIZE = {"full": "300MB", "tiny": "2MB"}
READ_CHUNK = 64 << 20


def generate_checkpoint(folder: pathlib.Path, shape: dict, shard_size: str) -> None:
    """A random LlamaForCausalLM of `shape` made in bfloat16 and saved as safetensors shards of `shard_size`."""
    import torch  # here only: the measured processes do not import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=shard_size)


def shard_files(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(folder.glob("*.safetensors"))


def drop_page_cache() -> None:
    """Empties the kernel's page cache (Linux, as root), so that the next reads come from the disk."""
    os.sync()
    try:
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError as error:
        raise SystemExit(f"--cold drops the page cache, which needs root on Linux: {error}") from None


def read_bytes(folder: pathlib.Path) -> dict:
    """(Child process.) Reads every shard file's bytes once into one reused buffer (as `cat` does: the floor), then
    each file whole into fresh memory (`Path.read_bytes`, as the whole-file loader did), freeing it after (with
    --cold, each from the disk)."""
    buffer = memoryview(bytearray(READ_CHUNK))
    start, cpu_start, total = time.perf_counter(), time.process_time(), 0
    for file in shard_files(folder):
        with open(file, "rb", buffering=0) as f:
            while got := f.readinto(buffer):
                total += got
    read_s, read_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    if os.environ.get(COLD_VARIABLE):
        drop_page_cache()
    start, cpu_start = time.perf_counter(), time.process_time()
    for file in shard_files(folder):
        file.read_bytes()
    whole_s, whole_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    source = np.frombuffer(buffer, np.uint8)
    start, cpu_start, blocks = time.perf_counter(), time.process_time(), []
    if jax.default_backend() == "cpu":
        # As many bytes written into memory not touched before, in the loader's own blocks and copy threads: the
        # simulated devices' buffers are such memory, so no load here can place the parameters faster.
        for first in range(0, total, READ_CHUNK):
            blocks.append(mapping.fresh_empty((min(READ_CHUNK, total - first),), np.dtype(np.uint8)))
            mapping._copy_all([(blocks[-1], source[: len(blocks[-1])])])
    else:
        device = jax.devices()[0]
        for first in range(0, total, READ_CHUNK):
            blocks.append(jax.block_until_ready(jax.device_put(source[: min(READ_CHUNK, total - first)], device)))
    fill_s, fill_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "read_s": read_s,
        "read_cpu_s": read_cpu_s,
        "whole_s": whole_s,
        "whole_cpu_s": whole_cpu_s,
        "fill_s": fill_s,
        "fill_cpu_s": fill_cpu_s,
        "bytes": total,
        "peak_rss": rss_bytes("VmHWM"),
    }


def rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process, from /proc (not getrusage's ru_maxrss, which keeps the peak of
    the process that forked this one, here the one holding the generated model, across exec)."""
    line = next(line for line in pathlib.Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def bytes_read() -> int:
    """The bytes this process has read through system calls so far (/proc/self/io's rchar: files, page cache or
    disk alike)."""
    line = next(line for line in pathlib.Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar"))
    return int(line.split()[1])


def mesh_shape() -> tuple[int, int, int]:
    """(data, fsdp, tensor): FSDP over every device of this process."""
    return (1, jax.device_count(), 1)


def targets(folder: pathlib.Path):
    """(cfg, target ShapeDtypeStructs sharded over the FSDP mesh, their shardings) of the bfloat16 scanned Llama."""
    fields = llama_convert.config_from_hf(json.loads((folder / "config.json").read_text()))
    cfg = make_config("llama", fields | {"scan_layers": True, "param_dtype": "bfloat16", "dtype": "bfloat16"})
    model = build_model("llama", cfg)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    shardings = sharding.logical_to_sharding(boxed, sharding.make_mesh(mesh_shape()), sharding.axis_rules())
    target = jax.tree.map(
        lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where), nn.unbox(boxed), shardings
    )
    return cfg, target, shardings


def convert_once(folder: pathlib.Path) -> dict:
    """(Child process.) Writes the converted checkpoint at folder/converted, as lmzoo.cli.convert does."""
    cfg, target, _ = targets(folder)
    params = weights.merge_pretrained(target, f"hf:{folder}", "llama", cfg)
    checkpointer = checkpoint.Checkpointer(str(folder / "converted" / "checkpoints"), async_save=False)
    checkpointer.save(0, {"params": params}, {"step": 0}, force=True)
    checkpointer.close()
    return {"converted": True}


def load(folder: pathlib.Path, spec: str = "hf") -> dict:
    """(Child process.) Loads the checkpoint as `init_from=hf:` does (or, spec "ckpt", its converted form
    as `init_from=ckpt:` does) into sharded bfloat16 targets."""
    cfg, target, shardings = targets(folder)
    source = f"hf:{folder}" if spec == "hf" else f"ckpt:{folder / 'converted'}"
    before, read_before = rss_bytes("VmRSS"), bytes_read()
    start, cpu_start = time.perf_counter(), time.process_time()
    params = jax.block_until_ready(weights.merge_pretrained(target, source, "llama", cfg))
    load_s, load_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    read = bytes_read() - read_before
    leaves = jax.tree.leaves(params)
    assert all(leaf.sharding == where for leaf, where in zip(leaves, jax.tree.leaves(shardings), strict=True))
    return {
        "load_s": load_s,
        "load_cpu_s": load_cpu_s,
        "rss_before": before,
        "peak_rss": rss_bytes("VmHWM"),
        "read_bytes": read,
        "param_bytes": sum(leaf.nbytes for leaf in leaves),
        "params": sum(leaf.size for leaf in leaves),
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
    }


def run_child(mode: str, folder: pathlib.Path, platform: str = "cpu", cold: bool = False) -> dict:
    """Runs `mode` (read, load, convert or ckpt) in a fresh Python process on `platform` (cpu: 8 simulated devices;
    accelerator: JAX's default backend, which must not be the CPU), the page cache dropped first when `cold`; its
    result."""
    env = dict(os.environ)
    if platform == "cpu":
        env |= {"XLA_FLAGS": f"--xla_force_host_platform_device_count={CPU_DEVICES}", "JAX_PLATFORMS": "cpu"}
    else:
        env[ACCELERATOR_VARIABLE] = "1"
    if cold:
        drop_page_cache()
        env[COLD_VARIABLE] = "1"
    child = subprocess.run(
        [sys.executable, __file__, f"--child={mode}", str(folder)], env=env, capture_output=True, text=True
    )
    if child.returncode:
        raise RuntimeError(f"the {mode} process failed:\n{child.stdout[-2000:]}\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def largest_tensor_bytes(folder: pathlib.Path) -> int:
    _, tensors = safetensors_reader.read_safetensors_dir(folder)
    return max(int(np.prod(t.shape)) * t.dtype.itemsize for t in tensors.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a 2M-parameter checkpoint: a quick smoke run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved read/load rounds (medians reported)")
    parser.add_argument("--scratch", default=tempfile.gettempdir(), help="where the checkpoint is generated")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    parser.add_argument(
        "--cold", action="store_true", help="drop the page cache before each read and load (Linux, root): from disk"
    )
    parser.add_argument(
        "--platforms",
        default="cpu",
        help="comma-separated, in order: cpu (8 simulated devices) and/or accelerator (JAX's GPUs or TPUs)",
    )
    parser.add_argument("--json", type=pathlib.Path, help="also write each platform's medians and verdicts here")
    parser.add_argument("--child", choices=("read", "load", "convert", "ckpt"), help=argparse.SUPPRESS)
    parser.add_argument("folder", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if os.environ.get(ACCELERATOR_VARIABLE) and jax.default_backend() == "cpu":
            raise SystemExit("--platforms=accelerator: JAX finds no accelerator here (its backend is the CPU)")
        children = {"read": read_bytes, "load": load, "convert": convert_once, "ckpt": lambda f: load(f, "ckpt")}
        result = children[args.child](pathlib.Path(args.folder))
        print(json.dumps(result))
        return
    platforms = args.platforms.split(",")
    if not platforms or any(p not in PLATFORMS for p in platforms):
        parser.error(f"--platforms takes a comma-separated list of {', '.join(PLATFORMS)}; got {args.platforms!r}")

    size = "tiny" if args.tiny else "full"
    model, isa = common.cpu_model_and_isa()
    print(f"load bench ({size}): CPU {model} ({isa}), {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    if args.cold:
        drop_page_cache()  # refused here, before any work, where it cannot be done
        print("cold: the page cache is dropped before each read and load, which then read from the disk")
    os.makedirs(args.scratch, exist_ok=True)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="lmzoo-load-bench-", dir=args.scratch))
    try:
        start = time.perf_counter()
        generate_checkpoint(folder, TINY if args.tiny else FULL, SHARD_SIZE[size])
        files = shard_files(folder)
        on_disk = sum(f.stat().st_size for f in files)
        largest = largest_tensor_bytes(folder)
        print(
            f"checkpoint: {folder}, {len(files)} bfloat16 shards, {on_disk / GB:.3f} GB, largest tensor "
            f"{largest / GB:.3f} GB (generated in {time.perf_counter() - start:.1f} s)"
        )
        run_child("convert", folder, platforms[0])
        converted = sum(f.stat().st_size for f in (folder / "converted").rglob("*") if f.is_file())
        print(f"converted checkpoint (orbax, zstd-compressed chunks): {converted / GB:.3f} GB on disk")
        results = {
            platform: bench_platform(folder, platform, args.rounds, args.cold, on_disk, largest)
            for platform in platforms
        }
        if args.json:
            record = {"checkpoint_bytes": on_disk, "largest_tensor_bytes": largest, "rounds": args.rounds}
            args.json.write_text(json.dumps(record | {"cold": args.cold, "platforms": results}, indent=1))
    finally:
        if args.keep:
            print(f"kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


def bench_platform(folder: pathlib.Path, platform: str, rounds: int, cold: bool, on_disk: int, largest: int) -> dict:
    """--rounds interleaved rounds of read, load and ckpt on `platform` (a checkpoint of `on_disk` bytes, its largest
    tensor `largest`); prints their medians against the targets and returns them."""
    print(f"--- {platform}")
    reads, loads, restores = [], [], []
    for round_index in range(rounds):
        for mode in common.round_order(["read", "load", "ckpt"], round_index):
            result = run_child(mode, folder, platform, cold=cold)
            {"read": reads, "load": loads, "ckpt": restores}[mode].append(result)
            shown = {
                key: value / GB if key in ("rss_before", "peak_rss", "param_bytes", "read_bytes") else value
                for key, value in result.items()
            }
            shown = {key: round(value, 3) if isinstance(value, float) else value for key, value in shown.items()}
            print(f"  round {round_index + 1} {mode}: {shown}", flush=True)
    read_s, read_cpu_s, whole_s, whole_cpu_s, fill_s, fill_cpu_s = (
        common.median([r[key] for r in reads])
        for key in ("read_s", "read_cpu_s", "whole_s", "whole_cpu_s", "fill_s", "fill_cpu_s")
    )
    load_s, load_cpu_s = (common.median([r[key] for r in loads]) for key in ("load_s", "load_cpu_s"))
    restore_s, restore_cpu_s = (common.median([r[key] for r in restores]) for key in ("load_s", "load_cpu_s"))
    restore_peak = max(r["peak_rss"] for r in restores)
    peak, fill_peak = max(r["peak_rss"] for r in loads), max(r["peak_rss"] for r in reads)
    last = loads[-1]
    rss_target = RSS_BASE_GB * GB + RSS_TENSOR_FACTOR * largest
    print(
        f"loaded {last['params'] / 1e6:.0f}M parameters ({last['param_bytes'] / GB:.3f} GB bfloat16) onto "
        f"{last['devices']} x {last['device_kind']}, mesh (1, {last['devices']}, 1) (data, fsdp, tensor)"
    )
    print(
        f"read bytes: {read_s:.2f} s ({on_disk / GB / read_s:.2f} GB/s, CPU {read_cpu_s:.2f} s); whole files into "
        f"fresh memory: {whole_s:.2f} s (CPU {whole_cpu_s:.2f} s); load: {load_s:.2f} s (CPU {load_cpu_s:.2f} s) "
        f"(medians; load / whole-file read {load_s / whole_s:.1f}x)"
    )
    if platform == "cpu":
        print(
            f"writing as many bytes into fresh memory with the loader's blocks and {mapping._copy_threads()[1]} copy "
            f"threads: {fill_s:.2f} s (CPU {fill_cpu_s:.2f} s), {fill_s / read_s:.1f}x the read: no load onto the "
            f"simulated devices, whose buffers are such memory, is faster (load / fill {load_s / fill_s:.1f}x)"
        )
        held = f"of the peak, the loaded parameters on the simulated devices: {last['param_bytes'] / GB:.3f} GB"
        print(
            f"peak host RSS {peak / GB:.3f} GB (before loading {last['rss_before'] / GB:.3f} GB; {held}, beyond them "
            f"{(peak - last['param_bytes']) / GB:.3f} GB)"
        )
    else:
        print(
            f"putting as many bytes on the first device from host memory in {READ_CHUNK >> 20} MB transfers: "
            f"{fill_s:.2f} s ({on_disk / GB / fill_s:.1f} GB/s), {fill_s / read_s:.1f}x the read "
            f"(load / transfers {load_s / fill_s:.1f}x); that process's peak host RSS {fill_peak / GB:.3f} GB"
        )
        print(f"peak host RSS {peak / GB:.3f} GB (before loading {last['rss_before'] / GB:.3f} GB)")
    print(
        f"read from files while loading: hf: {last['read_bytes'] / GB:.3f} GB, ckpt: "
        f"{restores[-1]['read_bytes'] / GB:.3f} GB (the safetensors files: {on_disk / GB:.3f} GB)"
    )
    print(
        f"{common.verdict(peak <= rss_target)} peak host RSS {peak / GB:.3f} GB <= 1.5 GB + 1.2 x largest tensor "
        f"= {rss_target / GB:.3f} GB"
    )
    print(
        f"{common.verdict(load_s <= TIME_FACTOR * read_s)} load time {load_s:.2f} s <= 2 x read time "
        f"= {TIME_FACTOR * read_s:.2f} s ({load_s / read_s:.1f}x)"
    )
    print(
        f"converted checkpoint (ckpt:): restore {restore_s:.2f} s (CPU {restore_cpu_s:.2f} s), peak host RSS "
        f"{restore_peak / GB:.3f} GB; {restore_s / load_s:.2f}x the time of hf:"
    )
    print(
        f"{common.verdict(restore_peak <= rss_target)} ckpt: peak host RSS {restore_peak / GB:.3f} GB <= "
        f"{rss_target / GB:.3f} GB"
    )
    print(
        f"{common.verdict(restore_s <= TIME_FACTOR * read_s)} ckpt: restore time {restore_s:.2f} s <= 2 x read "
        f"time = {TIME_FACTOR * read_s:.2f} s ({restore_s / read_s:.1f}x)"
    )
    return {
        "devices": last["devices"],
        "device_kind": last["device_kind"],
        "read_s": read_s,
        "fill_s": fill_s,
        "fill_peak_rss": fill_peak,
        "load_s": load_s,
        "load_cpu_s": load_cpu_s,
        "load_read_bytes": last["read_bytes"],
        "peak_rss": peak,
        "restore_s": restore_s,
        "restore_cpu_s": restore_cpu_s,
        "restore_peak_rss": restore_peak,
        "rss_target": rss_target,
        "rss_pass": peak <= rss_target,
        "time_pass": load_s <= TIME_FACTOR * read_s,
    }


if __name__ == "__main__":
    main()
