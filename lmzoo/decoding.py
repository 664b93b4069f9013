"""Autoregressive decoding: greedy, temperature, top-k, top-p, EOS and stop-sequence stops and KV cache for decoders
(`sample`) and encoder-decoders (`sample_seq2seq`), and beam search for encoder-decoders.

`sample` and `sample_seq2seq` are pure jitted functions (settings static, no host syncs), so they run inside an
outer `jax.jit` and under a mesh; they return `Samples` (tokens, their log-probs, a mask ending at the stop).
`generate` and `generate_seq2seq` are their host-side wrappers: input checks, numpy in, tokens out. `sample` refuses
a prompt plus new tokens longer than the model's `max_len` positions; `generate` instead continues past them with a
sliding window (`window_passed` says when it will), silently: a caller that wants to say so checks `window_passed`,
as `eval.py --generate` does with its note.

Decoder-only prompts are left-padded to a common length P (`prompt_mask` marks real tokens), so every row's
last prompt token sits at column P-1 and new tokens are written in lockstep. With the KV cache, `sample` runs the
generation engine's device loop (`lmzoo.serving.slots`: each prompt prefilled once, however many samples it has);
`use_cache=False` and the encoder-decoders run `_sample_loop`, a `lax.while_loop` whose step recomputes the full
forward pass (the reference the KV-cache path is tested and benchmarked against) or, for encoder-decoders, feeds
the decoder one token per step against its KV cache after running the encoder once, starting from
`model.config.decoder_start_id`. Whatever the model's dtype (bfloat16 compute or params), the loops carry
the logits in float32: the sampling filters, softmax, log-probs and beam scores are float32."""

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmzoo.serving import slots
from lmzoo.serving.slots import Samples, check_sampling, init_cache, mask_padded_vocab


def _check_ids(model: nn.Module, tokens: jax.Array, what: str) -> None:
    vocab_size = getattr(model.config, "vocab_size", None)
    if vocab_size is not None and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):
        raise ValueError(
            f"{what} contains token ids outside [0, {vocab_size}); was it encoded with this model's tokenizer?"
        )


def sample_logits(
    rng: jax.Array, logits: jax.Array, *, temperature: float, top_k: int, top_p: float, vocab_size: int | None = None
) -> jax.Array:
    """logits [B, V] -> token ids [B], each below `vocab_size` (the tokenizer's; None: any of V). temperature 0
    is greedy; top_k 0 and top_p 1 disable the filters."""
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p, vocab_size=logits.shape[-1])
    logits = mask_padded_vocab(logits, vocab_size)
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1)
    logits = logits.astype(jnp.float32) / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        cutoff_index = jnp.sum(cumulative < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return slots.categorical(jax.random.uniform(rng, logits.shape[:1], jnp.float32), logits)


def _ends_with(tokens: jax.Array, last: jax.Array, sequence: tuple[int, ...]) -> jax.Array:
    """tokens [B, N] -> [B] bool: tokens[:, :last + 1] ends with `sequence` (len(sequence) <= N)."""
    length = len(sequence)
    window = jax.lax.dynamic_slice_in_dim(tokens, jnp.maximum(last + 1 - length, 0), length, axis=1)
    return (last + 1 >= length) & jnp.all(window == jnp.asarray(sequence, tokens.dtype), axis=1)


def _sample_loop(
    step, logits, state, rng, *, max_new_tokens, temperature, top_k, top_p, eos_id, stop_sequences, pad_id, vocab_size
):
    """The one sampling loop: `logits` [B, V] predict the first new token; `step(state, token [B], i)` returns the
    logits [B, V] after new token i and the next state. Stops early once every row has stopped.

    The loop carries the logits in float32 whatever the model's dtype (a bfloat16 model's step returns bfloat16
    logits): the sampling filters, the softmax and the log-probs all read them in float32."""
    batch = logits.shape[0]
    draw = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p, vocab_size=vocab_size)
    stop_sequences = tuple(s for s in stop_sequences if len(s) <= max_new_tokens)  # longer ones can never match

    def cond(carry):
        i, *_, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, tokens, log_probs, mask, logits, state, done, rng = carry
        rng, step_rng = jax.random.split(rng)
        token = jnp.where(done, pad_id, draw(step_rng, logits)).astype(jnp.int32)
        scaled = logits if temperature == 0.0 else logits / temperature
        log_prob = jnp.take_along_axis(jax.nn.log_softmax(scaled), token[:, None], axis=1)[:, 0]
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, i))
        log_probs = jax.lax.dynamic_update_slice(log_probs, jnp.where(done, 0.0, log_prob)[:, None], (0, i))
        mask = jax.lax.dynamic_update_slice(mask, (~done).astype(jnp.int32)[:, None], (0, i))
        if eos_id is not None:
            done = done | (token == eos_id)
        for sequence in stop_sequences:
            done = done | _ends_with(tokens, i, sequence)
        logits, state = step(state, token, i)
        return i + 1, tokens, log_probs, mask, logits.astype(jnp.float32), state, done, rng

    carry = (
        jnp.int32(0),
        jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
        jnp.zeros((batch, max_new_tokens)),
        jnp.zeros((batch, max_new_tokens), jnp.int32),
        logits.astype(jnp.float32),
        state,
        jnp.zeros((batch,), bool),
        rng,
    )
    _, tokens, log_probs, mask, *_ = jax.lax.while_loop(cond, body, carry)
    return Samples(tokens=tokens, log_probs=log_probs, mask=mask)


