"""Token-store benchmark (issue 25): prepare speed, train.py start-up on growing stores, loader speed; PASS/MISS.

    python bench/data_bench.py [--quick] [--sizes=0.1,1,4] [--prepare_gb=0.1] [--workers=N] [--rounds=3]
        [--scratch=/tmp/lmzoo-data-bench] [--keep] [--out=/tmp/data_bench.json]

Corpora are generated at bench time under --scratch as .jsonl files ("text" field) of documents drawn, shuffled and
repeated, from ../shared/data's text files and the Python standard library's sources; they and their stores are
deleted at the end unless --keep. Measured, each in a process of its own (peak RSS: the largest process of its tree,
from wait4's ru_maxrss):
  1. GPT-2 BPE prepare tokens/s of `lmzoo.data.prepare` against nanoGPT's data/openwebtext/prepare.py path (tiktoken
     `encode_ordinary` per document in a multiprocessing map of --workers processes, EOT appended, one uint16
     np.memmap) and against the old in-memory path (every document read, HF tokenizers `encode_batch`, one int32
     array and its document ids), on the same corpus in the same run; lmzoo and nanoGPT in --rounds interleaved
     rounds (median);
  2. `train.py` (configs/gpt2_124m.py:tiny, one step) time to the first train row of metrics.jsonl and peak RSS on
     byte-tokenized stores of each --sizes GB of text (median of --rounds interleaved rounds over the sizes, once
     every store is built), beside the old path's read + tokenize time and RSS (sizes whose RSS, extrapolated from
     the smallest, exceeds --old_rss_limit_gb are skipped);
  3. `LMLoader.batch(step)` tokens/s on the largest store for the gpt2_124m microbatch (12 x 1024) and step
     (480 x 1024).
Targets are printed as PASS/MISS, never asserted; every number goes to --out as JSON.
"""

import argparse
import base64
import json
import multiprocessing
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHARED = ROOT.parent / "shared" / "data"
GPT2_PATH = SHARED / "tokenizers" / "gpt2"
VALIDATION_FRACTION = 0.01  # train.py evaluates on it; the prepare default (0.0005) leaves small corpora none
FILE_BYTES = 64 << 20  # text per generated .jsonl file
TARGETS = {
    "prepare_vs_nanogpt": 1.0,
    "prepare_vs_nanogpt_stretch": 1.5,
    "first_step_s": 15.0,
    "train_rss_gb": 1.5,
    "flat": 0.10,
    "loader_tokens_per_s": 10e6,
}


def pool_documents(lines_per_document: int = 200) -> list[str]:
    """Local text as documents: each standard-library source file, and every `lines_per_document` lines of each
    text file in ../shared/data."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py") if "site-packages" not in f.parts)
    documents = [f.read_bytes().decode("utf-8", "replace") for f in files]
    for path in sorted(SHARED.rglob("*.txt")):
        lines = path.read_text(errors="replace").splitlines(keepends=True)
        documents += ["".join(lines[i : i + lines_per_document]) for i in range(0, len(lines), lines_per_document)]
    return [d for d in documents if d.strip() and "\0" not in d]


def write_corpus(documents: list[str], folder: pathlib.Path, gigabytes: float, seed: int = 0) -> int:
    """Writes documents in a fresh random order per pass until `gigabytes` of UTF-8 text, as .jsonl files of about
    FILE_BYTES each under `folder`; returns the bytes of text written."""
    folder.mkdir(parents=True)
    sizes = [len(d.encode()) for d in documents]
    rng = np.random.default_rng(seed)
    target, written, part, out = int(gigabytes * 1e9), 0, 0, None
    while written < target:
        for i in rng.permutation(len(documents)):
            if out is None or out.tell() >= FILE_BYTES:
                if out is not None:
                    out.close()
                out, part = open(folder / f"part-{part:05d}.jsonl", "w", encoding="utf-8"), part + 1
            out.write(json.dumps({"text": documents[i]}, ensure_ascii=False) + "\n")
            written += sizes[i]
            if written >= target:
                break
    out.close()
    return written


def corpus_files(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(folder.glob("*.jsonl"))


def jsonl_texts(files: list[pathlib.Path]):
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]


def gpt2_tiktoken():
    """GPT-2's tiktoken encoding built offline from ../shared/data/tokenizers/gpt2/gpt2.tiktoken."""
    import tiktoken

    from lmzoo import tokenizers

    ranks = {}
    for line in (GPT2_PATH / "gpt2.tiktoken").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=tokenizers.GPT2_SPLIT_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
    )


