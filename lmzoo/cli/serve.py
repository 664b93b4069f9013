"""An OpenAI-compatible HTTP server over the generation engine, as vLLM's OpenAI server is one over vLLM's.

    python -m lmzoo.cli.serve --workdir=runs/gpt2 [--host=127.0.0.1] [--port=8000] [--slots=16] [--chunk=16]
    python -m lmzoo.cli.serve --init_from=hf:/models/Llama-3.2-1B-Instruct --max_model_len=4096

Serves a train.py run's latest (or --step's) checkpoint, a LoRA run merged into its base, or a HuggingFace folder
(`--init_from=hf:FOLDER`, or a Hub id in the local cache) with its tokenizer and chat template:

- POST /v1/completions: a prompt (a string, a list of them, token ids or a list of those); max_tokens, temperature,
  top_p, top_k, n, seed, stop, stop_token_ids, logprobs, echo (with max_tokens=0: the prompt scored alone), stream.
- POST /v1/chat/completions: messages through the chat template, ending at the end of the assistant's turn.
- GET /v1/models, GET /health; vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval's remote tokenizer).

Requests go to one `lmzoo.serving.engine.Engine` stepping on a thread of its own (continuous batching over
--slots); a handler submits and awaits the engine's updates through an asyncio.Queue. Requests beyond the slots wait
in the engine's queue; a client that disconnects cancels its request, whose slots free at the next chunk. Bad input
is answered 400 with an OpenAI-style error naming the problem (404 for a model the server does not serve). It binds
127.0.0.1 unless --host says otherwise, and SIGTERM or Ctrl-C stops it (it writes nothing). docs/serve.md.
A user error on the command line exits with status 2 and one `error:` line.
"""

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import random
import signal
import sys
import time
import uuid
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from aiohttp import web

from lmzoo import models, storage, tokenizers, weights
from lmzoo.convert import hf
from lmzoo.data import chat
from lmzoo.kernels import host_memory
from lmzoo.models import kinds
from lmzoo.serving import engine as engine_lib
from lmzoo.serving.slots import mask_padded_vocab
from lmzoo.train import compilation_cache
from lmzoo.train import run as run_lib

MAX_LOGPROBS = 20  # the most alternatives `logprobs` / `top_logprobs` may ask for (vLLM's default max_logprobs)
MAX_STOP_TOKEN_IDS = 4  # stop_token_ids a request may add to the tokenizer's eos ids
_CLOSED = object()  # what a pending request's queue receives when the server shuts down
# Fields the engine does not implement, with the value that asks for nothing (a request giving another is refused).
UNSUPPORTED = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_p": 0,
    "min_tokens": 0,
    "ignore_eos": False,
    "logit_bias": {},
    "suffix": "",
    "tools": [],
    "functions": [],
}


class ApiError(Exception):
    """A request the server refuses: answered with `status` and OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


# ---------------------------------------------------------------------------------------------------------------------
# What is served


@dataclasses.dataclass
class Served:
    """A decoder to serve: its params, tokenizer, chat template (None: chat requests are refused, saying
    `no_template`, why), the name requests give and where it came from."""

    name: str
    model: nn.Module
    params: Any
    tokenizer: tokenizers.Tokenizer
    template: chat.ChatTemplate | None
    source: str
    no_template: str = ""


def _decoder(model, params, where: str):
    model, params = kinds.generative(model, params)  # a PPO policy: its decoder
    if kinds.kind_of(model) != kinds.DECODER:
        raise ValueError(f"{where} is a {type(model).__name__}; the server generates with decoders (gpt2, llama)")
    return kinds.decoding_form(model, params)


def _template(path: str | None, default) -> tuple[chat.ChatTemplate | None, str]:
    """(the chat template at `path`, else `default()`'s, ""), or (None, why not) where the model has none or its own
    does not load: the server still serves completions, and refuses chat requests saying why."""
    if path:
        return chat.load_template(path), ""
    try:
        return default(), ""
    except (ValueError, FileNotFoundError) as e:
        logging.warning("chat completions are refused: %s", e)
        return None, str(e)


def load_run(workdir: str, step: int | None = None, *, chat_template: str | None = None, name: str | None = None):
    """A train.py run's latest (or `step`'s) checkpoint as `Served` (a LoRA run merged into its base, by `run.load`);
    its chat template is `chat_template`, else the run's (`chat.run_template`)."""
    loaded = run_lib.load(workdir, step)
    model, params = _decoder(loaded.model, loaded.params, f"--workdir={workdir}")
    template, why = _template(chat_template, lambda: chat.run_template(loaded.config, loaded.tokenizer))
    return Served(name or workdir, model, params, loaded.tokenizer, template, f"{workdir} (step {loaded.step})", why)