_SAMPLING_ARGS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "eos_id",
    "stop_sequences",
    "pad_id",
    "vocab_size",
)


@functools.partial(jax.jit, static_argnames=("model", *_SAMPLING_ARGS, "use_cache", "samples_per_prompt"))
def sample(
    model: nn.Module,
    params,
    prompts: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
    pad_id: int = 0,
    vocab_size: int | None = None,
    use_cache: bool = True,
    samples_per_prompt: int = 1,
) -> Samples:
    """Decoder sampling, a pure function usable inside `jax.jit` (and under a mesh with sharded params).

    prompts [B, P] int, left-padded (prompt_mask [B, P]: 1 for real tokens) -> Samples of [B·G, max_new_tokens],
    G = samples_per_prompt replies to each prompt (prompt b's in rows b·G .. b·G+G-1). temperature 0 is greedy (see
    `sample_logits`); no id >= vocab_size (the tokenizer's) is drawn. A row stops after `eos_id` or after the last
    token of any of `stop_sequences` (token-id tuples matched within the new tokens); the loop ends when every row
    stopped.

    With the KV cache this is the generation engine's device loop (`lmzoo.serving.slots.sample_groups`: each prompt
    prefilled once for its G samples); `use_cache=False` recomputes the whole sequence every step, the reference
    the cache is tested against.
    """
    batch, prompt_len = prompts.shape
    max_len = getattr(model.config, "max_len", None)
    if max_len is not None and prompt_len + max_new_tokens > max_len:
        raise ValueError(
            f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds the model's "
            f"max_len {max_len}; shorten the prompt or ask for fewer tokens"
        )
    settings = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=eos_id,
        stop_sequences=stop_sequences,
        pad_id=pad_id,
        vocab_size=vocab_size,
    )
    if use_cache:
        return slots.sample_groups(
            model, params, prompts, prompt_mask, rng, samples_per_prompt=samples_per_prompt, **settings
        )
    if samples_per_prompt > 1:
        prompts = jnp.repeat(prompts, samples_per_prompt, axis=0)
        prompt_mask = jnp.repeat(prompt_mask, samples_per_prompt, axis=0)
        batch *= samples_per_prompt
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
    segment_ids = prompt_mask.astype(jnp.int32)
    all_positions = jnp.concatenate([positions, positions[:, -1:] + 1 + jnp.arange(max_new_tokens)[None]], axis=1)
    logits = model.apply({"params": params}, prompts, positions=positions, segment_ids=segment_ids)
    all_segments = jnp.concatenate([segment_ids, jnp.ones((batch, max_new_tokens), jnp.int32)], axis=1)

    def step(tokens, token, i):
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None].astype(tokens.dtype), (0, prompt_len + i))
        logits = model.apply({"params": params}, tokens, positions=all_positions, segment_ids=all_segments)
        return jax.lax.dynamic_index_in_dim(logits, prompt_len + i, axis=1, keepdims=False), tokens

    state = jnp.concatenate([prompts, jnp.full((batch, max_new_tokens), pad_id, prompts.dtype)], axis=1)
    return _sample_loop(step, logits[:, -1], state, rng, **settings)