_ENC = None  # nanoGPT's module-level encoding, inherited by the forked workers


def _nanogpt_process(text: str) -> np.ndarray:
    ids = _ENC.encode_ordinary(text)
    ids.append(_ENC.eot_token)
    return np.array(ids, np.uint16)


def nanogpt_prepare(files: list[pathlib.Path], out: pathlib.Path, workers: int) -> int:
    """nanoGPT's path: encode each document in a map over `workers` processes, then concatenate into one uint16
    memmap; returns the tokens written."""
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        encoded = list(pool.imap(_nanogpt_process, jsonl_texts(files), chunksize=16))
    total = sum(len(ids) for ids in encoded)
    array = np.memmap(out, dtype=np.uint16, mode="w+", shape=(total,))
    index = 0
    for first in range(0, len(encoded), 1024):
        batch = np.concatenate(encoded[first : first + 1024])
        array[index : index + len(batch)] = batch
        index += len(batch)
    array.flush()
    return total


def old_path(corpus: pathlib.Path, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The in-memory path before token stores: every document as a string, encoded in one batch (GPT-2 by HF
    tokenizers), EOS appended, concatenated: (tokens [N] int32, document ids [N] int32)."""
    from lmzoo.data import sources

    documents = sources.read_local_text(str(corpus))
    if hasattr(tokenizer, "tokenizer"):
        ids = [e.ids for e in tokenizer.tokenizer.encode_batch(documents, add_special_tokens=False)]
    else:
        ids = tokenizer.encode_batch(documents)
    ids = [d + [tokenizer.eos_id] for d in ids]
    lengths = np.array([len(d) for d in ids], np.int64)
    tokens = np.fromiter((t for d in ids for t in d), np.int32, count=int(lengths.sum()))
    return tokens, np.repeat(np.arange(len(ids), dtype=np.int32), lengths)


def child(args: argparse.Namespace) -> None:
    """One measured variant (--child): writes {"tokens", "seconds"} to --result."""
    global _ENC
    corpus, out = pathlib.Path(args.corpus), pathlib.Path(args.store)
    if args.child == "nanogpt":
        _ENC = gpt2_tiktoken()
        start = time.perf_counter()
        tokens = nanogpt_prepare(corpus_files(corpus), out, args.workers)
    else:
        from lmzoo import tokenizers
        from lmzoo.data import prepare, sources

        path = str(GPT2_PATH) if args.tokenizer == "gpt2" else None
        tokenizer = tokenizers.build_tokenizer(args.tokenizer, path=path)
        start = time.perf_counter()
        if args.child == "old":
            tokens = len(old_path(corpus, tokenizer)[0])
        else:
            source = sources.FileCorpus(tuple(corpus_files(corpus)), validation_fraction=VALIDATION_FRACTION)
            built = prepare.prepare(source, tokenizer, out, workers=args.workers, progress=False)
            tokens = sum(info["tokens"] for info in built.manifest["splits"].values())
    seconds = time.perf_counter() - start
    pathlib.Path(args.result).write_text(json.dumps({"tokens": tokens, "seconds": seconds}))


def run_child(command: list[str], log: pathlib.Path, poll=None) -> tuple[int, float, float | None]:
    """Runs `command` from the repository root, output to `log`; returns (peak RSS bytes, wall seconds, seconds at
    which `poll()` first returned True, None if never). Raises with the log's tail when it fails."""
    start = time.perf_counter()
    seen = None
    with open(log, "w") as output:
        process = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG if poll else 0)
            if seen is None and poll and poll():
                seen = time.perf_counter() - start
            if pid:
                break
            time.sleep(0.02)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(command)} exited {process.returncode}; its log ends:\n{tail}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start, seen


