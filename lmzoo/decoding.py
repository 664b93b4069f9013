"""Autoregressive sampling for decoders: greedy, temperature, top-k, top-p, EOS stop, KV cache.

Prompts are left-padded to a common length P (`prompt_mask` marks real tokens), so every row's
last prompt token sits at column P-1 and new tokens are written in lockstep. The whole loop is
one jitted `lax.while_loop`; with `use_cache=False` each step recomputes the full forward pass
(the reference the KV-cache path is tested and benchmarked against).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp


def sample_logits(rng: jax.Array, logits: jax.Array, *, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """logits [B, V] -> token ids [B]. temperature 0 is greedy; top_k 0 and top_p 1 disable the filters."""
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
    return jax.random.categorical(rng, logits, axis=-1)


def _init_cache(model: nn.Module, batch: int, length: int):
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((batch, length), jnp.int32), decode=True)["cache"]
    )
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@functools.partial(
    jax.jit, static_argnames=("model", "max_new_tokens", "temperature", "top_k", "top_p", "eos_id", "pad_id", "use_cache")
)
def _generate(model, params, prompts, prompt_mask, rng, *, max_new_tokens, temperature, top_k, top_p, eos_id, pad_id, use_cache):
    batch, prompt_len = prompts.shape
    total = prompt_len + max_new_tokens
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
    segment_ids = prompt_mask.astype(jnp.int32)
    sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = jnp.concatenate([prompts, jnp.full((batch, max_new_tokens), pad_id, prompts.dtype)], axis=1)
    all_positions = jnp.concatenate([positions, positions[:, -1:] + 1 + jnp.arange(max_new_tokens)[None]], axis=1)
    all_segments = jnp.concatenate([segment_ids, jnp.ones((batch, max_new_tokens), jnp.int32)], axis=1)

    if use_cache:
        logits, variables = model.apply(
            {"params": params, "cache": _init_cache(model, batch, total)},
            prompts, positions=positions, segment_ids=segment_ids, decode=True, mutable=["cache"],
        )  # fmt: skip
        cache = variables["cache"]
    else:
        logits, cache = model.apply({"params": params}, prompts, positions=positions, segment_ids=segment_ids), None
    next_logits = logits[:, -1]

    def cond(carry):
        i, _, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, tokens, next_logits, cache, done, rng = carry
        rng, step_rng = jax.random.split(rng)
        token = sample(step_rng, next_logits)
        token = jnp.where(done, pad_id, token).astype(tokens.dtype)
        if eos_id is not None:
            done = done | (token == eos_id)
        column = prompt_len + i
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, column))
        if use_cache:
            logits, variables = model.apply(
                {"params": params, "cache": cache},
                token[:, None],
                positions=jax.lax.dynamic_slice_in_dim(all_positions, column, 1, axis=1),
                segment_ids=jnp.ones((batch, 1), jnp.int32),
                decode=True,
                mutable=["cache"],
            )
            cache, next_logits = variables["cache"], logits[:, 0]
        else:
            logits = model.apply({"params": params}, tokens, positions=all_positions, segment_ids=all_segments)
            next_logits = jax.lax.dynamic_index_in_dim(logits, column, axis=1, keepdims=False)
        return i + 1, tokens, next_logits, cache, done, rng

    done = jnp.zeros((batch,), bool)
    _, tokens, _, _, _, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), tokens, next_logits, cache, done, rng))
    return tokens[:, prompt_len:]


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
    pad_id: int = 0,
    use_cache: bool = True,
) -> jax.Array:
    """prompts [B, P] (left-padded; prompt_mask [B, P] 1 for real tokens) -> new tokens [B, max_new_tokens].

    Rows that produced `eos_id` continue with `pad_id`; the loop ends early when all rows are done.
    """
    prompts = jnp.asarray(prompts, jnp.int32)
    if prompts.ndim != 2 or prompts.shape[1] == 0:
        raise ValueError(f"prompts must be [batch, length>0] token ids, got shape {prompts.shape}")
    max_len = getattr(model.config, "max_len", None)
    if max_len is not None and prompts.shape[1] + max_new_tokens > max_len:
        raise ValueError(
            f"prompt length {prompts.shape[1]} + max_new_tokens {max_new_tokens} exceeds the model's "
            f"max_len {max_len}; shorten the prompt or ask for fewer tokens"
        )
    vocab_size = getattr(model.config, "vocab_size", None)
    if vocab_size is not None and (int(prompts.max()) >= vocab_size or int(prompts.min()) < 0):
        raise ValueError(f"prompt contains token ids outside [0, {vocab_size}); was it encoded with this model's tokenizer?")
    if prompt_mask is None:
        prompt_mask = jnp.ones_like(prompts)
    return _generate(
        model, params, prompts, jnp.asarray(prompt_mask, jnp.int32), rng,
        max_new_tokens=max_new_tokens, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
        eos_id=eos_id, pad_id=int(pad_id), use_cache=use_cache,
    )  # fmt: skip
