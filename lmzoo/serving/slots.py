"""The generation engine's device side: a KV cache of fixed slots, filled by prefills and advanced in chunks.

A cache of S slots holds every attention layer's keys/values [S, L, K, H] (scanned stacks: [layers, S, L, K, H]) with
each row's own write index (attention's `cache_index` [S]), so rows start and finish at different times in one
cache. Three pure functions move it, each jitted once per shape:

- `prefill`: n left-padded prompts [n, P] through the model into a fresh cache of n rows -> those rows and the logits
  predicting each prompt's first new token. A prompt is prefilled once however many samples it has.
- `insert`: copies prefilled rows into free slots, any row into several slots (a GRPO group, an n > 1 request:
  prefix sharing), with each slot's sampling settings and seed.
- `decode_chunk`: up to `steps` decode steps of every slot in one `lax.while_loop` (no host round trip per token):
  each active slot samples a token from its logits with its own temperature, top-k, top-p and key, stops at one of
  its stop ids or at its token budget, and feeds the token back through the model. The chunk ends early when every
  slot is idle, or as soon as as many slots freed as the next waiting request needs (so the host admits it at once).

`shared_prompt_logits` is the same prefix sharing for training: a group of replies to one prompt read the prompt's
cache rows, differentiably, so GRPO's updates run each prompt once for its G samples.

The host side (`engine.Engine`) admits requests and frees slots between chunks; `sample_groups` runs the three in one
jitted program for the callers that sample a fixed batch inside a compiled step (RL rollouts).

Sampling matches `lmzoo.decoding.sample`: temperature 0 is greedy, log-probs are of the temperature-scaled logits
before top-k/top-p, ids at or above `vocab_size` are never drawn, and the logits are carried in float32.
"""

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp


def check_sampling(*, temperature: float, top_k: int, top_p: float, vocab_size: int | None = None) -> None:
    """Raises on settings that do not sample the model's distribution or a truncation of it (a negative
    temperature would sample the inverted one), or that keep more tokens than the `vocab_size` there are."""
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 is greedy, 1 the model's distribution)")
    if top_k < 0:
        raise ValueError(f"top_k={top_k}: must be >= 0 (0 keeps every token)")
    if vocab_size is not None and top_k > vocab_size:
        raise ValueError(
            f"top_k={top_k}: the vocabulary has {vocab_size} tokens; keep at most {vocab_size} (0 keeps every token)"
        )
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: must be in (0, 1] (1 keeps every token)")


def mask_padded_vocab(logits: jax.Array, vocab_size: int | None) -> jax.Array:
    """logits [..., V] with ids >= vocab_size at -inf: a model's vocabulary padded beyond its tokenizer's
    (`config.model.vocab_size` rounded up, or larger than a small corpus needs) has ids no tokenizer decodes."""
    if vocab_size is None or vocab_size >= logits.shape[-1]:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)


def init_cache(model: nn.Module, batch: int, length: int, *args, **kwargs):
    """A zero KV cache for [batch, length] tokens; extra arguments go to `model.init` after the tokens."""
    tokens = jnp.zeros((batch, length), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, *args, decode=True, **kwargs)["cache"])
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@flax.struct.dataclass
class Samples:
    """Sampled continuations. tokens [B, N] (`pad_id` after a row stopped); log_probs [B, N]: log-softmax of the
    temperature-scaled logits (before top-k/top-p) at each sampled token, 0 where mask is 0; mask [B, N]: 1 up to
    and including the EOS or the last token of a stop sequence, 0 after."""

    tokens: jax.Array
    log_probs: jax.Array
    mask: jax.Array