def measure(kind: str, corpus: pathlib.Path, store: pathlib.Path, tokenizer: str, workers: int) -> dict:
    """{"tokens", "seconds", "tokens_per_s", "rss_gb"} of one variant run by `child` in a process of its own."""
    result = store.with_name(store.name + ".result.json")
    command = [sys.executable, __file__, f"--child={kind}", f"--corpus={corpus}", f"--store={store}"]
    command += [f"--tokenizer={tokenizer}", f"--workers={workers}", f"--result={result}"]
    rss, _, _ = run_child(command, store.with_name(store.name + ".log"))
    numbers = json.loads(result.read_text())
    return {**numbers, "tokens_per_s": numbers["tokens"] / numbers["seconds"], "rss_gb": rss / 1e9}


def first_step(store: pathlib.Path, vocab_size: int, workdir: pathlib.Path) -> dict:
    """train.py's seconds to its first train row in metrics.jsonl, total seconds and peak RSS, one step on `store`."""
    metrics = workdir / "metrics.jsonl"

    def logged() -> bool:
        return metrics.is_file() and any(
            json.loads(line).get("split") == "train" for line in metrics.read_text().splitlines()
        )

    command = [sys.executable, "train.py", "--config=configs/gpt2_124m.py:tiny", f"--workdir={workdir}"]
    command += [f"--config.data.path={store}", f"--config.model.vocab_size={vocab_size}"]
    command += ["--config.train.steps=1", "--config.train.log_every=1"]
    rss, total, seen = run_child(command, workdir.with_name(workdir.name + ".log"), logged)
    return {"first_step_s": seen, "total_s": total, "rss_gb": rss / 1e9}


def loader_speed(store: pathlib.Path, rows: int, steps: int) -> dict:
    """LMLoader.batch(step) tokens/s (median and best of `steps` steps after one warm-up) for rows x 1024."""
    from lmzoo.data import pipeline
    from lmzoo.data import store as store_lib

    split = store_lib.open_store(store).split("train")
    loader = pipeline.LMLoader([split], batch_size=rows, seq_len=1024, seed=0)
    loader.batch(0)
    seconds = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        loader.batch(step)
        seconds.append(time.perf_counter() - start)
    tokens = rows * 1024
    return {
        "rows": rows,
        "median_tokens_per_s": tokens / np.median(seconds),
        "best_tokens_per_s": tokens / min(seconds),
    }