# The families the server reads from HF folders: the decoders with a KV cache the engine fills.
SERVED_FAMILIES = ("gpt2", "llama", "deepseek", "qwen3_5")


def _family(hf_config: dict, where: str) -> str:
    """The lmzoo family of an HF decoder's config.json (`convert.hf.family_of`); ValueError naming what is served."""
    model_type = hf_config.get("model_type")
    family = hf.family_of(str(model_type))
    if family in SERVED_FAMILIES:
        return family
    served = ", ".join(t for f in SERVED_FAMILIES for t in hf.FAMILIES[f].MODEL_TYPES)
    raise ValueError(f"{where}/config.json has model_type {model_type!r}; the server reads the decoders {served}")


def load_pretrained(spec: str, *, chat_template: str | None = None, name: str | None = None) -> Served:
    """A HuggingFace checkpoint ("hf:FOLDER", a bucket prefix or a cached Hub id) as `Served`: the lmzoo model its
    config.json describes, its weights converted (`convert.hf`), its tokenizer.json with its special tokens and eos
    ids, and its chat template (`chat_template` instead where given)."""
    if not spec.startswith("hf:") or spec == "hf:":
        raise ValueError(f"--init_from={spec}: give hf:FOLDER (a HuggingFace folder) or hf:ORG/NAME (a cached Hub id)")
    folder = hf.resolve_folder(spec.removeprefix("hf:"))
    if not storage.exists(f"{folder}/config.json"):
        raise FileNotFoundError(f"--init_from={spec}: {folder}/config.json not found (a HuggingFace checkpoint folder)")
    family = _family(json.loads(storage.read_text(f"{folder}/config.json")), folder)
    model = models.build_model(family, hf.checkpoint_fields(spec, family))
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"])
    params, _ = hf.convert_pretrained(spec, family, model.config, shapes)
    tokenizer = weights.pretrained_tokenizer(spec)
    template, why = _template(chat_template, lambda: chat.load_template(folder))
    return Served(name or spec.removeprefix("hf:"), model, params, tokenizer, template, spec, why)


# ---------------------------------------------------------------------------------------------------------------------
# Request fields

_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _get(body: dict, name: str, kind: type, default=None):
    """body[name] checked to be of `kind` (an int is a number; a bool is neither), or `default` where absent or null."""
    value = body.get(name)
    if value is None:
        return default
    kinds_ok = (int, float) if kind is float else (kind,)
    if not isinstance(value, kinds_ok) or (isinstance(value, bool) and kind is not bool):
        raise ApiError(f"'{name}' must be {_KINDS[kind]}, got {value!r}", param=name)
    return kind(value)


def _strings(body: dict, name: str) -> tuple[str, ...]:
    value = body.get(name)
    values = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ApiError(f"'{name}' must be a string or a list of strings, got {value!r}", param=name)
    return tuple(v for v in values if v)