@flax.struct.dataclass
class Slots:
    """Per-slot decoding state; every field is [S, ...].

    logits [S, V] float32: the next token's logits. position [S]: the position id the next fed token takes.
    active [S] bool: the slot is generating. generated [S]: tokens sampled so far. max_tokens [S]: its budget.
    temperature [S], top_k [S] (0: off), top_p [S] (1: off). key [S, 2] uint32: the slot's random key data (token t
    is drawn with fold_in(key, t), so a request's samples do not depend on which slot or chunk it ran in).
    stop_ids [S, M]: ids that end the slot's generation (-1: none). recent [S, R]: its last R tokens (-1 before any),
    for stop sequences of up to R tokens.
    """

    logits: jax.Array
    position: jax.Array
    active: jax.Array
    generated: jax.Array
    max_tokens: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key: jax.Array
    stop_ids: jax.Array
    recent: jax.Array

    @classmethod
    def empty(cls, slots: int, vocab: int, *, max_stop_ids: int = 4, recent: int = 1) -> "Slots":
        """S idle slots over a vocabulary of V logits."""
        zeros = jnp.zeros((slots,), jnp.int32)
        return cls(
            logits=jnp.zeros((slots, vocab), jnp.float32),
            position=zeros,
            active=jnp.zeros((slots,), bool),
            generated=zeros,
            max_tokens=zeros,
            temperature=jnp.ones((slots,), jnp.float32),
            top_k=zeros,
            top_p=jnp.ones((slots,), jnp.float32),
            key=jnp.zeros((slots, 2), jnp.uint32),
            stop_ids=jnp.full((slots, max_stop_ids), -1, jnp.int32),
            recent=jnp.full((slots, recent), -1, jnp.int32),
        )


@flax.struct.dataclass
class Settings:
    """What `insert` gives each slot it fills, every field [m]: max_tokens, temperature, top_k, top_p, key [m, 2]
    uint32 (random key data), stop_ids [m, M] (-1: none)."""

    max_tokens: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key: jax.Array
    stop_ids: jax.Array


@flax.struct.dataclass
class Chunk:
    """One `decode_chunk`'s output. tokens [S, C]: column i is what each slot sampled at the chunk's step i (`pad_id`
    where it did not); log_probs [S, C]; emitted [S, C] bool: the slot sampled at that step; finished [S] bool: the
    slot stopped in this chunk; steps: how many steps ran."""

    tokens: jax.Array
    log_probs: jax.Array
    emitted: jax.Array
    finished: jax.Array
    steps: jax.Array


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), static_argnames=("max_stop_ids",))
def empty(model: nn.Module, slots: int, length: int, vocab: int, *, max_stop_ids: int = 4):
    """(a zero cache of S slots of `length` positions, S idle `Slots`), each leaf a buffer of its own (`insert` and
    `decode_chunk` donate them)."""
    return init_cache(model, slots, length), Slots.empty(slots, vocab, max_stop_ids=max_stop_ids)


def batch_axis(model: nn.Module) -> int:
    """The batch axis of the model's cache leaves: 1 under a scanned stack ([layers, S, ...]), else 0."""
    return 1 if getattr(model.config, "scan_layers", False) else 0


@functools.partial(jax.jit, static_argnames=("model", "length", "deterministic"))
def prefill(
    model: nn.Module, params, prompts: jax.Array, prompt_mask: jax.Array, *, length: int, deterministic: bool = True
):
    """prompts [n, P] left-padded (prompt_mask [n, P]: 1 on real tokens) -> (a cache of n rows of `length` positions
    holding the prompts, logits [n, V] float32 of each first new token, position [n] of that token)."""
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
    last = prompts.shape[1] - 1
    (logits, _), variables = model.apply(
        {"params": params, "cache": init_cache(model, prompts.shape[0], length, (0, 1), method="window_logits")},
        prompts,
        (last, last + 1),  # the head reads the last position alone
        positions=positions,
        segment_ids=prompt_mask.astype(jnp.int32),
        decode=True,
        deterministic=deterministic,
        mutable=["cache"],
        method="window_logits",
    )
    return variables["cache"], logits[:, 0].astype(jnp.float32), positions[:, -1] + 1


