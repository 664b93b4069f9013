"""Per-example scoring as functions of (model, params): the log-likelihood of a continuation given a context.

`decoder_loglikelihood` and `seq2seq_loglikelihood` are pure jitted functions on padded arrays, so they
run inside an outer `jax.jit` and under a mesh. Each returns, per row, the summed log-probability of the
weighted target tokens and whether every one of them is the model's argmax (the greedy continuation).

The host side turns token-id pairs (context, continuation) into those arrays and batches them:
`loglikelihoods(model, params, pairs)` for a decoder (GPT-2) or an encoder-decoder (T5, BART), and
`rolling_loglikelihood(model, params, ids)` for a text longer than the model's positions, scored in
windows (`rolling_windows`) that each predict up to `max_len` new tokens. Rows are padded to a fixed
batch size and to a length rounded up to `length_multiple`, so a long list compiles a few shapes only.
"""

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmzoo.models import kinds

Pair = tuple[Sequence[int], Sequence[int]]


def _target_scores(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, T, V], targets [B, T], weights [B, T] -> (summed log-prob [B], all-greedy [B] bool)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token_log_probs = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    total = jnp.sum(jnp.where(weights > 0, token_log_probs, 0.0), axis=1)
    greedy = jnp.all((jnp.argmax(logits, axis=-1) == targets) | (weights == 0), axis=1)
    return total, greedy