def reply_text(tokenizer, tokens: Sequence[int], mask: Sequence[int], stops: Sequence[str] = ()) -> str:
    """One sampled row's reply (`Samples.tokens`, `Samples.mask` rows [T]): the tokens its mask keeps, up to (not
    including) the tokenizer's EOS, decoded and cut before the first of `stops`."""
    ids = [int(t) for t, m in zip(tokens, mask, strict=True) if m]
    if tokenizer.eos_id in ids:
        ids = ids[: ids.index(tokenizer.eos_id)]
    text = tokenizer.decode(ids)
    for stop in stops:
        text = text.split(stop, 1)[0] if stop else text
    return text


def window_passed(model: nn.Module, prompt_len: int, max_new_tokens: int) -> bool:
    """Whether `generate` of `max_new_tokens` after a prompt of `prompt_len` tokens passes the model's `max_len`
    positions, so that its later tokens are predicted from a sliding window (False for models without positions)."""
    max_len = getattr(model.config, "max_len", None)
    return max_len is not None and prompt_len + max_new_tokens > max_len


def generate(
    model: nn.Module,
    params,
    prompts: jax.Array,
    *,
    rng: jax.Array,
    max_new_tokens: int,
    prompt_mask: jax.Array | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
    pad_id: int = 0,
    vocab_size: int | None = None,
    use_cache: bool = True,
) -> jax.Array:
    """Host-side `sample`: prompts [B, P] (left-padded; prompt_mask [B, P] 1 for real tokens), checked for shape
    and out-of-vocabulary ids -> new tokens [B, max_new_tokens], `pad_id` after a row's EOS or, while the model's
    positions last, after one of `stop_sequences` (token-id tuples; past them only EOS stops a row).

    Any length: past the model's `max_len` positions each further token is predicted from the last `max_len` tokens
    (a sliding window, nanoGPT's crop), recomputed without the cache since every position shifts; a prompt longer
    than `max_len` keeps its last tokens. This is not an error and prints nothing (`window_passed` tells a caller
    that wants to note it, as eval.py does)."""
    prompts = jnp.asarray(prompts, jnp.int32)
    if prompts.ndim != 2 or prompts.shape[1] == 0:
        raise ValueError(f"prompts must be [batch, length>0] token ids, got shape {prompts.shape}")
    _check_ids(model, prompts, "prompt")
    prompt_mask = jnp.ones_like(prompts) if prompt_mask is None else jnp.asarray(prompt_mask, jnp.int32)
    max_len = getattr(model.config, "max_len", None)
    sampling = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), vocab_size=vocab_size)
    settings = dict(eos_id=eos_id, stop_sequences=stop_sequences, pad_id=int(pad_id), use_cache=use_cache, **sampling)
    if not window_passed(model, prompts.shape[1], max_new_tokens):
        return sample(model, params, prompts, prompt_mask, rng, max_new_tokens=max_new_tokens, **settings).tokens
    cached = max(max_len - prompts.shape[1], 0)
    new, done = [], jnp.zeros((prompts.shape[0],), bool)
    if cached:
        rng, first_rng = jax.random.split(rng)
        first = sample(model, params, prompts, prompt_mask, first_rng, max_new_tokens=cached, **settings)
        new.append(first.tokens)
        prompts, prompt_mask = (
            jnp.concatenate(x, axis=1) for x in ((prompts, first.tokens), (prompt_mask, first.mask))
        )
        done = first.mask[:, -1] == 0  # stopped (EOS or a stop sequence) before the cached part's end
        if eos_id is not None:
            done = done | jnp.any(first.tokens == eos_id, axis=1)
    windowed = _sample_windows(
        model,
        params,
        prompts[:, -max_len:],
        prompt_mask[:, -max_len:],
        done,
        rng,
        steps=max_new_tokens - cached,
        eos_id=eos_id,
        pad_id=int(pad_id),
        **sampling,
    )
    return jnp.concatenate([*new, windowed], axis=1)