def shared_prompt_logits(
    model: nn.Module,
    params,
    prompts: jax.Array,
    prompt_mask: jax.Array,
    continuations: jax.Array,
    continuation_mask: jax.Array,
    *,
    deterministic: bool = True,
) -> jax.Array:
    """The logits predicting each continuation's tokens, each prompt run through the model once for its G
    continuations: prompts [n, P] left-padded (prompt_mask [n, P]: 1 on real tokens), continuations [n·G, T]
    (continuation_mask [n·G, T]: 1 on a prefix of real tokens; prompt b's in rows b·G .. b·G+G-1) -> logits
    [n·G, T, V] of positions P - 1 .. P + T - 2 of each prompt ⊕ continuation, what `window_logits` of the
    concatenated rows (segment ids their masks, positions counting real tokens) gives.

    The prompts fill a cache of n rows (`prefill`'s), repeated G times, which the continuations read as one chunk
    of T tokens. Pure and differentiable: a loss's gradient reaches each prompt's keys and values through the G rows
    that read them. What training on groups of replies to one prompt uses (GRPO's groups, the reference's log-probs of
    them): the prompt's tokens go through the model once rather than G times, at the price of the einsum
    attention over the cache (`attention.cached_attention`) in place of a fused kernel.

    model: a decoder, or a policy that runs one (`models.heads.LMWithValueHead`: its decoder's logits).
    """
    rows, prompt_len = prompts.shape
    group, length = continuations.shape[0] // rows, continuations.shape[1]
    if group * rows != continuations.shape[0]:
        raise ValueError(f"{continuations.shape[0]} continuations are not G of each of {rows} prompts")
    cache, last_logits, _ = prefill(
        model, params, prompts, prompt_mask, length=prompt_len + length, deterministic=deterministic
    )
    cache = jax.tree.map(lambda leaf: jnp.repeat(leaf, group, axis=batch_axis(model)), cache)
    prompt_tokens = jnp.repeat(jnp.sum(prompt_mask, axis=1, keepdims=True), group, axis=0)  # an empty prompt: 0
    continuation_positions = jnp.maximum(prompt_tokens + jnp.cumsum(continuation_mask, axis=1) - 1, 0)
    (logits, _), _ = model.apply(
        {"params": params, "cache": cache},
        continuations,
        (0, length - 1),
        positions=continuation_positions.astype(jnp.int32),
        segment_ids=continuation_mask.astype(jnp.int32),
        decode=True,
        deterministic=deterministic,
        mutable=["cache"],
        method="window_logits",
    )
    first = jnp.repeat(last_logits[:, None].astype(logits.dtype), group, axis=0)  # prefill's are float32
    return jnp.concatenate([first, logits], axis=1)


@functools.partial(jax.jit, static_argnames=("axis",), donate_argnames=("cache", "state"))
def insert(cache, state: Slots, rows, logits, position, targets, sources, settings: Settings, *, axis: int):
    """Fills slots `targets` [m] with prefilled rows `sources` [m] (indices into `rows`, a cache of n rows, and its
    logits [n, V], position [n]) and `settings` [m]; a target of S (past the last slot) is skipped, so m can be padded
    to a size compiled once. Several targets may share a source: its prompt was prefilled once."""

    def put(slot_leaf, row_leaf):
        taken = jnp.take(row_leaf, sources, axis=axis)
        index = (slice(None),) * axis + (targets,)
        return slot_leaf.at[index].set(taken.astype(slot_leaf.dtype), mode="drop")

    cache = jax.tree.map(put, cache, rows)
    fill = lambda field, values: field.at[targets].set(values.astype(field.dtype), mode="drop")  # noqa: E731
    state = state.replace(
        logits=fill(state.logits, logits[sources]),
        position=fill(state.position, position[sources]),
        active=fill(state.active, jnp.ones_like(targets, bool)),
        generated=fill(state.generated, jnp.zeros_like(targets)),
        max_tokens=fill(state.max_tokens, settings.max_tokens),
        temperature=fill(state.temperature, settings.temperature),
        top_k=fill(state.top_k, settings.top_k),
        top_p=fill(state.top_p, settings.top_p),
        key=fill(state.key, settings.key),
        stop_ids=fill(state.stop_ids, settings.stop_ids),
        recent=fill(state.recent, jnp.full((targets.shape[0], state.recent.shape[1]), -1)),
    )
    return cache, state


