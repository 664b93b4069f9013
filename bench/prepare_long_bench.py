"""Prepare of one huge document (issue 37 item 3): GPT-2 BPE tokens/s and peak RSS of a one-line text file against a
corpus of many documents holding the same text, in the same run; PASS/MISS.

    python bench/prepare_long_bench.py [--mb=300] [--workers=2] [--rounds=3] [--before=DIR] [--scratch=DIR] [--keep]

Both corpora are generated at bench time under --scratch (deleted at the end unless --keep) from ../shared/data's
text files, repeated: `long.txt`, the text as one line (its newlines turned into spaces, as in text8), prepared as
one document (`--document_unit=file`); `many/many.txt`, the same text with a newline about every 4,000 characters,
prepared a document per line (`--document_unit=line`). Each prepare is `python -m lmzoo.data.prepare` with the
default validation fraction, in a process of its own; measured: its own tokens/s line, the peak RSS of its largest
process (wait4's ru_maxrss) and the peak of the sum over its process tree (sampled every 20 ms). `--before=DIR` also
prepares `long.txt` with the lmzoo package under DIR (e.g. `git archive HEAD lmzoo | tar -x -C DIR`), the code before
a change, in the same run. The timed prepares run in --rounds interleaved rounds (each run first in turn): the median
rate and the largest RSS of each are reported; a 1-chunk file is prepared once first, for the RSS baseline.

Targets (printed, never asserted), with `--workers` W and the chunk size C (`lmzoo.data.prepare.CHUNK_BYTES`):
  - rss: the long document's peak tree RSS <= the tree RSS of preparing a 1-chunk file (the processes, tokenizer and
    buffers whatever the corpus) + 2 x W chunks in flight x 32 bytes per character (text in the reader, its pickled
    copy, the worker's copy, the tokenizer's working memory and the ids), i.e. bounded by workers x chunk and not by
    the document;
  - throughput: the long document's tokens/s >= the many-documents corpus's / 1.5.
"""

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import psutil

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHARED = ROOT.parent / "shared" / "data"
GPT2_PATH = SHARED / "tokenizers" / "gpt2"
LINE_CHARS = 4000  # characters per document of the many-documents corpus
BYTES_PER_CHAR_IN_FLIGHT = 32  # the rss target's allowance per character of a chunk in flight
THROUGHPUT_RATIO = 1.5  # the long document may be at most this much slower than many documents


def local_text() -> str:
    """../shared/data's .txt files, concatenated, as one line: every run of line breaks becomes a space."""
    texts = [p.read_text(errors="replace") for p in sorted(SHARED.rglob("*.txt"))]
    return re.sub(r"\s*\n\s*", " ", " ".join(texts)).strip()


def write_corpora(folder: pathlib.Path, megabytes: float) -> tuple[pathlib.Path, pathlib.Path, int]:
    """`long.txt` (one line) and `many/many.txt` (the same text, a line break about every LINE_CHARS characters) of
    about `megabytes` MB each, and the bytes of the long file."""
    text = local_text()
    lines, cut = [], 0
    while cut < len(text):
        end = text.find(" ", cut + LINE_CHARS)
        end = len(text) if end < 0 else end
        lines.append(text[cut:end])
        cut = end + 1
    repeats = max(1, round(megabytes * 1e6 / len(text.encode())))
    long_file, many_file = folder / "long.txt", folder / "many" / "many.txt"
    many_file.parent.mkdir(parents=True)
    with open(long_file, "w", encoding="utf-8") as f:
        for k in range(repeats):
            f.write((" " if k else "") + text)
    with open(many_file, "w", encoding="utf-8") as f:
        for _ in range(repeats):
            f.write("\n".join(lines) + "\n")
    return long_file, many_file.parent, long_file.stat().st_size


def prepare_run(code: pathlib.Path, source: pathlib.Path, out: pathlib.Path, unit: str, workers: int) -> dict:
    """`python -m lmzoo.data.prepare` of `source` with the lmzoo package under `code`: its tokens/s, documents, wall
    seconds, peak RSS of its largest process and peak RSS summed over its process tree (bytes)."""
    command = [sys.executable, "-m", "lmzoo.data.prepare", f"--source={source}", f"--out={out}", "--tokenizer=gpt2"]
    command += [f"--tokenizer_path={GPT2_PATH}", f"--workers={workers}", f"--document_unit={unit}"]
    env = {**os.environ, "PYTHONPATH": str(code)}
    log = out.with_name(out.name + ".log")
    tree_peak, start = 0, time.perf_counter()
    with open(log, "w") as output:
        process = subprocess.Popen(command, cwd=code, env=env, stdout=output, stderr=subprocess.STDOUT)
        parent = psutil.Process(process.pid)
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            try:
                members = [parent, *parent.children(recursive=True)]
                tree_peak = max(tree_peak, sum(_rss(p) for p in members))
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.02)
    seconds = time.perf_counter() - start
    text = log.read_text()
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{' '.join(command)} failed; its log ends:\n{text[-3000:]}")
    summary = re.search(r"prepared .*: train ([\d,]+) tokens in ([\d,]+) documents.* \(([\d.]+)M tokens/s\)", text)
    return {
        "tokens": int(summary.group(1).replace(",", "")),
        "documents": int(summary.group(2).replace(",", "")),
        "tokens_per_s": float(summary.group(3)) * 1e6,
        "seconds": seconds,
        "max_process_rss": usage.ru_maxrss * 1024,
        "tree_rss": tree_peak,
    }


