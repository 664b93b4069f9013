"""The objective's own loss metrics over a whole split: loss, accuracy, perplexity, bits per token and char."""

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from lmzoo import metrics as metrics_lib
from lmzoo import sharding

# Batches scored per compiled call (`CompiledTrainer.eval_steps`): one dispatch, host-to-device copy and host wait per
# group rather than per batch. The last group is padded to this size and its padding skipped on the device, so each
# batch shape compiles once.
BATCHES_PER_CALL = 16


def batch_groups(batches: Iterable[dict[str, np.ndarray]], size: int) -> Iterator[list[dict[str, np.ndarray]]]:
    """Consecutive batches in groups of at most `size`, each of one shape (a batch of another shape starts a group)."""
    group, shapes = [], None
    for batch in batches:
        batch_shapes = {k: v.shape for k, v in batch.items()}
        if group and (len(group) == size or batch_shapes != shapes):
            yield group
            group = []
        group, shapes = group + [batch], batch_shapes
    if group:
        yield group


def evaluate_loss(run, state: Any, split: str = "validation", *, max_batches: int | None = None) -> dict[str, float]:
    """Metrics of `run`'s eval step over `split` (each target once; at most `max_batches` batches),
    threading the evaluation carry through the batches in order. Token-level objectives add
    perplexity, bits per token, per character and per UTF-8 byte; `evaluated_batches` says how much was read."""
    token_nll = run.objective.loss_is_token_nll
    char_lengths, byte_lengths = run.tokenizer.token_char_lengths(), run.tokenizer.token_byte_lengths()
    compiled = run.compiled
    carry = compiled.initial_carry(run.config.eval.batch_size)
    total, num_chars, num_bytes, count, keys = None, 0.0, 0.0, 0, set()
    for group in batch_groups(itertools.islice(run.eval_batches(split), max_batches), BATCHES_PER_CALL):
        keys = set(group[0])
        stacked = {k: np.stack([b[k] for b in group + group[-1:] * (BATCHES_PER_CALL - len(group))]) for k in keys}
        valid = np.arange(BATCHES_PER_CALL) < len(group)
        if "targets" in keys and token_nll:
            targets, weights = stacked["targets"][valid], stacked["weights"][valid]
            num_chars += float(np.sum(char_lengths[targets] * weights))
            num_bytes += float(np.sum(byte_lengths[targets] * weights))
        with run.context():
            if total is None:
                total = _zero_metrics(compiled, state, stacked, carry)
            device_batches = sharding.put_batch(stacked, compiled.stacked_batch_sharding)
            previous, (total, carry) = total, compiled.eval_steps(state, device_batches, valid, carry, total)
        # Waits for the group before this one: the host prepares the next group while the device runs this one, and
        # a split of any size keeps two groups' inputs in device memory, not all of them.
        jax.block_until_ready(previous)
        count += len(group)
    if total is None:
        raise ValueError(f"the {split} split produced no evaluation batches; check config.data and config.eval")
    summary = metrics_lib.summarize(total, token_nll=token_nll)
    summary["examples" if "targets" not in keys else "tokens"] = float(jax.device_get(total["loss"][1]))
    summary["evaluated_batches"] = count
    if "targets" in keys and token_nll:
        bits = float(jax.device_get(total["loss"][0])) / np.log(2)
        summary["bits_per_char"] = bits / max(float(np.sum(jax.device_get(_allsum(num_chars)))), 1.0)
        summary["bits_per_byte"] = bits / max(float(np.sum(jax.device_get(_allsum(num_bytes)))), 1.0)
    return summary


def _zero_metrics(compiled, state: Any, stacked: dict[str, np.ndarray], carry: Any) -> Any:
    """Zeros shaped like the metrics of one eval step on a batch of `stacked` ([k, batch, ...]), the sum `eval_steps`
    starts from; call it in the run's context."""
    batch = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in stacked.items()}
    shapes = jax.eval_shape(compiled.trainer.eval_step, state, batch, carry)[0]
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def _allsum(value: float):
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return np.sum(multihost_utils.process_allgather(np.asarray(value)))