def categorical(uniform: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw per row from softmax(logits), given a uniform a row: uniform [S] in [0, 1), logits [S, V] float32
    (-inf: never drawn; a row keeps at least one finite logit) -> ids [S] int32.

    By the inverse CDF: the first id whose running sum of the probabilities passes the uniform times their total (held
    below the total), so an id of zero probability, whose running sum does not grow, is never drawn. Gumbel-max
    (`jax.random.categorical`) draws V uniforms a row instead of one, which on CPU costs 4-5x more at V = 2,048 and is
    most of the sampling of a decode step."""
    running = jnp.cumsum(jax.nn.softmax(logits, axis=-1), axis=-1)
    total = running[:, -1]
    target = jnp.minimum(uniform * total, jnp.nextafter(total, jnp.zeros_like(total)))
    return jnp.sum(running <= target[:, None], axis=-1, dtype=jnp.int32)


def sample_rows(
    keys: jax.Array,
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    vocab_size: int | None,
) -> jax.Array:
    """logits [S, V] float32 -> token ids [S], each row with its own settings (`lmzoo.decoding.sample_logits` per row):
    keys [S] typed keys, temperature [S] (0: greedy), top_k [S] (0: off), top_p [S] (1: off). The sort the filters
    need runs only when some row filters."""
    logits = mask_padded_vocab(logits, vocab_size)
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]

    def filtered(scaled):
        vocab = scaled.shape[-1]
        descending = jnp.sort(scaled, axis=-1)[:, ::-1]
        rank = jnp.arange(vocab)[None]
        descending = jnp.where((top_k[:, None] > 0) & (rank >= top_k[:, None]), -jnp.inf, descending)
        kth = jnp.min(jnp.where(jnp.isfinite(descending), descending, jnp.inf), axis=-1, keepdims=True)
        cumulative = jnp.cumsum(jax.nn.softmax(descending, axis=-1), axis=-1)
        # The smallest prefix whose mass reaches top_p (always at least the top token), within the top k.
        cutoff_index = jnp.sum(cumulative < top_p[:, None], axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(descending, jnp.minimum(cutoff_index, vocab - 1), axis=-1)
        threshold = jnp.where((top_p < 1.0)[:, None], jnp.maximum(cutoff, kth), kth)
        return jnp.where(scaled < threshold, -jnp.inf, scaled)

    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
    scaled = jax.lax.cond(needs_filter, filtered, lambda x: x, scaled)
    uniform = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)
    return jnp.where(temperature > 0, categorical(uniform, scaled), greedy)


def _key_data(keys: jax.Array) -> jax.Array:
    """Raw uint32 key data of typed or raw keys."""
    return jax.random.key_data(keys) if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key) else keys


def _ends_with_any(recent: jax.Array, stop_sequences: tuple[tuple[int, ...], ...]) -> jax.Array:
    """recent [S, R] (the newest token last) -> [S] bool: it ends with one of `stop_sequences`."""
    done = jnp.zeros(recent.shape[:1], bool)
    for sequence in stop_sequences:
        done = done | jnp.all(recent[:, -len(sequence) :] == jnp.asarray(sequence, jnp.int32), axis=1)
    return done


def _decode_chunk(
    model: nn.Module,
    params,
    cache,
    state: Slots,
    slots_wanted: jax.Array,
    step_limit: jax.Array,
    *,
    steps: int,
    vocab_size: int | None = None,
    pad_id: int = 0,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
):
    """Up to `steps` decode steps of every active slot (fewer when `step_limit`, an int scalar, is smaller: one
    compiled program for every chunk length up to `steps`) -> (cache, state, `Chunk`). A slot samples from its logits,
    records the token and its log-prob, stops after one of its stop ids, one of `stop_sequences` (token-id tuples of
    at most R = state.recent's width tokens) or its max_tokens, and feeds the token through the model. Ends early
    when no slot is active, or once `slots_wanted` (an int scalar: the free slots the next waiting request lacks; 0
    when none waits) slots finished in this chunk."""
    slots = state.logits.shape[0]
    if stop_sequences and max(map(len, stop_sequences)) > state.recent.shape[1]:
        raise ValueError(f"stop sequences of up to {state.recent.shape[1]} tokens fit these slots: {stop_sequences}")

    def cond(carry):
        i, _, state, out = carry
        freed = (slots_wanted > 0) & (jnp.sum(out.finished) >= slots_wanted)
        return (i < jnp.minimum(steps, step_limit)) & jnp.any(state.active) & ~freed

    def body(carry):
        i, cache, state, out = carry
        keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(state.key), state.generated)
        token = sample_rows(keys, state.logits, state.temperature, state.top_k, state.top_p, vocab_size)
        token = jnp.where(state.active, token, pad_id).astype(jnp.int32)
        scaled = state.logits / jnp.where(state.temperature > 0, state.temperature, 1.0)[:, None]
        log_prob = jnp.take_along_axis(jax.nn.log_softmax(scaled), token[:, None], axis=1)[:, 0]
        recent = jnp.where(
            state.active[:, None], jnp.concatenate([state.recent[:, 1:], token[:, None]], axis=1), state.recent
        )
        generated = state.generated + state.active
        stopped = jnp.any(token[:, None] == state.stop_ids, axis=1) | (generated >= state.max_tokens)
        stopped = state.active & (stopped | _ends_with_any(recent, stop_sequences))
        out = out.replace(
            tokens=out.tokens.at[:, i].set(token),
            log_probs=out.log_probs.at[:, i].set(jnp.where(state.active, log_prob, 0.0)),
            emitted=out.emitted.at[:, i].set(state.active),
            finished=out.finished | stopped,
        )
        logits, variables = model.apply(
            {"params": params, "cache": cache},
            token[:, None],
            positions=state.position[:, None],
            segment_ids=state.active[:, None].astype(jnp.int32),
            decode=True,
            mutable=["cache"],
        )
        state = state.replace(
            logits=logits[:, 0].astype(jnp.float32),
            position=state.position + state.active,
            active=state.active & ~stopped,
            generated=generated,
            recent=recent,
        )
        return i + 1, variables["cache"], state, out

    out = Chunk(
        tokens=jnp.full((slots, steps), pad_id, jnp.int32),
        log_probs=jnp.zeros((slots, steps), jnp.float32),
        emitted=jnp.zeros((slots, steps), bool),
        finished=jnp.zeros((slots,), bool),
        steps=jnp.int32(0),
    )
    steps_run, cache, state, out = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, state, out))
    return cache, state, out.replace(steps=steps_run)


decode_chunk = jax.jit(
    _decode_chunk,
    static_argnames=("model", "steps", "vocab_size", "pad_id", "stop_sequences"),
    donate_argnames=("cache", "state"),
)


def sample_groups(
    model: nn.Module,
    params,
    prompts: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
    pad_id: int = 0,
    vocab_size: int | None = None,
) -> Samples:
    """`lmzoo.decoding.sample` of `samples_per_prompt` replies to each prompt, each prompt prefilled once: prompts [B, P]
    left-padded (prompt_mask [B, P]) -> Samples of [B·G, max_new_tokens], prompt b's samples in rows b·G .. b·G+G-1.
    Pure and traceable: it runs inside a compiled step (the RL trainers'), one chunk of max_new_tokens steps; the
    caller checks prompt_len + max_new_tokens against the model's positions (`lmzoo.decoding.sample` does)."""
    batch, prompt_len = prompts.shape
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p, vocab_size=model.config.vocab_size)
    rows = batch * samples_per_prompt
    stop_sequences = tuple(s for s in stop_sequences if len(s) <= max_new_tokens)  # longer ones can never match
    rows_cache, logits, position = prefill(model, params, prompts, prompt_mask, length=prompt_len + max_new_tokens)
    cache = jax.tree.map(lambda leaf: jnp.repeat(leaf, samples_per_prompt, axis=batch_axis(model)), rows_cache)
    recent = max([1, *map(len, stop_sequences)])
    state = Slots.empty(rows, logits.shape[-1], max_stop_ids=1, recent=recent).replace(
        logits=jnp.repeat(logits, samples_per_prompt, axis=0),
        position=jnp.repeat(position, samples_per_prompt, axis=0),
        active=jnp.ones((rows,), bool),
        max_tokens=jnp.full((rows,), max_new_tokens, jnp.int32),
        temperature=jnp.full((rows,), temperature, jnp.float32),
        top_k=jnp.full((rows,), top_k, jnp.int32),
        top_p=jnp.full((rows,), top_p, jnp.float32),
        key=_key_data(jax.random.split(rng, rows)),
        stop_ids=jnp.full((rows, 1), -1 if eos_id is None else eos_id, jnp.int32),
    )
    _, _, chunk = _decode_chunk(
        model,
        params,
        cache,
        state,
        jnp.int32(0),
        jnp.int32(max_new_tokens),
        steps=max_new_tokens,
        vocab_size=vocab_size,
        pad_id=pad_id,
        stop_sequences=stop_sequences,
    )
    return Samples(tokens=chunk.tokens, log_probs=chunk.log_probs, mask=chunk.emitted.astype(jnp.int32))
