"""The generation engine's host side: requests in, continuous batching over the slots of `slots.py`, outputs out.

`Engine` keeps S slots of one KV cache. Between device calls it admits waiting requests into free slots (prefilling
each prompt once, copied into one slot per sample: prefix sharing for n > 1), runs one `decode_chunk` of several
steps, hands each request its new tokens (a callback streams them), applies stop strings, and frees the slots of
finished or cancelled requests, so a finished row's slot takes the next request at the next boundary. Requests
beyond the slots wait in order; none is dropped.

Use it synchronously (`generate`: submit, step until done) or from other threads (`start` runs the stepping loop on
a thread of its own, `submit` and `Ticket.cancel` are thread-safe, `Ticket.wait` blocks). Only the engine's thread
calls JAX.
"""

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmzoo import decoding
from lmzoo.serving import slots as device

_MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request: `n` samples of up to `max_tokens` tokens after `prompt` (token ids).

    temperature 0 is greedy; top_k 0 and top_p 1 filter nothing; `seed` fixes the samples (sample j draws from
    fold_in(key(seed), j), whatever slot it runs in). A sample stops after one of the engine's EOS ids or of
    `stop_ids`, or when its text contains one of `stop` (strings; the text is cut before it)."""

    prompt: tuple[int, ...]
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    n: int = 1
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()


@dataclasses.dataclass
class Output:
    """One sample: its tokens (the stop id included), their log-probs, the text (with a tokenizer: the tokens up to
    the stop id, cut before a stop string) and why it ended: "stop", "length", "cancelled" or "error" (the engine's
    thread failed: `Ticket.error`); None while running."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    # Incremental decoding (`_set_text`): text holds the decode of tokens[:read]; tokens[prefix:read] are decoded again
    # beside the new ones, so that what a token's text depends on before it (a leading space) stays right.
    _prefix: int = dataclasses.field(default=0, repr=False)
    _read: int = dataclasses.field(default=0, repr=False)