@functools.partial(
    jax.jit, static_argnames=("model", "steps", "temperature", "top_k", "top_p", "vocab_size", "eos_id", "pad_id")
)
def _sample_windows(
    model, params, window, mask, done, rng, *, steps, temperature, top_k, top_p, vocab_size, eos_id, pad_id
):
    """`steps` new tokens [B, steps], each predicted from the window [B, max_len] of the tokens before it (mask
    [B, max_len]: 1 for real tokens; its positions from 0), which then slides one token on: every position shifts, so
    nothing is cached. One device loop, which stops once every row is `done` (an EOS drawn, or done [B] given):
    `pad_id` after that."""

    def next_token(window, mask, key):
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        last = window.shape[1] - 1
        logits, _ = model.apply(
            {"params": params},
            window,
            (last, last + 1),  # the head reads the last position alone
            positions=positions,
            segment_ids=mask,
            method="window_logits",
        )
        return sample_logits(
            key,
            logits[:, 0].astype(jnp.float32),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            vocab_size=vocab_size,
        )

    def body(carry):
        i, rng, window, mask, done, out = carry
        rng, key = jax.random.split(rng)
        token = jnp.where(done, pad_id, next_token(window, mask, key)).astype(jnp.int32)
        window = jnp.concatenate([window[:, 1:], token[:, None]], axis=1)
        mask = jnp.concatenate([mask[:, 1:], (~done)[:, None].astype(mask.dtype)], axis=1)
        done = done | (token == eos_id) if eos_id is not None else done
        return i + 1, rng, window, mask, done, out.at[:, i].set(token)

    out = jnp.full((window.shape[0], steps), pad_id, jnp.int32)
    carry = (jnp.int32(0), rng, window, mask.astype(jnp.int32), done, out)
    return jax.lax.while_loop(lambda c: (c[0] < steps) & ~jnp.all(c[4]), body, carry)[-1]