def _token_ids(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(f"'{name}' must be a list of token ids (integers), got {str(value)[:80]}", param=name)
    return value


@dataclasses.dataclass(frozen=True)
class Settings:
    """A request's sampling settings, checked. logprobs: None (none reported), or how many alternatives each token's
    entry lists besides the token itself (0: the token alone)."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    n: int
    seed: int
    stop: tuple[str, ...]
    stop_ids: tuple[int, ...]
    logprobs: int | None
    echo: bool
    stream: bool
    include_usage: bool


def settings(body: dict, *, is_chat: bool) -> Settings:
    """The sampling settings of a completions (or, `is_chat`, chat completions) request body; ApiError naming the
    first bad field. The engine checks the values against the model (`Engine.check`)."""
    for field, neutral in UNSUPPORTED.items():
        if body.get(field) not in (None, neutral):
            raise ApiError(f"'{field}' is not supported by this server (only its default, {neutral!r})", param=field)
    n = _get(body, "n", int, 1)
    if n < 1:
        raise ApiError(f"'n' must be at least 1, got {n}", param="n")
    if _get(body, "best_of", int, n) != n:
        raise ApiError("'best_of' other than n is not supported by this server", param="best_of")
    if is_chat:
        max_tokens = _get(body, "max_completion_tokens", int, _get(body, "max_tokens", int))
        logprobs = _get(body, "top_logprobs", int, 0) if _get(body, "logprobs", bool, False) else None
    else:
        # null: the rest of the context (vLLM's reading); absent: OpenAI's default, 16
        max_tokens = None if "max_tokens" in body and body["max_tokens"] is None else _get(body, "max_tokens", int, 16)
        logprobs = _get(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        name = "top_logprobs" if is_chat else "logprobs"
        raise ApiError(f"'{name}' must be between 0 and {MAX_LOGPROBS}, got {logprobs}", param=name)
    echo = False if is_chat else _get(body, "echo", bool, False)
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        raise ApiError(
            f"'max_tokens' must be at least 1 (0 only with echo=true, to score the prompt), got {max_tokens}",
            param="max_tokens",
        )
    top_k = _get(body, "top_k", int, 0)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("'stream_options' must be an object", param="stream_options")
    seed = _get(body, "seed", int)
    stop_ids = tuple(_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"))
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(f"at most {MAX_STOP_TOKEN_IDS} 'stop_token_ids', got {len(stop_ids)}", param="stop_token_ids")
    return Settings(
        max_tokens=max_tokens,
        temperature=_get(body, "temperature", float, 1.0),
        top_p=_get(body, "top_p", float, 1.0),
        top_k=0 if top_k == -1 else top_k,  # vLLM's -1: off
        n=n,
        seed=random.SystemRandom().randrange(2**31) if seed is None else seed,
        stop=_strings(body, "stop"),
        stop_ids=stop_ids,
        logprobs=logprobs,
        echo=echo,
        stream=_get(body, "stream", bool, False),
        include_usage=bool(options.get("include_usage")),
    )


def _messages(body: dict) -> list[dict]:
    """The request's messages, each content a string (text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of {'role': ..., 'content': ...}", param="messages")
    out = []
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(f"messages[{k}] must be an object with a string 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise ApiError(f"messages[{k}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise ApiError(f"messages[{k}].content must be a string or a list of text parts", param="messages")
        out.append({**message, "content": content or ""})
    return out


def _held_back(text: str, stops: tuple[str, ...]) -> str:
    """The part of a running sample's text that can be streamed: without a trailing U+FFFD (a character whose bytes
    have not all come) nor a tail that may begin a stop string (the engine cuts the text before one)."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = max([k for s in stops for k in range(1, len(s)) if text[:end].endswith(s[:k])], default=0)
    return text[: end - hold]


# ---------------------------------------------------------------------------------------------------------------------
# Scoring: the model's log-probs over a sequence (echo=true, the alternatives of `logprobs`), one forward pass


@functools.partial(jax.jit, static_argnames=("model", "top", "vocab_size"))
def _score(model, params, tokens, mask, scale, *, top: int, vocab_size: int | None):
    """tokens [B, T] right-padded (mask [B, T]), scale [B, T-1] (what position t's logits are divided by: a sample's
    temperature) -> (log-probs [B, T-1] of tokens[:, 1:], the `top` likeliest ids [B, T-1, top] below `vocab_size`
    and their log-probs). Log-probs are over the model's whole vocabulary, as the engine's and lmzoo's scoring."""
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    logits = model.apply({"params": params}, tokens, positions=positions, segment_ids=mask)
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / scale[..., None])
    taken = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
    _, top_ids = jax.lax.top_k(mask_padded_vocab(log_probs, vocab_size), top)  # ids a tokenizer decodes
    return taken, top_ids, jnp.take_along_axis(log_probs, top_ids, axis=-1)


# ---------------------------------------------------------------------------------------------------------------------
# The server


@dataclasses.dataclass
class _Sample:
    """One choice of a response: its tokens, their log-probs, its text and why it ended."""

    tokens: list[int]
    log_probs: list[float]
    text: str
    finish_reason: str | None

    @classmethod
    def of(cls, output: engine_lib.Output, state: tuple[int, str, str | None]):
        """An engine output as it stood in `state` (its token count, text and finish reason then)."""
        count, text, finish_reason = state
        return cls(output.tokens[:count], output.log_probs[:count], text, finish_reason)


class Server:
    """The HTTP application over one engine. `start` binds and starts the engine's thread, `close` stops both;
    `run` does the two around SIGTERM / Ctrl-C (the command line's)."""

    def __init__(
        self,
        served: Served,
        *,
        slots: int = 16,
        chunk: int = 16,
        length: int | None = None,
        lanes: int | None = None,
    ):
        self.served, self.tokenizer = served, served.tokenizer
        self.params = jax.device_put(served.params)
        eos_ids = self.tokenizer.eos_ids
        self.engine = engine_lib.Engine(
            served.model,
            self.params,
            slots=slots,
            length=length,
            chunk=chunk,
            lanes=lanes,
            eos_ids=eos_ids,
            pad_id=self.tokenizer.pad_id or 0,
            vocab_size=self.tokenizer.vocab_size,
            tokenizer=self.tokenizer,
            max_stop_ids=len(eos_ids) + MAX_STOP_TOKEN_IDS,
        )
        self.context = self.engine.length
        self.end_of_turn = chat.user_turn(served.template, "hello")[1] if served.template else ""
        self.created = int(time.time())
        self.pending: set[asyncio.Queue] = set()  # the queues of requests being answered
        self.cancelled = 0  # requests cancelled before they finished: their client went away, or the server stopped
        self._scorer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmzoo-score")
        self._runner: web.AppRunner | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.app = web.Application(middlewares=[_errors], client_max_size=64 * 2**20)
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/tokenizer_info", self.tokenizer_info),
            ]
        )

    # ---- lifecycle

    def warm_up(self) -> None:
        """Compiles the engine's programs (a prefill, an insert, a chunk) on one short request, before serving."""
        self.engine.generate([engine_lib.Request(prompt=(0,), max_tokens=1, temperature=0.0)])

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        """Binds host:port (0: a free port) and starts the engine; returns the port."""
        self.loop = asyncio.get_running_loop()
        self.engine.start()
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError:
            await self.close()
            raise
        return site.port

    async def close(self) -> None:
        """Ends every pending request (503, or an error event on a stream), stops listening, then the engine."""
        for queue in list(self.pending):
            queue.put_nowait(_CLOSED)
        if self._runner is not None:
            await self._runner.cleanup()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)
        self._scorer.shutdown()

    def run(self, host: str, port: int) -> None:
        """Serves until SIGTERM or Ctrl-C."""

        async def main():
            stopping = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
            bound = await self.start(host, port)
            print(
                f"serving {self.served.name!r} on http://{host}:{bound}/v1 ({self.engine.slots} slots in {len(self.engine.lanes)} lanes)",
                flush=True,
            )
            await stopping.wait()
            print("shutting down", file=sys.stderr, flush=True)
            await self.close()

        asyncio.run(main())

    # ---- following the engine

    async def _follow(self, requests: list[engine_lib.Request]):
        """Submits `requests` and yields (request index, its ticket's outputs, (token count, text, finish reason) of
        each as it stood) after each engine chunk that changed one, until all are done. Closed early (the client went
        away, the server stops) it cancels those still running."""
        if self.engine.failure is not None:
            raise ApiError(f"the engine has failed: {self.engine.failure!r}", 500, "InternalServerError")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_update(index):
            def update(ticket):  # on the engine's thread, between chunks: its outputs hold still
                # What each output holds now; its token lists only grow, so the loop's thread reads them up to there.
                states = [(len(o.tokens), o.text or "", o.finish_reason) for o in ticket.outputs]
                with contextlib.suppress(RuntimeError):  # the loop has closed
                    loop.call_soon_threadsafe(queue.put_nowait, (index, ticket, states))

            return update

        tickets = []
        self.pending.add(queue)
        try:
            tickets = [self.engine.submit(r, on_update(i)) for i, r in enumerate(requests)]
            running = len(tickets)
            while running:
                item = await queue.get()
                if item is _CLOSED:
                    raise ApiError("the server is shutting down", 503, "ServiceUnavailableError")
                index, ticket, states = item
                if ticket.error is not None:
                    raise ApiError(f"the engine has failed: {ticket.error!r}", 500, "InternalServerError")
                running -= all(reason is not None for _, _, reason in states)
                yield index, ticket.outputs, states
        finally:
            self.pending.discard(queue)
            cancelled = [t for t in tickets if not t.done]
            for ticket in cancelled:
                ticket.cancel()
            self.cancelled += len(cancelled)

    # ---- log-probs

    @functools.lru_cache(maxsize=2**16)  # noqa: B019  (one server per process; ids are few)
    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token])

    async def _scored(self, rows: list[tuple[list[int], int, float]], top: int):
        """For each (tokens, prompt length P, temperature): (log-probs of tokens[1:], their `top` alternatives as
        [(id, log-prob)] per position), the prompt's positions at temperature 1, the rest at the sample's."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._scorer, self._score_rows, rows, top)

    def _score_rows(self, rows, top):
        width = engine_lib.bucket(max(len(r[0]) for r in rows), self.context, minimum=16)
        batch = engine_lib.bucket(len(rows))
        tokens, mask = np.zeros((batch, width), np.int32), np.zeros((batch, width), np.int32)
        scale = np.ones((batch, width - 1), np.float32)
        for b, (ids, prompt_len, temperature) in enumerate(rows):
            tokens[b, : len(ids)], mask[b, : len(ids)] = ids, 1
            scale[b, prompt_len - 1 :] = temperature if temperature > 0 else 1.0
        vocab = self.served.model.config.vocab_size
        taken, ids, values = jax.device_get(
            _score(
                self.served.model,
                self.params,
                jnp.asarray(tokens),
                jnp.asarray(mask),
                jnp.asarray(scale),
                top=min(MAX_LOGPROBS, vocab),
                vocab_size=self.tokenizer.vocab_size,
            )
        )
        out = []
        for b, (row, _, _) in enumerate(rows):
            n = len(row) - 1
            alternatives = [
                list(zip(ids[b, t, :top].tolist(), values[b, t, :top].tolist(), strict=True)) for t in range(n)
            ]
            out.append((taken[b, :n].tolist(), alternatives))
        return out

    def _entries(self, tokens, values, alternatives) -> list[tuple[int, float | None, dict | None]]:
        """(token, log-prob, {piece: log-prob} of its alternatives and itself) per token; None where not known."""
        out = []
        for k, (token, value) in enumerate(zip(tokens, values, strict=True)):
            if value is None:
                out.append((token, None, None))
                continue
            top = {self._piece(i): v for i, v in (alternatives[k] if alternatives else [])}
            out.append((token, value, {**top, self._piece(token): value}))
        return out

    async def _logprob_entries(self, prompt, sample: _Sample, settings: Settings, *, echo: bool):
        """The entries (`_entries`) of the echoed prompt (first token: None) and the sample's tokens; the
        alternatives of generated tokens come from a forward pass, the sampled tokens' log-probs from the engine."""
        need_pass = echo or (settings.logprobs or 0) > 0
        if not need_pass:
            return self._entries(sample.tokens, sample.log_probs, None)
        row = list(prompt) + sample.tokens
        [(taken, alternatives)] = await self._scored([(row, len(prompt), settings.temperature)], settings.logprobs or 0)
        generated = self._entries(sample.tokens, sample.log_probs, alternatives[len(prompt) - 1 :] or None)
        if not echo:
            return generated
        prompt_part = self._entries(prompt, [None, *taken[: len(prompt) - 1]], [None, *alternatives[: len(prompt) - 1]])
        return prompt_part + generated

    def _completion_logprobs(self, entries, offset: int = 0) -> dict:
        """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        pieces = [self._piece(token) for token, _, _ in entries]
        offsets = np.cumsum([offset] + [len(p) for p in pieces])[:-1].tolist()
        return {
            "tokens": pieces,
            "token_logprobs": [value for _, value, _ in entries],
            "top_logprobs": [top for _, _, top in entries],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, entries, top: int) -> dict:
        """OpenAI's chat logprobs: content, a list of {token, logprob, bytes, top_logprobs}."""

        def entry(piece, value):
            return {"token": piece, "logprob": value, "bytes": list(piece.encode("utf-8"))}

        content = []
        for token, value, alternatives in entries:
            ranked = sorted((alternatives or {}).items(), key=lambda item: -item[1])[:top]
            content.append({**entry(self._piece(token), value), "top_logprobs": [entry(p, v) for p, v in ranked]})
        return {"content": content}

    # ---- endpoints

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.served.name:
            raise ApiError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
        return body

    def _request(self, prompt: list[int], settings: Settings) -> engine_lib.Request:
        """The engine's request for one prompt (max_tokens null: the rest of the context), checked; max_tokens 0
        (echo alone: the prompt is scored, nothing generated) is checked here, the engine never running it."""
        max_tokens = settings.max_tokens
        if max_tokens is None:
            max_tokens = max(self.context - len(prompt), 1)  # at least 1: a prompt too long is refused as such
        request = engine_lib.Request(
            prompt=tuple(prompt),
            max_tokens=max_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            seed=settings.seed,
            n=settings.n,
            stop_ids=settings.stop_ids,
            stop=settings.stop,
        )
        try:
            if max_tokens > 0:
                self.engine.check(request)
                return request
            self.engine.check(dataclasses.replace(request, prompt=(0,), max_tokens=1))  # the sampling settings
            if not 1 <= len(prompt) <= self.context:
                raise ValueError(
                    f"the prompt has {len(prompt)} tokens; scoring it needs 1 to {self.context} (the context)"
                )
            limit = self.engine.vocab_size or self.engine.model_vocab
            bad = [t for t in prompt if not 0 <= t < limit]
            if bad:
                raise ValueError(f"the prompt has token ids outside [0, {limit}): {bad[:5]}")
        except ValueError as e:
            raise ApiError(str(e), param="prompt" if "prompt" in str(e) else None) from None
        return request

    def _prompts(self, body: dict) -> list[list[int]]:
        """The prompts of a completions request as token ids: a string, a list of strings, a list of token ids, or a
        list of lists of them. The text is encoded as the model was trained (no BOS added)."""
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [self.tokenizer.encode(p) for p in prompt]
            if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
                return [prompt]
            if all(isinstance(p, list) and p for p in prompt):
                return [_token_ids(p, "prompt") for p in prompt]
        raise ApiError(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists (non-empty)",
            param="prompt",
        )

    def _chat_prompt(self, body: dict) -> list[int]:
        if self.served.template is None:
            raise ApiError(
                f"the model {self.served.name!r} has no chat template ({self.served.no_template}); restart the server "
                "with --chat_template=FILE (a .jinja file, a tokenizer_config.json or the folder holding one)"
            )
        add_generation_prompt = _get(body, "add_generation_prompt", bool, True)
        try:
            text, _ = self.served.template.render(
                _messages(body), where="the request's messages", add_generation_prompt=add_generation_prompt
            )
        except ValueError as e:
            raise ApiError(str(e), param="messages") from None
        return self.tokenizer.encode(text)

    async def completions(self, http: web.Request) -> web.StreamResponse:
        body = await self._body(http)
        settings_ = settings(body, is_chat=False)
        prompts = self._prompts(body)
        requests = [self._request(prompt, settings_) for prompt in prompts]
        return await self._respond(http, prompts, requests, settings_, is_chat=False)

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        body = await self._body(http)
        settings_ = settings(body, is_chat=True)
        prompt = self._chat_prompt(body)
        settings_ = dataclasses.replace(
            settings_, stop=settings_.stop + ((self.end_of_turn,) if self.end_of_turn else ())
        )
        return await self._respond(http, [prompt], [self._request(prompt, settings_)], settings_, is_chat=True)

    async def _respond(self, http, prompts, requests, settings_: Settings, *, is_chat: bool):
        """Runs checked `requests` (one per prompt) and answers whole or as a stream."""
        kind = ("chat.completion" if is_chat else "text_completion") + (
            ".chunk" if settings_.stream and is_chat else ""
        )
        request_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"
        envelope = {"id": request_id, "object": kind, "created": int(time.time()), "model": self.served.name}
        n = settings_.n
        texts = [self.tokenizer.decode(p) if settings_.echo else "" for p in prompts]
        if settings_.max_tokens == 0 and not settings_.stream:  # echo alone: the prompts scored, nothing generated
            samples = {(i, j): _Sample([], [], "", "length") for i in range(len(prompts)) for j in range(n)}
            return await self._whole(envelope, prompts, samples, texts, settings_, is_chat)
        if settings_.stream:
            return await self._stream(http, envelope, prompts, requests, texts, settings_, is_chat)
        samples = {}
        async with contextlib.aclosing(self._follow(requests)) as updates:
            async for i, outputs, states in updates:
                for j, (output, state) in enumerate(zip(outputs, states, strict=True)):
                    if state[2] is not None and (i, j) not in samples:
                        samples[i, j] = _Sample.of(output, state)
        return await self._whole(envelope, prompts, samples, texts, settings_, is_chat)

    def _usage(self, prompts, samples) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(s.tokens) for s in samples)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def _whole(self, envelope, prompts, samples, texts, settings_: Settings, is_chat: bool) -> web.Response:
        """The response to a request that did not ask to stream: every choice, whole, with the usage."""
        choices = []
        for (i, j), sample in sorted(samples.items()):
            choice: dict[str, Any] = {"index": i * settings_.n + j}
            logprobs = None
            if settings_.logprobs is not None:
                entries = await self._logprob_entries(prompts[i], sample, settings_, echo=settings_.echo)
                logprobs = (
                    self._chat_logprobs(entries, settings_.logprobs) if is_chat else self._completion_logprobs(entries)
                )
            if is_chat:
                choice["message"] = {"role": "assistant", "content": sample.text}
            else:
                choice["text"] = texts[i] + sample.text
            choices.append({**choice, "logprobs": logprobs, "finish_reason": sample.finish_reason, "stop_reason": None})
        usage = self._usage(prompts, samples.values())
        return web.json_response({**envelope, "choices": choices, "usage": usage})

    async def _stream(self, http, envelope, prompts, requests, texts, settings_: Settings, is_chat: bool):
        """Server-sent events: each choice's new text (and its tokens' log-probs) after each engine chunk, its finish
        reason when it ends, the usage if asked, then `data: [DONE]`; an error after the start as an error event."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(http)
        n, finished = settings_.n, {}
        sent_text, sent_tokens = {}, {}

        async def send(index: int, text: str, entries, finish_reason, first: bool = False) -> None:
            if is_chat:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta}
                logprobs = self._chat_logprobs(entries, settings_.logprobs or 0) if entries else None
            else:
                choice = {"index": index, "text": text}
                logprobs = self._completion_logprobs(entries) if entries else None
            choice |= {"logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": None}
            await _event(response, {**envelope, "choices": [choice]})

        try:
            for i in range(len(prompts)):
                for j in range(n):
                    if is_chat or settings_.echo:
                        await send(i * n + j, texts[i], None, None, first=True)
            if settings_.max_tokens == 0:  # echo alone: nothing to follow
                for i in range(len(prompts)):
                    for j in range(n):
                        finished[i, j] = _Sample([], [], "", "length")
                        await send(i * n + j, "", None, "length")
            async with contextlib.aclosing(self._follow(requests if settings_.max_tokens != 0 else [])) as updates:
                async for i, outputs, states in updates:
                    for j, (output, (count, now, reason)) in enumerate(zip(outputs, states, strict=True)):
                        key, text, sent = (i, j), sent_text.get((i, j), ""), sent_tokens.get((i, j), 0)
                        if key in finished:
                            continue
                        if reason is not None:
                            whole = finished[key] = _Sample.of(output, (count, now, reason))
                            tokens, log_probs = whole.tokens[sent:], whole.log_probs[sent:]
                        else:
                            tokens, log_probs = output.tokens[sent:count], output.log_probs[sent:count]
                        shown = now if reason else _held_back(now, requests[i].stop)
                        delta = shown[len(text) :] if shown.startswith(text) else ""
                        entries = self._entries(tokens, log_probs, None) if settings_.logprobs is not None else None
                        if delta or entries or reason:
                            await send(i * n + j, delta, entries, reason)
                        sent_text[key], sent_tokens[key] = text + delta, sent + len(tokens)
            if settings_.include_usage:
                await _event(response, {**envelope, "choices": [], "usage": self._usage(prompts, finished.values())})
        except ApiError as e:
            await _event(response, e.body())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(self, http: web.Request) -> web.Response:
        card = {
            "id": self.served.name,
            "object": "model",
            "created": self.created,
            "owned_by": "lmzoo",
            "root": self.served.source,
            "parent": None,
            "max_model_len": self.context,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, http: web.Request) -> web.Response:
        if self.engine.failure is not None:
            raise ApiError(f"the engine has failed: {self.engine.failure!r}", 503, "ServiceUnavailableError")
        return web.Response(status=200)

    async def tokenize(self, http: web.Request) -> web.Response:
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} -> the token ids (as the server encodes them)."""
        body = await self._body(http)
        if body.get("messages") is not None:
            tokens = self._chat_prompt(body)
        elif isinstance(body.get("prompt"), str):
            tokens = self.tokenizer.encode(body["prompt"])
        else:
            raise ApiError("give 'prompt' (a string) or 'messages'", param="prompt")
        return web.json_response(
            {"count": len(tokens), "max_model_len": self.context, "tokens": tokens, "token_strs": None}
        )

    async def detokenize(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        tokens = _token_ids(body.get("tokens"), "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def tokenizer_info(self, http: web.Request) -> web.Response:
        """vLLM's /tokenizer_info, which lm-eval's remote tokenizer reads: the special tokens as text (None where the
        text does not encode back to the token: a byte or character tokenizer's <eos>) and the chat template."""

        def special(token: int | None) -> str | None:
            if token is None:
                return None
            text = self.tokenizer.decode([token])
            return text if self.tokenizer.encode(text) == [token] else None

        tok = self.tokenizer
        info = {
            "tokenizer_class": type(tok).__name__,
            "eos_token": special(tok.eos_id),
            "bos_token": special(tok.bos_id),
            "pad_token": special(tok.pad_id),
            "chat_template": self.served.template.text if self.served.template else None,
            "model_max_length": self.context,
            "vocab_size": tok.vocab_size,
        }
        return web.json_response(info)


async def _event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())


@web.middleware
async def _errors(request: web.Request, handler):
    """ApiError as OpenAI's error body; anything unexpected as a 500 with its message (and logged)."""
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException:
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001  (the client gets the message; the log the traceback)
        logging.exception("request %s failed", request.path)
        error = ApiError(f"{type(e).__name__}: {e}", 500, "InternalServerError")
        return web.json_response(error.body(), status=500)


# ---------------------------------------------------------------------------------------------------------------------
# The command line


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and status 2, as every user error of the entry points
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's flags, checked (ValueError naming the flag)."""
    parser = _Parser(prog="python -m lmzoo.cli.serve", description="Serve a run or a HuggingFace checkpoint.")
    parser.add_argument("--workdir", help="A train.py run to serve (a LoRA run is served merged into its base).")
    parser.add_argument("--step", type=int, help="With --workdir: serve this checkpoint step instead of the latest.")
    parser.add_argument(
        "--init_from", help="Serve a HuggingFace checkpoint instead: hf:FOLDER (local, gs://, s3://) or hf:ORG/NAME."
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on; 0.0.0.0 opens it to the network.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (0: a free one, printed).")
    parser.add_argument("--slots", type=int, default=16, help="Sequences decoded together; more requests wait.")
    parser.add_argument("--chunk", type=int, default=16, help="Decode steps per device call (requests join between).")
    parser.add_argument(
        "--lanes",
        type=int,
        help="Lanes the slots are split into, each stepped on a thread of its own (default: one a core on a CPU, "
        "each of at least 8 slots; one on an accelerator).",
    )
    parser.add_argument(
        "--max_model_len", type=int, help="Positions per slot, prompt and reply (default: the model's)."
    )
    parser.add_argument("--served_model_name", help="The model name requests give (default: --workdir or --init_from).")
    parser.add_argument(
        "--chat_template",
        help="A chat template (.jinja, tokenizer_config.json or their folder) instead of the model's.",
    )
    args = parser.parse_args(argv)
    if bool(args.workdir) == bool(args.init_from):
        raise ValueError("give --workdir=RUN (a train.py run) or --init_from=hf:FOLDER (a HuggingFace checkpoint)")
    if args.step is not None and not args.workdir:
        raise ValueError("--step picks a checkpoint of --workdir's run; --init_from has none")
    for name in ("slots", "chunk", "lanes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)}: must be at least 1")
    if args.lanes is not None and args.slots % args.lanes:
        raise ValueError(f"--lanes={args.lanes}: must divide --slots={args.slots} evenly (each lane gets as many)")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max_model_len={args.max_model_len}: must be at least 2")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port={args.port}: must be in [0, 65535]")
    return args


def main(argv: list[str] | None = None) -> None:
    with run_lib.user_errors():
        args = parse_args(argv)
        host_memory.one_heap_per_core()  # what each compile frees, the next reuses
        compilation_cache.enable()
        options = dict(chat_template=args.chat_template, name=args.served_model_name)
        if args.workdir:
            served = load_run(args.workdir, args.step, **options)
        else:
            served = load_pretrained(args.init_from, **options)
        server = Server(served, slots=args.slots, chunk=args.chunk, length=args.max_model_len, lanes=args.lanes)
        print(f"compiling the engine for {served.source} ...", file=sys.stderr, flush=True)
        server.warm_up()
        server.run(args.host, args.port)


if __name__ == "__main__":
    main()
