"""The generation engine's host side: requests in, continuous batching over the slots of `slots.py`, outputs out.

`Engine` keeps S slots in lanes, each a KV cache of its own (one lane on an accelerator; on a CPU one a core).
Between its device calls a lane admits waiting requests into its free slots (prefilling each prompt once, copied into
one slot per sample: prefix sharing for n > 1), runs one `decode_chunk` of several steps, hands each request its new
tokens (a callback streams them), applies stop strings, and frees the slots of finished or cancelled requests, so a
finished row's slot takes the next request at the next boundary. Requests beyond the slots wait in order; none is
dropped.

Use it synchronously (`generate`: submit, step every lane until done) or from other threads (`start` steps each lane
on a thread of its own, `submit` and `Ticket.cancel` are thread-safe, `Ticket.wait` blocks). Only the engine's
threads call JAX.
"""

import collections
import contextlib
import dataclasses
import os
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

    The slots are split into `lanes`, each a KV cache and slot state of its own that admits, decodes and hands out
    its requests by itself; `generate` and `start` step every lane on a thread of its own. A decode step's
    operations run mostly one after another, so one program keeps about one core busy: on a CPU of several cores,
    lanes keep them all busy, and while one lane prefills or hands out tokens the others decode.

    Args:
        model, params: a decoder that runs with `decode=True` (every lmzoo decoder family; LoRA runs merged first).
        slots: S, the rows decoded at once, over all lanes.
        length: positions per slot: a request's prompt plus max_tokens must fit (default: the model's max_len).
        chunk: decode steps per device call; a lane admits and frees slots between its chunks.
        short_chunk: the decode steps of a call while serving (the engine steps on threads of its own: `start`) with
            a slot free or a request yet to sample its first token: a request arriving mid-chunk waits at most that
            many steps for its slot, and its first token comes back after that many more (default chunk // 4; one
            compiled program serves both lengths).
        lanes: how many lanes share the slots evenly (a request's samples run in one lane, so n is at most S /
            lanes). None: one per core this process may use on a one-device CPU engine, each of at least
            MIN_LANE_SLOTS slots (`default_lanes`); one on an accelerator or a mesh of several devices, which run
            one program at a time.
        eos_ids: ids that end every sample (a checkpoint may have several).
        pad_id: the id recorded after a sample ended.
        vocab_size: the tokenizer's vocabulary (ids at or above it are never drawn); None: the model's.
        tokenizer: decodes outputs' text and matches stop strings (None: token ids only); with several lanes it
            decodes on several threads at once.
        max_stop_ids: the most stop ids (EOS ids included) one request may have.
        prefill_batch: the most prompts prefilled in one call.
        mesh, rules: run every program under this mesh and these logical axis rules (`lmzoo.sharding`), params
            placed on it (e.g. a trainer's `host_params` or `init_from` weights read into their shardings); the
            engine enters them on whichever thread steps a lane.
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
        lanes: int | None = None,
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
        lanes = default_lanes(self.slots, mesh) if lanes is None else int(lanes)
        if lanes < 1 or self.slots % lanes:
            raise ValueError(f"lanes={lanes}: must divide the {self.slots} slots evenly (each lane gets as many)")
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.model_vocab = int(model.config.vocab_size)
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.max_stop_ids = int(max_stop_ids)
        self.prefill_batch = int(prefill_batch)
        self.mesh, self.rules = mesh, tuple(rules)
        self.lanes = [_Lane(self, self.slots // lanes) for _ in range(lanes)]
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._lock = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.failure: Exception | None = None  # what ended a lane's thread (`start`), if anything did
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
        lane_slots = self.lanes[0].slots
        if not 1 <= request.n <= lane_slots:
            where = f"the engine's {lane_slots} slots"
            if len(self.lanes) > 1:
                where = (
                    f"the {lane_slots} slots of a lane (the engine's {self.slots} slots are {len(self.lanes)} lanes; "
                    "a request's samples share one prefill, in one lane)"
                )
            raise ValueError(f"n={request.n}: must be between 1 and {where}")
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
        """Queues a checked request (thread-safe); it starts when a lane has slots for all its samples free."""
        if self.failure is not None:
            raise RuntimeError(f"the engine has failed: {self.failure!r}")
        self.check(request)
        ticket = Ticket(request, on_update)
        with self._lock:
            self._waiting.append(ticket)
            self._lock.notify_all()
        return ticket

    def generate(self, requests: Sequence[Request]) -> list[Ticket]:
        """Runs `requests` to completion -> their tickets, in order: the first lane steps on the calling thread, the
        others on threads of their own (not while `start`'s threads step the engine: `submit` and `Ticket.wait`
        then). A lane's error is raised here once every lane stopped."""
        if self._threads:
            raise RuntimeError("the engine steps on its own threads (start): submit requests and wait on their tickets")
        tickets = [self.submit(r) for r in requests]
        errors: list[Exception] = []

        def finished() -> bool:
            return bool(errors) or all(t.done for t in tickets)

        def run(lane: "_Lane") -> None:
            try:
                self._run_lane(lane, finished)
            except Exception as error:  # noqa: BLE001  (raised on the calling thread, below)
                with self._lock:
                    errors.append(error)
                    self._lock.notify_all()

        helpers = [
            threading.Thread(target=run, args=(lane,), name="lmzoo-lane", daemon=True) for lane in self.lanes[1:]
        ]
        for thread in helpers:
            thread.start()
        run(self.lanes[0])
        for thread in helpers:
            thread.join()
        if errors:
            raise errors[0]
        return tickets

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or any(lane.busy for lane in self.lanes)

    # ---- the loop ----

    def _placement(self) -> contextlib.AbstractContextManager:
        if self.mesh is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack

    def step(self) -> None:
        """One boundary and one chunk of each lane in turn: drop cancelled work, admit waiting requests, decode,
        hand out tokens."""
        for lane in self.lanes:
            lane.step()

    def _run_lane(self, lane: "_Lane", finished: Callable[[], bool]) -> None:
        """Steps `lane` whenever it has work (slots in use, or a request waiting), until `finished()`; it waits on
        the engine's condition otherwise, which a submit and every finished request notify."""
        while True:
            with self._lock:
                while not finished() and not lane.busy and not self._waiting:
                    self._lock.wait()
                if finished():
                    return
            if lane.step():
                with self._lock:
                    self._lock.notify_all()

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

    @staticmethod
    def _finish_cancelled(ticket: Ticket) -> None:
        for output in ticket.outputs:
            output.finish_reason = output.finish_reason or "cancelled"
        ticket._done.set()

    # ---- threads of its own ----

    def start(self) -> None:
        """Steps every lane on a daemon thread of its own whenever it has work, until `stop`. If a step raises, every
        ticket ends with finish_reason "error" (their `on_update` runs), the other lanes stop, and `failure` holds the
        exception."""
        if self._threads:
            return
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._serve_lane, args=(lane,), name="lmzoo-engine", daemon=True)
            for lane in self.lanes
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _serve_lane(self, lane: "_Lane") -> None:
        try:
            self._run_lane(lane, lambda: self._stopping or self.failure is not None)
        except Exception as error:  # noqa: BLE001  (handed to every ticket: none is left waiting)
            self._fail(error)

    def _fail(self, error: Exception) -> None:
        """Ends every waiting and running ticket with finish_reason "error" and `ticket.error`; later submits raise."""
        with self._lock:
            self.failure = error
            tickets = list(self._waiting) + [o[0] for lane in self.lanes for o in lane.owners if o is not None]
            self._waiting.clear()
            for lane in self.lanes:
                lane.owners = [None] * lane.slots
            self._lock.notify_all()
        for ticket in dict.fromkeys(tickets):
            ticket.error = error
            for output in ticket.outputs:
                output.finish_reason = output.finish_reason or "error"
            ticket._done.set()
            if ticket.on_update is not None:
                ticket.on_update(ticket)


MIN_LANE_SLOTS = 8  # fewer rows a step would read the weights again for too little work


def default_lanes(slots: int, mesh: jax.sharding.Mesh | None = None) -> int:
    """The engine's lanes for `slots` slots: on a one-device CPU engine one per core this process may use (at most
    slots // MIN_LANE_SLOTS, and a divisor of `slots`), else 1."""
    devices = jax.devices() if mesh is None else list(mesh.devices.flat)
    if len(devices) > 1 and mesh is not None or devices[0].platform != "cpu":  # one program at a time
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    most = max(1, min(cores, slots // MIN_LANE_SLOTS))
    return next(lanes for lanes in range(most, 0, -1) if slots % lanes == 0)


class _Lane:
    """A share of the engine's slots: a KV cache and slot state of their own (`slots.empty`), the request sample in
    each slot (`owners`), and the boundary work between its chunks. One thread steps a lane at a time; the engine's
    queue, stats and tickets are shared under its lock."""

    def __init__(self, engine: Engine, slots: int):
        self.engine, self.slots = engine, slots
        with engine._placement():
            self.cache, self.state = device.empty(
                engine.model, slots, engine.length, engine.model_vocab, max_stop_ids=engine.max_stop_ids
            )
        self.owners: list[tuple[Ticket, int] | None] = [None] * slots

    @property
    def busy(self) -> bool:
        return any(owner is not None for owner in self.owners)

    def step(self) -> bool:
        """One boundary and one chunk -> whether a request finished."""
        with self.engine._placement():
            return self._step()

    def _step(self) -> bool:
        engine = self.engine
        finished_any = self._release_cancelled()
        self._admit()
        if not self.busy:
            return finished_any
        with engine._lock:  # the chunk ends early once the next waiting request's samples have slots
            wanted = engine._waiting[0].request.n - self.owners.count(None) if engine._waiting else 0
        # Served (threads of its own): short chunks while a request may arrive for a free slot, or one waits for its
        # first token.
        fresh = any(owner is not None and not owner[0].outputs[owner[1]].tokens for owner in self.owners)
        short = bool(engine._threads) and (None in self.owners or fresh)
        self.cache, self.state, chunk = device.decode_chunk(
            engine.model,
            engine.params,
            self.cache,
            self.state,
            jnp.int32(max(wanted, 0)),
            jnp.int32(engine.short_chunk if short else engine.chunk),
            steps=engine.chunk,
            vocab_size=engine.vocab_size,
            pad_id=engine.pad_id,
        )
        tokens, log_probs, emitted, finished, steps = jax.device_get(
            (chunk.tokens, chunk.log_probs, chunk.emitted, chunk.finished, chunk.steps)
        )
        with engine._lock:
            engine.stats["chunks"] += 1
            engine.stats["decode_steps"] += int(steps)
        return self._collect(tokens, log_probs, emitted, finished) or finished_any

    def _collect(self, tokens, log_probs, emitted, finished) -> bool:
        """Hands each slot's new tokens to its output -> whether a request finished."""
        engine = self.engine
        updated: dict[int, Ticket] = {}
        stopped_by_text = []
        done = False
        for slot, owner in enumerate(self.owners):
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
            stops = engine._stop_ids(ticket.request)
            cut = engine._set_text(output, ticket.request, final=bool(finished[slot]))
            if finished[slot]:
                last = output.tokens[-1] if output.tokens else None
                output.finish_reason = "stop" if last in stops else "length"
            elif cut:
                output.finish_reason = "stop"
                stopped_by_text.append(slot)
            if output.finish_reason is not None:
                self.owners[slot] = None
                if all(o.finish_reason is not None for o in ticket.outputs):
                    ticket._done.set()
                    done = True
        if stopped_by_text:
            self.state = _deactivate(self.state, jnp.asarray(stopped_by_text, jnp.int32))
        for ticket in updated.values():
            if ticket.on_update is not None:
                ticket.on_update(ticket)
        return done

    def _release_cancelled(self) -> bool:
        """Ends cancelled requests, waiting or in this lane's slots (freed) -> whether there were any."""
        engine = self.engine
        with engine._lock:
            cancelled = [t for t in engine._waiting if t.cancelled]
            for ticket in cancelled:
                engine._waiting.remove(ticket)
                engine._finish_cancelled(ticket)
        freed = []
        for slot, owner in enumerate(self.owners):
            if owner is not None and owner[0].cancelled:
                self.owners[slot] = None
                freed.append(slot)
                engine._finish_cancelled(owner[0])
        if freed:
            self.state = _deactivate(self.state, jnp.asarray(freed, jnp.int32))
        return bool(cancelled or freed)

    def _admit(self) -> None:
        """Prefills waiting requests, in order, while this lane has slots for all their samples free: each group of
        them taken from the queue under the engine's lock, prefilled outside it."""
        engine = self.engine
        free = [slot for slot, owner in enumerate(self.owners) if owner is None]
        while True:
            group: list[Ticket] = []
            with engine._lock:
                while engine._waiting and engine._waiting[0].request.n <= len(free) - sum(t.request.n for t in group):
                    candidate = [*group, engine._waiting[0]]
                    if len(candidate) > engine.prefill_batch or not self._fits(candidate):
                        break
                    group.append(engine._waiting.popleft())
            if not group:
                return
            self._prefill(group, free)
            free = free[sum(t.request.n for t in group) :]

    def _fits(self, group: Sequence[Ticket]) -> bool:
        longest = max(len(t.request.prompt) for t in group)
        return longest + max(t.request.max_tokens for t in group) <= self.engine.length

    def _prefill(self, group: Sequence[Ticket], free: Sequence[int]) -> None:
        """Prefills `group`'s prompts once each (left-padded to a bucketed length) and fills one of `free`'s slots
        per sample; the slots are the samples' before the device calls, so a failing call ends their tickets."""
        engine = self.engine
        requests = [t.request for t in group]
        targets, sources, settings = [], [], []
        slot_iter = iter(free)
        for row, ticket in enumerate(group):
            request = ticket.request
            stop_ids = list(engine._stop_ids(request))
            stop_ids += [-1] * (engine.max_stop_ids - len(stop_ids))
            for index in range(request.n):
                slot = next(slot_iter)
                self.owners[slot] = (ticket, index)
                targets.append(slot)
                sources.append(row)
                key = jax.random.key_data(jax.random.fold_in(jax.random.key(request.seed), index))
                settings.append(
                    (request.max_tokens, request.temperature, request.top_k, request.top_p, np.asarray(key), stop_ids)
                )
        rows = bucket(len(group), engine.prefill_batch)
        longest = max(len(r.prompt) for r in requests)
        width = max(longest, bucket(longest, engine.length - max(r.max_tokens for r in requests), _MIN_PROMPT_BUCKET))
        prompts = np.full((rows, width), engine.pad_id, np.int32)
        mask = np.zeros((rows, width), np.int32)
        for row, request in enumerate(requests):
            prompts[row, width - len(request.prompt) :] = request.prompt
            mask[row, width - len(request.prompt) :] = 1
        rows_cache, logits, position = device.prefill(
            engine.model, engine.params, jnp.asarray(prompts), jnp.asarray(mask), length=engine.length
        )
        size = bucket(len(targets), self.slots)
        padding = size - len(targets)
        columns = list(zip(*settings, strict=True))
        fields = [np.asarray(c) for c in columns]
        fields = [np.concatenate([f, np.repeat(f[:1], padding, axis=0)]) for f in fields]
        self.cache, self.state = device.insert(
            self.cache,
            self.state,
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
            axis=device.batch_axis(engine.model),
        )
        with engine._lock:
            engine.stats["prefills"] += 1
            engine.stats["prefilled_prompts"] += len(group)
            engine.stats["slot_fills"] += len(targets)


@jax.jit
def _deactivate(state: device.Slots, slots: jax.Array) -> device.Slots:
    """state with `slots` [m] idle (stopped by a stop string or cancelled between chunks)."""
    return state.replace(active=state.active.at[slots].set(False))