def _check_seq2seq_inputs(model: nn.Module, inputs: jax.Array, max_new_tokens: int) -> jax.Array:
    """inputs as int32 [B, S]; raises on bad shapes, ids outside the vocabulary or positions beyond a learned table."""
    inputs = jnp.asarray(inputs, jnp.int32)
    if inputs.ndim != 2 or inputs.shape[1] == 0:
        raise ValueError(f"inputs must be [batch, length>0] token ids, got shape {inputs.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    cfg = model.config
    if cfg.positions == "learned":
        limit = cfg.max_len - cfg.position_offset
        for what, length in (("input length", inputs.shape[1]), ("max_new_tokens", max_new_tokens)):
            if length > limit:
                raise ValueError(
                    f"{what} {length} exceeds the {limit} positions of the model's learned position table "
                    f"(max_len {cfg.max_len} - position_offset {cfg.position_offset})"
                )
    _check_ids(model, inputs, "inputs")
    return inputs


def _encode(model, params, inputs, encoder_segment_ids):
    return model.apply({"params": params}, inputs, segment_ids=encoder_segment_ids, method="encode")


def _decoder_step(model, params, cache, tokens, step, encoded, encoder_segment_ids, max_decode_len):
    """tokens [N] at decoder position `step` (cache of max_decode_len positions) -> (logits [N, V] float32, cache).

    `encoded` [N, S, D] on the first step fills the cross-attention cache; None afterwards reads it."""
    logits, variables = model.apply(
        {"params": params, "cache": cache},
        tokens[:, None],
        encoded,
        encoder_segment_ids=encoder_segment_ids,
        positions=jnp.full((tokens.shape[0], 1), step),
        decode=True,
        max_decode_len=max_decode_len,
        mutable=["cache"],
        method="decode",
    )
    return logits[:, 0].astype(jnp.float32), variables["cache"]


def _next_step(step_fn, cache, tokens, step, logits, steps):
    """`step_fn(cache, tokens, step)` unless `step` is past the last position (then logits and cache pass through)."""
    return jax.lax.cond(step < steps, lambda: step_fn(cache, tokens, step), lambda: (logits, cache))


def _init_decoder_cache(model, encoded, max_decode_len):
    return init_cache(model, encoded.shape[0], max_decode_len, encoded, max_decode_len=max_decode_len, method="decode")


@functools.partial(jax.jit, static_argnames=("model", *_SAMPLING_ARGS))
def sample_seq2seq(
    model: nn.Module,
    params,
    inputs: jax.Array,
    encoder_segment_ids: jax.Array | None,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
    pad_id: int = 0,
    vocab_size: int | None = None,
) -> Samples:
    """Encoder-decoder sampling, a pure function usable inside `jax.jit`: inputs [B, S] (encoder_segment_ids
    [B, S]: 1 real token, 0 padding) -> Samples of [B, max_new_tokens], the decoder start token excluded.

    The encoder runs once; the decoder takes one token per step against its KV cache. Stopping as in `sample`.
    """
    encoded = _encode(model, params, inputs, encoder_segment_ids)
    step = functools.partial(
        _decoder_step, model, params, encoder_segment_ids=encoder_segment_ids, max_decode_len=max_new_tokens
    )
    start = jnp.full((inputs.shape[0],), model.config.decoder_start_id, jnp.int32)
    logits, cache = step(_init_decoder_cache(model, encoded, max_new_tokens), start, 0, encoded=encoded)

    def step_state(state, token, i):
        """state (logits, cache): the last logits pass through once the final token is sampled."""
        logits, cache = _next_step(
            functools.partial(step, encoded=None), state[1], token, i + 1, state[0], max_new_tokens
        )
        return logits, (logits, cache)

    return _sample_loop(
        step_state,
        logits,
        (logits, cache),
        rng,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=eos_id,
        stop_sequences=stop_sequences,
        pad_id=pad_id,
        vocab_size=vocab_size,
    )


def generate_seq2seq(
    model: nn.Module,
    params,
    inputs: jax.Array,
    *,
    rng: jax.Array,
    max_new_tokens: int,
    encoder_segment_ids: jax.Array | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    pad_id: int = 0,
    vocab_size: int | None = None,
) -> jax.Array:
    """Host-side `sample_seq2seq`: inputs [B, S] (encoder_segment_ids [B, S]: 1 real token, 0 padding), checked
    for shape, ids and learned-position limits -> new tokens [B, max_new_tokens], `pad_id` after a row's EOS."""
    inputs = _check_seq2seq_inputs(model, inputs, max_new_tokens)
    segments = None if encoder_segment_ids is None else jnp.asarray(encoder_segment_ids, jnp.int32)
    return sample_seq2seq(
        model,
        params,
        inputs,
        segments,
        rng,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        eos_id=eos_id,
        pad_id=int(pad_id),
        vocab_size=vocab_size,
    ).tokens


def _reorder_cache(cache, rows: jax.Array, batch_axis: int):
    """Self-attention cache leaves with rows [B*K] gathered by `rows` [B*K] along their batch axis.

    `rows` only picks among an example's own beams, whose cross-attention keys/values (projected from
    the same encoder output) are identical, so those are left in place, as is cache_index (equal in every row)."""

    def take(path, leaf):
        name = getattr(path[-1], "key", None)
        if name == "cache_index" or name.startswith("cached_context_"):
            return leaf
        return jnp.take(leaf, rows, axis=batch_axis)

    return jax.tree_util.tree_map_with_path(take, cache)


_NEG = -1.0e9  # HF's score of excluded candidates and empty pool slots


@functools.partial(jax.jit, static_argnames=("model", "beam_size", "max_new_tokens", "pad_id", "vocab_size"))
def _beam_search(
    model,
    params,
    inputs,
    encoder_segment_ids,
    eos_id,
    penalties,
    best_penalties,
    stop_when_full,
    *,
    beam_size,
    max_new_tokens,
    pad_id,
    vocab_size,
):
    """penalties [T]: length ** length_penalty for lengths 1..T; best_penalties [T]: that of the length at which
    a live beam's best possible score is estimated after step t; stop_when_full: early_stopping is True."""
    batch, k, steps = inputs.shape[0], beam_size, max_new_tokens
    # Rows [B*K, ...] hold example b's beams at b*K .. b*K+K-1.
    encoded = jnp.repeat(_encode(model, params, inputs, encoder_segment_ids), k, axis=0)
    if encoder_segment_ids is not None:
        encoder_segment_ids = jnp.repeat(encoder_segment_ids, k, axis=0)
    step = functools.partial(
        _decoder_step, model, params, encoder_segment_ids=encoder_segment_ids, max_decode_len=steps
    )
    batch_axis = 1 if model.config.scan_layers else 0  # scanned caches are [layers, B*K, ...]
    top_beams = jnp.arange(2 * k) < k

    def cond(carry):
        i, *_, pool_finished, open_rows = carry
        pool_full = stop_when_full & jnp.all(pool_finished)
        return (i < steps) & jnp.any(open_rows) & ~pool_full

    def body(carry):
        i, logits, cache, run_tokens, run_scores, pool_tokens, pool_scores, pool_finished, open_rows = carry
        vocab = logits.shape[-1]
        scores = (
            jax.nn.log_softmax(mask_padded_vocab(logits, vocab_size)).reshape(batch, k, vocab) + run_scores[:, :, None]
        )
        # 2K best continuations over all beams: at least K of them do not end in EOS.
        cand_scores, flat_index = jax.lax.top_k(scores.reshape(batch, k * vocab), 2 * k)  # [B, 2K]
        parents, cand_ids = flat_index // vocab, flat_index % vocab
        cand_tokens = jnp.take_along_axis(run_tokens, parents[:, :, None], axis=1).at[:, :, i].set(cand_ids)
        finished = (cand_ids == eos_id) | (i + 1 == steps)
        # Live beams: the K best candidates that did not finish.
        run_scores, live = jax.lax.top_k(cand_scores + finished * _NEG, k)
        run_tokens = jnp.take_along_axis(cand_tokens, live[:, :, None], axis=1)
        rows = (jnp.arange(batch)[:, None] * k + jnp.take_along_axis(parents, live, axis=1)).reshape(-1)
        cache = _reorder_cache(cache, rows, batch_axis)
        # Pool: finished candidates among the top K enter with their length-penalised score, unless the row is
        # closed (or, with early_stopping=True, already full); the pool keeps its K best.
        new_finished = finished & top_beams
        hyp_scores = cand_scores / penalties[i]
        hyp_scores += (stop_when_full & jnp.all(pool_finished, axis=1, keepdims=True)) * _NEG
        hyp_scores += ~open_rows[:, None] * _NEG
        hyp_scores += ~new_finished * _NEG
        merged = jax.lax.top_k(jnp.concatenate([pool_scores, hyp_scores], axis=1), k)[1]
        pool_tokens = jnp.take_along_axis(jnp.concatenate([pool_tokens, cand_tokens], 1), merged[:, :, None], axis=1)
        pool_scores = jnp.take_along_axis(jnp.concatenate([pool_scores, hyp_scores], 1), merged, axis=1)
        pool_finished = jnp.take_along_axis(jnp.concatenate([pool_finished, new_finished], 1), merged, axis=1)
        # A row closes once its pool is full and the best live beam cannot beat the pool's worst.
        worst = jnp.where(pool_finished, jnp.min(pool_scores, axis=1, keepdims=True), _NEG)
        open_rows &= jnp.any(run_scores[:, :1] / best_penalties[i] > worst, axis=1)
        logits, cache = _next_step(
            functools.partial(step, encoded=None), cache, run_tokens[:, :, i].reshape(-1), i + 1, logits, steps
        )
        return i + 1, logits, cache, run_tokens, run_scores, pool_tokens, pool_scores, pool_finished, open_rows

    start = jnp.full((batch * k,), model.config.decoder_start_id, jnp.int32)
    tokens = jnp.full((batch, k, steps), pad_id, jnp.int32)
    run_scores = jnp.zeros((batch, k)).at[:, 1:].set(_NEG)  # only the first beam expands at step 0
    pool_scores = jnp.full((batch, k), _NEG)
    logits, cache = step(_init_decoder_cache(model, encoded, steps), start, 0, encoded=encoded)
    carry = (
        jnp.int32(0),
        logits,
        cache,
        tokens,
        run_scores,
        tokens,
        pool_scores,
        jnp.zeros((batch, k), bool),
        jnp.ones((batch,), bool),
    )
    _, _, _, _, _, pool_tokens, pool_scores, _, _ = jax.lax.while_loop(cond, body, carry)
    return pool_tokens[:, 0], pool_scores[:, 0]


def beam_search(
    model: nn.Module,
    params,
    inputs: jax.Array,
    *,
    beam_size: int,
    max_new_tokens: int,
    eos_id: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = True,
    pad_id: int = 0,
    encoder_segment_ids: jax.Array | None = None,
    vocab_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Encoder-decoder beam search: inputs [B, S] (encoder_segment_ids [B, S]: 1 real token, 0 padding) ->
    (best tokens [B, max_new_tokens], EOS included and `pad_id` after; its score [B]).

    HF `generate(num_beams=beam_size, do_sample=False)` semantics: each step keeps the 2K best
    continuations of the K live beams; those ending in `eos_id` among the top K (and every candidate at
    max_new_tokens) enter a per-example pool of K finished hypotheses scored sum(log p) / length **
    length_penalty (length counts the generated tokens, EOS included). early_stopping=True closes an
    example when its pool is full; False (or "never") when also no live beam can beat the pool's worst,
    estimated at the current length (at max_new_tokens for "never" with length_penalty > 0). Ids >=
    vocab_size (the tokenizer's, when the model's vocabulary is padded beyond it) are never chosen.
    """
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    if beam_size < 1:
        raise ValueError(f"beam_size must be at least 1, got {beam_size}")
    inputs = _check_seq2seq_inputs(model, inputs, max_new_tokens)
    segments = None if encoder_segment_ids is None else jnp.asarray(encoder_segment_ids, jnp.int32)
    # Float64 powers rounded to float32, like HF's Python-float length penalties.
    penalties = np.arange(1, max_new_tokens + 1, dtype=np.float64) ** float(length_penalty)
    best = np.full_like(penalties, penalties[-1]) if early_stopping == "never" and length_penalty > 0 else penalties
    return _beam_search(
        model,
        params,
        inputs,
        segments,
        jnp.int32(eos_id),
        jnp.asarray(penalties, jnp.float32),
        jnp.asarray(best, jnp.float32),
        jnp.asarray(early_stopping is True),
        beam_size=int(beam_size),
        max_new_tokens=int(max_new_tokens),
        pad_id=int(pad_id),
        vocab_size=vocab_size,
    )