@functools.partial(jax.jit, static_argnames="model")
def decoder_loglikelihood(
    model: nn.Module, params, inputs: jax.Array, targets: jax.Array, weights: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Decoder scores. inputs [B, T] (right-padded), targets [B, T] (inputs shifted left by one), weights [B, T]
    (1 on the continuation's targets) -> (log-likelihood [B], is greedy [B] bool). Right padding needs no mask:
    causal attention never lets a real position see it."""
    return _target_scores(model.apply({"params": params}, inputs), targets, weights)


@functools.partial(jax.jit, static_argnames="model")
def seq2seq_loglikelihood(
    model: nn.Module, params, inputs: jax.Array, input_mask: jax.Array, targets: jax.Array, weights: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Encoder-decoder scores. inputs [B, S] (input_mask [B, S]: 1 for real tokens), targets [B, T], weights [B, T]
    (1 on real targets) -> (log-likelihood [B], is greedy [B] bool); the decoder reads the targets shifted right."""
    start = jnp.full((targets.shape[0], 1), model.config.decoder_start_id, targets.dtype)
    decoder_inputs = jnp.concatenate([start, targets[:, :-1]], axis=1)
    logits = model.apply({"params": params}, inputs, decoder_inputs, encoder_segment_ids=input_mask.astype(jnp.int32))
    return _target_scores(logits, targets, weights)


def max_positions(model: nn.Module) -> int | None:
    """Tokens a model reads at once (None: no position table limits it)."""
    cfg = model.config
    if kinds.kind_of(model) == kinds.ENCODER_DECODER:
        return cfg.max_len - cfg.position_offset if cfg.positions == "learned" else None
    return cfg.max_len


def _padded_length(length: int, multiple: int, limit: int | None) -> int:
    length = -(-length // multiple) * multiple
    return length if limit is None else min(length, limit)


def prompt_room(model: nn.Module, max_new_tokens: int, flag: str) -> int | None:
    """Prompt tokens that fit beside `max_new_tokens` generated ones in the model's positions (None: no limit); a
    ValueError naming `flag` when none do."""
    limit = max_positions(model)
    if limit is None or kinds.kind_of(model) == kinds.ENCODER_DECODER:  # the encoder's positions are its own
        return limit
    if limit - max_new_tokens < 1:
        raise ValueError(
            f"{flag}={max_new_tokens} leaves no room for a prompt in the model's {limit} positions; "
            f"ask for fewer than {limit}"
        )
    return limit - max_new_tokens


def generation_prompts(
    rows: Sequence[Sequence[int]], *, keep: int | None, pad_id: int, left: bool = True, length_multiple: int = 16
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt ids [N, W] and their mask (1 on real tokens) for the samplers: each row's last `keep` tokens, W the
    longest rounded up to `length_multiple` (at most `keep`), left-padded (decoder prompts: every reply starts at
    column W) or right-padded (encoder inputs)."""
    rows = [list(row) if keep is None else list(row)[-keep:] for row in rows]
    width = _padded_length(max(len(r) for r in rows), length_multiple, keep)
    tokens, mask = np.full((len(rows), width), pad_id, np.int32), np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        where = slice(width - len(row), width) if left else slice(0, len(row))
        tokens[i, where], mask[i, where] = row, 1
    return tokens, mask


def decoder_rows(
    pairs: Sequence[Pair], *, max_len: int, length_multiple: int = 16, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Arrays for `decoder_loglikelihood` from (context, continuation) id pairs: each row is the context and
    continuation cut from the left to the last max_len + 1 tokens. Contexts must not be empty (start them with
    EOS to score a text from its beginning) and continuations must fit max_len."""
    rows = []
    for context, continuation in pairs:
        if not context:
            raise ValueError("a context is empty: start it with the EOS id to score a continuation from the beginning")
        if not 0 < len(continuation) <= max_len:
            raise ValueError(f"a continuation has {len(continuation)} tokens; it needs 1 to max_len={max_len}")
        rows.append((list(context) + list(continuation))[-(max_len + 1) :])
    width = _padded_length(max(len(r) for r in rows) - 1, length_multiple, max_len)
    inputs, targets = np.full((2, len(rows), width), pad_id, np.int32)
    weights = np.zeros((len(rows), width), np.int32)
    for i, ((_, continuation), row) in enumerate(zip(pairs, rows, strict=True)):
        n = len(row) - 1
        inputs[i, :n], targets[i, :n] = row[:-1], row[1:]
        weights[i, n - len(continuation) : n] = 1
    return {"inputs": inputs, "targets": targets, "weights": weights}


def seq2seq_rows(
    pairs: Sequence[Pair], *, max_len: int | None, length_multiple: int = 16, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Arrays for `seq2seq_loglikelihood`: the context is the encoder input (the caller appends EOS if the model
    was trained with it), the continuation the decoder targets; both must fit a learned position table."""
    for context, continuation in pairs:
        if not context or not continuation or (max_len is not None and max(len(context), len(continuation)) > max_len):
            raise ValueError(
                f"a pair has {len(context)} input and {len(continuation)} target tokens; each needs 1 to {max_len}"
            )
    source = _padded_length(max(len(c) for c, _ in pairs), length_multiple, max_len)
    target = _padded_length(max(len(c) for _, c in pairs), length_multiple, max_len)
    batch = {
        "inputs": np.full((len(pairs), source), pad_id, np.int32),
        "input_mask": np.zeros((len(pairs), source), np.int32),
        "targets": np.full((len(pairs), target), pad_id, np.int32),
        "weights": np.zeros((len(pairs), target), np.int32),
    }
    for i, (context, continuation) in enumerate(pairs):
        batch["inputs"][i, : len(context)], batch["input_mask"][i, : len(context)] = context, 1
        batch["targets"][i, : len(continuation)], batch["weights"][i, : len(continuation)] = continuation, 1
    return batch


def loglikelihoods(
    model: nn.Module, params, pairs: Sequence[Pair], *, batch_size: int = 16, length_multiple: int = 16, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(log-likelihood [N] float, is greedy [N] bool) of each (context ids, continuation ids) pair, in order."""
    kind = kinds.kind_of(model)
    if kind == kinds.DECODER:
        make_rows, score = decoder_rows, decoder_loglikelihood
    elif kind == kinds.ENCODER_DECODER:
        make_rows, score = seq2seq_rows, seq2seq_loglikelihood
    else:
        raise ValueError(
            f"{type(model).__name__} cannot score continuations; loglikelihood needs a decoder (gpt2, llama) "
            "or an encoder-decoder (seq2seq)"
        )
    # Longest first, so each batch pads to rows of similar length; results go back to the given order.
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    totals, greedy = np.zeros(len(pairs), np.float64), np.zeros(len(pairs), bool)
    for start in range(0, len(pairs), batch_size):
        rows = order[start : start + batch_size]
        chunk = [pairs[i] for i in rows]
        filler = [chunk[-1]] * (batch_size - len(chunk))  # a fixed batch shape; the filler rows are dropped
        batch = make_rows(chunk + filler, max_len=max_positions(model), length_multiple=length_multiple, pad_id=pad_id)
        total, is_greedy = jax.device_get(score(model, params, *batch.values()))
        totals[rows], greedy[rows] = total[: len(chunk)], is_greedy[: len(chunk)]
    return totals, greedy


def rolling_windows(ids: Sequence[int], *, max_len: int, prefix_id: int, stride: int | None = None) -> list[Pair]:
    """(context, continuation) pairs that together predict every token of `ids` once: the first window predicts
    up to max_len tokens after `prefix_id` (EOS), each later one the next `stride` (default max_len) tokens after
    the tokens that fill the rest of its max_len + 1. stride = max_len gives lm-eval's disjoint windows
    (`get_rolling_token_windows` + `make_disjoint_window`); a smaller stride gives every token more context."""
    stride = max_len if stride is None else stride
    if not 0 < stride <= max_len:
        raise ValueError(f"stride={stride} must be in [1, max_len={max_len}]")
    ids = list(ids)
    windows = [([prefix_id], ids[:max_len])]
    for start in range(max_len, len(ids), stride):
        continuation = ids[start : start + stride]
        windows.append((ids[start - (max_len + 1 - len(continuation)) : start], continuation))
    return windows


def rolling_loglikelihood(
    model: nn.Module, params, ids: Sequence[int], *, prefix_id: int, stride: int | None = None, batch_size: int = 16
) -> float:
    """Summed log-probability of every token of a text (ids, any length) under a decoder, in windows."""
    if kinds.kind_of(model) != kinds.DECODER:
        raise ValueError(f"rolling log-likelihood needs a decoder (gpt2, llama), not {type(model).__name__}")
    if not ids:
        return 0.0
    windows = rolling_windows(ids, max_len=model.config.max_len, prefix_id=prefix_id, stride=stride)
    return float(np.sum(loglikelihoods(model, params, windows, batch_size=batch_size)[0]))