def median_run(rows: list[dict]) -> dict:
    """The run of median tokens/s among `rows`, with every run's tokens/s beside it."""
    ranked = sorted(rows, key=lambda row: row["tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "runs_tokens_per_s": [row["tokens_per_s"] for row in rows]}


def remove(path: pathlib.Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 and 20 MB corpora: a smoke run of minutes")
    parser.add_argument("--sizes", default="0.1,1,4", help="GB of text of each store train.py starts on")
    parser.add_argument("--prepare_gb", type=float, default=0.1, help="GB of text of the prepare comparison")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--scratch", default="/tmp/lmzoo-data-bench")
    parser.add_argument("--keep", action="store_true", help="keep the corpora and stores")
    parser.add_argument("--out", default="/tmp/data_bench.json")
    parser.add_argument("--old_rss_limit_gb", type=float, default=12.0)
    parser.add_argument("--loader_steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the prepare and first-step runs")
    for hidden in ("child", "corpus", "store", "tokenizer", "result"):
        parser.add_argument(f"--{hidden}", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sizes = [0.01, 0.02] if args.quick else [float(s) for s in args.sizes.split(",")]
    prepare_gb = 0.01 if args.quick else args.prepare_gb
    loader_steps = 5 if args.quick else args.loader_steps

    from bench import common

    model, isa = common.cpu_model_and_isa()
    load = os.getloadavg()[0]
    peak = common.matmul_peak()
    print(f"data bench: CPU {model} ({isa}), {os.cpu_count()} cores, load average {load:.2f} at start")
    print("f32 matmul peak: " + ", ".join(f"{n}: {gflops:.1f} GFLOP/s" for n, gflops in peak.items()), flush=True)
    if load > 1.0:
        print("WARNING: other processes compete for the cores; timings are inflated")
    scratch = pathlib.Path(args.scratch)
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    documents = pool_documents()
    print(f"document pool: {len(documents):,} documents, {sum(map(len, documents)) / 1e6:.1f} M characters")
    record = {"cpu": model, "load_start": load, "matmul_gflops": peak, "workers": args.workers, "targets": TARGETS}
    try:
        corpus = scratch / "prepare_corpus"
        text_bytes = write_corpus(documents, corpus, prepare_gb)
        print(f"\n1. prepare, GPT-2 BPE, {text_bytes / 1e6:.0f} MB of text, {args.workers} workers")
        runs = {"lmzoo": [], "nanogpt": []}
        for round_ in range(args.rounds):
            for kind in list(runs) if round_ % 2 == 0 else list(runs)[::-1]:
                output = scratch / f"prepare_{kind}"
                runs[kind].append(measure(kind, corpus, output, "gpt2", args.workers))
                remove(output)
        prepared = {kind: median_run(rows) for kind, rows in runs.items()}
        prepared["old"] = measure("old", corpus, scratch / "prepare_old", "gpt2", args.workers)
        print(f"   {'path':<8} {'tokens':>12} {'seconds':>8} {'M tokens/s':>10} {'peak RSS GB':>11}")
        for kind, row in prepared.items():
            print(
                f"   {kind:<8} {row['tokens']:>12,} {row['seconds']:>8.1f} {row['tokens_per_s'] / 1e6:>10.2f} "
                f"{row['rss_gb']:>11.2f}"
            )
        ratio = prepared["lmzoo"]["tokens_per_s"] / prepared["nanogpt"]["tokens_per_s"]
        record["prepare"] = {"text_bytes": text_bytes, **prepared, "vs_nanogpt": ratio}
        record["prepare"]["vs_old"] = prepared["lmzoo"]["tokens_per_s"] / prepared["old"]["tokens_per_s"]
        shutil.rmtree(corpus)

        print(f"\n2. train.py first step on byte stores ({', '.join(map(str, sizes))} GB of text)", flush=True)
        startup = []
        for gb in sizes:
            corpus, store = scratch / f"corpus_{gb}", scratch / f"store_{gb}"
            text_bytes = write_corpus(documents, corpus, gb)
            row = {"gb": gb, "text_bytes": text_bytes}
            row["prepare"] = measure("lmzoo", corpus, store, "byte", args.workers)
            expected = startup[0]["old"]["rss_gb"] * gb / sizes[0] if startup and startup[0]["old"] else 0.0
            if expected > args.old_rss_limit_gb:
                row["old"] = None
                row["old_skipped"] = f"skipped: its RSS would be ~{expected:.0f} GB (> {args.old_rss_limit_gb:g} GB)"
            else:
                try:
                    row["old"] = measure("old", corpus, scratch / f"old_{gb}", "byte", args.workers)
                except RuntimeError as error:  # e.g. killed for memory: the "before" column's answer at this size
                    row["old"], row["old_skipped"] = None, f"failed: {str(error).splitlines()[0]}"
            startup.append(row)
            shutil.rmtree(corpus)
            print(
                f"   {gb:g} GB: prepare {row['prepare']['seconds']:.0f} s ({row['prepare']['tokens_per_s'] / 1e6:.1f}M "
                f"tokens/s, RSS {row['prepare']['rss_gb']:.2f} GB); old path "
                + (
                    f"{row['old']['seconds']:.1f} s, RSS {row['old']['rss_gb']:.2f} GB"
                    if row["old"]
                    else row["old_skipped"]
                ),
                flush=True,
            )
        first_steps = {gb: [] for gb in sizes}
        for round_ in range(args.rounds):
            for gb in sizes if round_ % 2 == 0 else sizes[::-1]:
                workdir = scratch / f"workdir_{gb}"
                first_steps[gb].append(first_step(scratch / f"store_{gb}", 258, workdir))
                remove(workdir)
        for row in startup:
            row["train_runs"] = first_steps[row["gb"]]
            row["train"] = {
                key: float(np.median([run[key] for run in row["train_runs"]])) for key in row["train_runs"][0]
            }
            print(
                f"   {row['gb']:g} GB: first step {row['train']['first_step_s']:.2f} s (runs "
                + ", ".join(f"{run['first_step_s']:.2f}" for run in row["train_runs"])
                + f"), RSS {row['train']['rss_gb']:.2f} GB",
                flush=True,
            )
        record["startup"] = startup
        for gb in sizes:
            if gb != max(sizes) and not args.keep:
                shutil.rmtree(scratch / f"store_{gb}")

        largest = scratch / f"store_{max(sizes)}"
        print(f"\n3. LMLoader.batch(step) on the {max(sizes):g} GB store, seq_len 1024")
        record["loader"] = [loader_speed(largest, rows, loader_steps) for rows in (12, 480)]
        for row in record["loader"]:
            print(
                f"   {row['rows']:>3} x 1024: median {row['median_tokens_per_s'] / 1e6:.1f}M tokens/s, "
                f"best {row['best_tokens_per_s'] / 1e6:.1f}M tokens/s"
            )
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)

    record["load_end"] = os.getloadavg()[0]
    print(f"\nload average at end: {record['load_end']:.2f}")
    base = startup[0]["train"]
    times = [row["train"]["first_step_s"] for row in startup]
    rss = [row["train"]["rss_gb"] for row in startup]
    flat = all(t <= base["first_step_s"] * (1 + TARGETS["flat"]) for t in times) and all(
        r <= base["rss_gb"] * (1 + TARGETS["flat"]) for r in rss
    )
    lines = [
        (
            ratio >= TARGETS["prepare_vs_nanogpt"],
            f"prepare vs nanoGPT {ratio:.2f}x (target >= 1.0x; stretch 1.5x: "
            f"{common.verdict(ratio >= TARGETS['prepare_vs_nanogpt_stretch'])}); vs old path "
            f"{record['prepare']['vs_old']:.1f}x",
        ),
        (max(times) <= TARGETS["first_step_s"], f"time to first step max {max(times):.1f} s (target <= 15 s)"),
        (max(rss) <= TARGETS["train_rss_gb"], f"train.py peak RSS max {max(rss):.2f} GB (target <= 1.5 GB)"),
        (
            flat,
            f"flat: first step {', '.join(f'{t:.1f}' for t in times)} s, RSS {', '.join(f'{r:.2f}' for r in rss)} "
            f"GB over {', '.join(map(str, sizes))} GB (within 10% of the first)",
        ),
    ] + [
        (
            row["median_tokens_per_s"] >= TARGETS["loader_tokens_per_s"],
            f"loader {row['rows']} x 1024 median {row['median_tokens_per_s'] / 1e6:.1f}M tokens/s (target >= 10M)",
        )
        for row in record["loader"]
    ]
    record["verdicts"] = {text: common.verdict(ok) for ok, text in lines}
    for ok, text in lines:
        print(f"{common.verdict(ok)} {text}")
    pathlib.Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"numbers: {args.out}")


if __name__ == "__main__":
    main()