def _rss(process: psutil.Process) -> int:
    try:
        return process.memory_info().rss
    except psutil.NoSuchProcess:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=300.0, help="MB of text of each corpus")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the timed prepares (median)")
    parser.add_argument("--before", default="", help="a folder holding the lmzoo package before a change")
    parser.add_argument("--scratch", default="/tmp/lmzoo-long-bench")
    parser.add_argument("--keep", action="store_true", help="keep the corpora and stores")
    args = parser.parse_args()

    from bench import common
    from lmzoo.data import prepare

    model, isa = common.cpu_model_and_isa()
    print(f"prepare long-document bench: CPU {model} ({isa}), {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    scratch = pathlib.Path(args.scratch)
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    try:
        long_file, many_folder, size = write_corpora(scratch, args.mb)
        tiny = scratch / "tiny.txt"
        tiny.write_text(long_file.open().read(prepare.CHUNK_BYTES // 2))
        print(f"corpora: {long_file} ({size / 1e6:.0f} MB, one line), {many_folder} (the same text, a line per "
              f"~{LINE_CHARS} characters); GPT-2 BPE, --workers={args.workers}, chunk {prepare.CHUNK_BYTES:,} "
              "characters", flush=True)  # fmt: skip
        runs = {"many": (ROOT, many_folder, "line"), "long": (ROOT, long_file, "file")}
        if args.before:
            runs["long_before"] = (pathlib.Path(args.before).resolve(), long_file, "file")
        print(f"{'run':<12} {'round':>5} {'tokens':>12} {'documents':>9} {'seconds':>8} {'M tokens/s':>10} "
              f"{'max proc GB':>11} {'tree GB':>8}")  # fmt: skip
        rows = {name: [] for name in ["tiny", *runs]}
        plan = [("tiny", 0)] + [(n, r) for r in range(args.rounds) for n in common.round_order(list(runs), r)]
        for name, r in plan:
            code, source, unit = (ROOT, tiny, "file") if name == "tiny" else runs[name]
            out = scratch / f"store_{name}_{r}"
            row = prepare_run(code, source, out, unit, args.workers)
            rows[name].append(row)
            print(
                f"{name:<12} {r + 1:>5} {row['tokens']:>12,} {row['documents']:>9,} {row['seconds']:>8.1f} "
                f"{row['tokens_per_s'] / 1e6:>10.2f} {row['max_process_rss'] / 1e9:>11.2f} {row['tree_rss'] / 1e9:>8.2f}",
                flush=True,
            )
            if not args.keep:
                shutil.rmtree(out)
        # per run: the median rate over the rounds, the largest RSS of any round
        results = {
            name: {
                **done[0],
                "tokens_per_s": common.median(row["tokens_per_s"] for row in done),
                "max_process_rss": max(row["max_process_rss"] for row in done),
                "tree_rss": max(row["tree_rss"] for row in done),
            }
            for name, done in rows.items()
        }
        print(f"medians over {args.rounds} round(s): " + ", ".join(
            f"{name} {row['tokens_per_s'] / 1e6:.2f}M tokens/s" for name, row in results.items() if name != "tiny"
        ))  # fmt: skip
        allowance = 2 * args.workers * prepare.CHUNK_BYTES * BYTES_PER_CHAR_IN_FLIGHT
        bound = results["tiny"]["tree_rss"] + allowance
        rss_ok = results["long"]["tree_rss"] <= bound
        ratio = results["many"]["tokens_per_s"] / results["long"]["tokens_per_s"]
        print(
            f"rss: long tree {results['long']['tree_rss'] / 1e9:.3f} GB <= 1-chunk tree "
            f"{results['tiny']['tree_rss'] / 1e9:.3f} GB + 2 x {args.workers} workers x {prepare.CHUNK_BYTES:,} "
            f"characters x {BYTES_PER_CHAR_IN_FLIGHT} B = {bound / 1e9:.3f} GB: {common.verdict(rss_ok)}"
        )
        print(
            f"throughput: many / long = {ratio:.2f} <= {THROUGHPUT_RATIO}: {common.verdict(ratio <= THROUGHPUT_RATIO)}"
        )
        if "long_before" in results:
            before, after = results["long_before"], results["long"]
            print(
                f"long document before -> after: {before['tokens_per_s'] / 1e6:.2f} -> "
                f"{after['tokens_per_s'] / 1e6:.2f}M tokens/s, largest process {before['max_process_rss'] / 1e9:.2f} "
                f"-> {after['max_process_rss'] / 1e9:.2f} GB, tree {before['tree_rss'] / 1e9:.2f} -> "
                f"{after['tree_rss'] / 1e9:.2f} GB; same tokens: {before['tokens'] == after['tokens']}"
            )
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