class Ticket:
    """A submitted request: its `outputs` (one per sample) fill as the engine runs. `on_update(ticket)`, if given,
    runs on the engine's thread after each chunk that changed an output."""

    def __init__(self, request: Request, on_update: Callable[["Ticket"], None] | None = None):
        self.request = request
        self.outputs = [Output() for _ in range(request.n)]
        self.on_update = on_update
        self.cancelled = False
        self.error: Exception | None = None  # why the engine failed it (finish_reason "error")
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Stop this request at the next chunk boundary (a client that went away): its slots are freed."""
        self.cancelled = True


def bucket(size: int, limit: int | None = None, minimum: int = 1) -> int:
    """The power of two >= size (at least `minimum`), at most `limit` (None: no limit): shapes compiled once."""
    rounded = max(minimum, 1 << max(size - 1, 0).bit_length())
    return rounded if limit is None else min(rounded, limit)


class Engine:
    """Continuous batching over `slots` slots of `length` positions (default: the model's max_len) for a decoder.

    Args:
        model, params: a decoder that runs with `decode=True` (every lmzoo decoder family; LoRA runs merged first).
        slots: S, the rows decoded together.
        length: positions per slot: a request's prompt plus max_tokens must fit (default: the model's max_len).
        chunk: decode steps per device call; the host admits and frees slots between chunks.
        short_chunk: the decode steps of a call while serving (the engine steps on its own thread: `start`) with a
            slot free or a request yet to sample its first token: a request arriving mid-chunk waits at most that
            many steps for its slot, and its first token comes back after that many more (default chunk // 4; one
            compiled program serves both lengths).
        eos_ids: ids that end every sample (a checkpoint may have several).
        pad_id: the id recorded after a sample ended.
        vocab_size: the tokenizer's vocabulary (ids at or above it are never drawn); None: the model's.
        tokenizer: decodes outputs' text and matches stop strings (None: token ids only).
        max_stop_ids: the most stop ids (EOS ids included) one request may have.
        prefill_batch: the most prompts prefilled in one call.
        mesh, rules: run every program under this mesh and these logical axis rules (`lmzoo.sharding`), params
            placed on it (e.g. a trainer's `host_params` or `init_from` weights read into their shardings); the
            engine enters them on whichever thread steps it.
    """

    def __init__(
        self,
        model: nn.Module,
        params,
        *,
        slots: int = 16,
        length: int | None = None,
        chunk: int = 16,
        short_chunk: int | None = None,
        eos_ids: Sequence[int] = (),
        pad_id: int = 0,
        vocab_size: int | None = None,
        tokenizer=None,
        max_stop_ids: int = 4,
        prefill_batch: int = 8,
        mesh: jax.sharding.Mesh | None = None,
        rules: Sequence[tuple[str, object]] = (),
    ):
        model_len = getattr(model.config, "max_len", None)
        self.length = int(length or model_len or 0)
        if self.length < 2:
            raise ValueError("the engine needs length >= 2 positions per slot (the model has no max_len: pass length)")
        if model_len is not None and self.length > model_len:
            raise ValueError(f"length {self.length} exceeds the model's max_len {model_len}")
        self.model, self.params = model, params
        self.slots, self.chunk, self.pad_id = int(slots), int(chunk), int(pad_id)
        self.short_chunk = max(1, self.chunk // 4) if short_chunk is None else short_chunk
        if not 1 <= self.short_chunk <= self.chunk:
            raise ValueError(f"short_chunk={short_chunk} must lie in [1, chunk={self.chunk}]")
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.model_vocab = int(model.config.vocab_size)
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.max_stop_ids = int(max_stop_ids)
        self.prefill_batch = int(prefill_batch)
        self.mesh, self.rules = mesh, tuple(rules)
        with self._placement():
            self._cache, self._state = device.empty(
                model, self.slots, self.length, self.model_vocab, max_stop_ids=self.max_stop_ids
            )
        self._owners: list[tuple[Ticket, int] | None] = [None] * self.slots
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: Exception | None = None  # what ended the engine's thread (`start`), if anything did
        self.stats = collections.Counter()  # prefills, prefilled_prompts, chunks, decode_steps, slot_fills

    # ---- requests ----

    def check(self, request: Request) -> None:
        """Raises ValueError naming the problem and the limit for a request the engine cannot run."""
        prompt_len = len(request.prompt)
        if prompt_len == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens={request.max_tokens}: must be at least 1")
        if prompt_len >= self.length:
            raise ValueError(
                f"the prompt has {prompt_len} tokens; this model's context is {self.length} tokens: shorten it"
            )
        if prompt_len + request.max_tokens > self.length:
            raise ValueError(
                f"the prompt's {prompt_len} tokens + max_tokens {request.max_tokens} exceed the context of "
                f"{self.length} tokens: ask for at most {self.length - prompt_len} tokens"
            )
        decoding.check_sampling(
            temperature=request.temperature, top_k=request.top_k, top_p=request.top_p, vocab_size=self.model_vocab
        )
        if not 1 <= request.n <= self.slots:
            raise ValueError(f"n={request.n}: must be between 1 and the engine's {self.slots} slots")
        limit = self.vocab_size or self.model_vocab
        bad = [t for t in request.prompt if not 0 <= t < limit]
        if bad:
            raise ValueError(f"the prompt has token ids outside [0, {limit}): {bad[:5]}")
        if len(self._stop_ids(request)) > self.max_stop_ids:
            raise ValueError(
                f"{len(self._stop_ids(request))} stop ids (EOS ids included); this engine takes at most "
                f"{self.max_stop_ids} (Engine(max_stop_ids=...))"
            )
        if request.stop and self.tokenizer is None:
            raise ValueError("stop strings need an engine with a tokenizer")

    def _stop_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(dict.fromkeys(self.eos_ids + tuple(request.stop_ids)))

    def submit(self, request: Request, on_update: Callable[[Ticket], None] | None = None) -> Ticket:
        """Queues a checked request (thread-safe); it starts when slots for all its samples are free."""
        if self.failure is not None:
            raise RuntimeError(f"the engine has failed: {self.failure!r}")
        self.check(request)
        ticket = Ticket(request, on_update)
        with self._lock:
            self._waiting.append(ticket)
            self._lock.notify_all()
        return ticket

    def generate(self, requests: Sequence[Request]) -> list[Ticket]:
        """Runs `requests` to completion on the calling thread -> their tickets, in order (not while `start`'s thread
        steps the engine: `submit` and `Ticket.wait` then)."""
        if self._thread is not None:
            raise RuntimeError("the engine steps on its own thread (start): submit requests and wait on their tickets")
        tickets = [self.submit(r) for r in requests]
        while not all(t.done for t in tickets):
            self.step()
        return tickets

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or any(o is not None for o in self._owners)

    # ---- the loop ----

    def _placement(self) -> contextlib.AbstractContextManager:
        if self.mesh is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack

    def step(self) -> None:
        """One boundary and one chunk: drop cancelled work, admit waiting requests, decode, hand out tokens."""
        with self._placement():
            self._step()

    def _step(self) -> None:
        self._release_cancelled()
        self._admit()
        if not any(o is not None for o in self._owners):
            return
        with self._lock:  # the chunk ends early once the next waiting request's samples have slots
            wanted = self._waiting[0].request.n - self._owners.count(None) if self._waiting else 0
        # Served (a thread of its own): short chunks while a request may arrive for a free slot, or one waits for
        # its first token.
        fresh = any(owner is not None and not owner[0].outputs[owner[1]].tokens for owner in self._owners)
        short = self._thread is not None and (None in self._owners or fresh)
        self._cache, self._state, chunk = device.decode_chunk(
            self.model,
            self.params,
            self._cache,
            self._state,
            jnp.int32(max(wanted, 0)),
            jnp.int32(self.short_chunk if short else self.chunk),
            steps=self.chunk,
            vocab_size=self.vocab_size,
            pad_id=self.pad_id,
        )
        tokens, log_probs, emitted, finished, steps = jax.device_get(
            (chunk.tokens, chunk.log_probs, chunk.emitted, chunk.finished, chunk.steps)
        )
        self.stats["chunks"] += 1
        self.stats["decode_steps"] += int(steps)
        self._collect(tokens, log_probs, emitted, finished)

    def _collect(self, tokens, log_probs, emitted, finished) -> None:
        updated: dict[int, Ticket] = {}
        stopped_by_text = []
        for slot, owner in enumerate(self._owners):
            if owner is None:
                continue
            ticket, index = owner
            output = ticket.outputs[index]
            columns = np.flatnonzero(emitted[slot])
            if len(columns) == 0 and not finished[slot]:
                continue
            output.tokens.extend(int(t) for t in tokens[slot, columns])
            output.log_probs.extend(float(p) for p in log_probs[slot, columns])
            updated[id(ticket)] = ticket
            stops = self._stop_ids(ticket.request)
            cut = self._set_text(output, ticket.request, final=bool(finished[slot]))
            if finished[slot]:
                last = output.tokens[-1] if output.tokens else None
                output.finish_reason = "stop" if last in stops else "length"
            elif cut:
                output.finish_reason = "stop"
                stopped_by_text.append(slot)
            if output.finish_reason is not None:
                self._owners[slot] = None
                if all(o.finish_reason is not None for o in ticket.outputs):
                    ticket._done.set()
        if stopped_by_text:
            self._state = _deactivate(self._state, jnp.asarray(stopped_by_text, jnp.int32))
        for ticket in updated.values():
            if ticket.on_update is not None:
                ticket.on_update(ticket)

    def _set_text(self, output: Output, request: Request, *, final: bool) -> bool:
        """Decodes the output's text (up to its stop id, cut before a stop string) -> whether a stop string matched;
        then the tokens (and log-probs) the chunk sampled past it are dropped: the fewest tokens whose text holds it
        stay."""
        if self.tokenizer is None:
            return False
        ids = output.tokens
        if ids and ids[-1] in self._stop_ids(request):
            ids = ids[:-1]
        # Only the new tokens are decoded (with the previous chunk's before them): a long output costs linear time.
        text, start = output.text or "", len(output.text or "")
        before = self.tokenizer.decode(ids[output._prefix : output._read])
        after = self.tokenizer.decode(ids[output._prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):  # else: wait for the character's rest
            text += after[len(before) :]
            output._prefix, output._read = output._read, len(ids)
        longest = max((len(s) for s in request.stop), default=0)
        found = [s for s in request.stop if s and s in text[max(0, start - longest + 1) :]]
        if not found:
            output.text = text
            return False
        output.text = text[: min(text.find(s) for s in found)]
        low, high = 1, len(ids)
        while low < high:
            middle = (low + high) // 2
            prefix = self.tokenizer.decode(ids[:middle])
            low, high = (low, middle) if any(s in prefix for s in found) else (middle + 1, high)
        del output.tokens[low:], output.log_probs[low:]
        return True

    def _release_cancelled(self) -> None:
        with self._lock:
            for ticket in [t for t in self._waiting if t.cancelled]:
                self._waiting.remove(ticket)
                self._finish_cancelled(ticket)
        freed = []
        for slot, owner in enumerate(self._owners):
            if owner is not None and owner[0].cancelled:
                self._owners[slot] = None
                freed.append(slot)
                self._finish_cancelled(owner[0])
        if freed:
            self._state = _deactivate(self._state, jnp.asarray(freed, jnp.int32))

    @staticmethod
    def _finish_cancelled(ticket: Ticket) -> None:
        for output in ticket.outputs:
            output.finish_reason = output.finish_reason or "cancelled"
        ticket._done.set()

    def _admit(self) -> None:
        """Prefills waiting requests, in order, while slots for all their samples are free."""
        free = [slot for slot, owner in enumerate(self._owners) if owner is None]
        group: list[Ticket] = []
        with self._lock:
            while self._waiting and self._waiting[0].request.n <= len(free) - sum(t.request.n for t in group):
                ticket = self._waiting[0]
                candidate = [*group, ticket]
                if len(candidate) > self.prefill_batch or not self._fits(candidate):
                    self._prefill(group, free)
                    free = free[sum(t.request.n for t in group) :]
                    group = []
                    continue
                group.append(self._waiting.popleft())
        if group:
            self._prefill(group, free)

    def _fits(self, group: Sequence[Ticket]) -> bool:
        longest = max(len(t.request.prompt) for t in group)
        return longest + max(t.request.max_tokens for t in group) <= self.length

    def _prefill(self, group: Sequence[Ticket], free: Sequence[int]) -> None:
        """Prefills `group`'s prompts once each (left-padded to a bucketed length) and fills one slot per sample."""
        requests = [t.request for t in group]
        rows = bucket(len(group), self.prefill_batch)
        longest = max(len(r.prompt) for r in requests)
        width = max(longest, bucket(longest, self.length - max(r.max_tokens for r in requests), _MIN_PROMPT_BUCKET))
        prompts = np.full((rows, width), self.pad_id, np.int32)
        mask = np.zeros((rows, width), np.int32)
        for row, request in enumerate(requests):
            prompts[row, width - len(request.prompt) :] = request.prompt
            mask[row, width - len(request.prompt) :] = 1
        rows_cache, logits, position = device.prefill(
            self.model, self.params, jnp.asarray(prompts), jnp.asarray(mask), length=self.length
        )
        targets, sources, settings = [], [], []
        slot_iter = iter(free)
        for row, ticket in enumerate(group):
            request = ticket.request
            stop_ids = list(self._stop_ids(request))
            stop_ids += [-1] * (self.max_stop_ids - len(stop_ids))
            for index in range(request.n):
                slot = next(slot_iter)
                self._owners[slot] = (ticket, index)
                targets.append(slot)
                sources.append(row)
                key = jax.random.key_data(jax.random.fold_in(jax.random.key(request.seed), index))
                settings.append(
                    (request.max_tokens, request.temperature, request.top_k, request.top_p, np.asarray(key), stop_ids)
                )
        size = bucket(len(targets), self.slots)
        padding = size - len(targets)
        columns = list(zip(*settings, strict=True))
        fields = [np.asarray(c) for c in columns]
        fields = [np.concatenate([f, np.repeat(f[:1], padding, axis=0)]) for f in fields]
        self._cache, self._state = device.insert(
            self._cache,
            self._state,
            rows_cache,
            logits,
            position,
            jnp.asarray(targets + [self.slots] * padding, jnp.int32),
            jnp.asarray(sources + [0] * padding, jnp.int32),
            device.Settings(
                max_tokens=jnp.asarray(fields[0], jnp.int32),
                temperature=jnp.asarray(fields[1], jnp.float32),
                top_k=jnp.asarray(fields[2], jnp.int32),
                top_p=jnp.asarray(fields[3], jnp.float32),
                key=jnp.asarray(fields[4], jnp.uint32),
                stop_ids=jnp.asarray(fields[5], jnp.int32),
            ),
            axis=device.batch_axis(self.model),
        )
        self.stats["prefills"] += 1
        self.stats["prefilled_prompts"] += len(group)
        self.stats["slot_fills"] += len(targets)

    # ---- a thread of its own ----

    def start(self) -> None:
        """Steps on a daemon thread whenever there is work, until `stop`. If a step raises, every ticket ends with
        finish_reason "error" (their `on_update` runs) and `failure` holds the exception."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="lmzoo-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.busy:
                    self._lock.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as error:  # noqa: BLE001  (handed to every ticket: none is left waiting)
                self._fail(error)
                return

    def _fail(self, error: Exception) -> None:
        """Ends every waiting and running ticket with finish_reason "error" and `ticket.error`; later submits raise."""
        self.failure = error
        with self._lock:
            tickets = list(self._waiting) + [owner[0] for owner in self._owners if owner is not None]
            self._waiting.clear()
            self._owners = [None] * self.slots
        for ticket in dict.fromkeys(tickets):
            ticket.error = error
            for output in ticket.outputs:
                output.finish_reason = output.finish_reason or "error"
            ticket._done.set()
            if ticket.on_update is not None:
                ticket.on_update(ticket)


@jax.jit
def _deactivate(state: device.Slots, slots: jax.Array) -> device.Slots:
    """state with `slots` [m] idle (stopped by a stop string or cancelled between chunks)."""
    return state.replace(active=state.active.at[slots].set(False))
