"""The objective's own loss metrics over a whole split: loss, accuracy, perplexity, bits per token and char."""

from typing import Any

import jax
import numpy as np

from lmzoo import metrics as metrics_lib
from lmzoo import sharding


def evaluate_loss(run, state: Any, split: str = "validation", *, max_batches: int | None = None) -> dict[str, float]:
    """Metrics of `run`'s eval step over `split` (each target once; at most `max_batches` batches),
    threading the evaluation carry through the batches in order. Token-level objectives add
    perplexity, bits per token, per character and per UTF-8 byte; `evaluated_batches` says how much was read."""
    token_nll = run.objective.loss_is_token_nll
    char_lengths, byte_lengths = run.tokenizer.token_char_lengths(), run.tokenizer.token_byte_lengths()
    compiled = run.compiled
    carry = compiled.initial_carry(run.config.eval.batch_size)
    total, num_chars, num_bytes, count = None, 0.0, 0.0, 0
    for batch in run.eval_batches(split):
        if max_batches is not None and count >= max_batches:
            break
        if "targets" in batch and token_nll:
            num_chars += float(np.sum(char_lengths[batch["targets"]] * batch["weights"]))
            num_bytes += float(np.sum(byte_lengths[batch["targets"]] * batch["weights"]))
        with run.context():
            metrics, carry = compiled.eval_step(state, sharding.put_batch(batch, compiled.batch_sharding), carry)
        total = metrics_lib.accumulate(total, metrics)
        count += 1
    if total is None:
        raise ValueError(f"the {split} split produced no evaluation batches; check config.data and config.eval")
    summary = metrics_lib.summarize(total, token_nll=token_nll)
    summary["examples" if "targets" not in batch else "tokens"] = float(jax.device_get(total["loss"][1]))
    summary["evaluated_batches"] = count
    if "targets" in batch and token_nll:
        bits = float(jax.device_get(total["loss"][0])) / np.log(2)
        summary["bits_per_char"] = bits / max(float(np.sum(jax.device_get(_allsum(num_chars)))), 1.0)
        summary["bits_per_byte"] = bits / max(float(np.sum(jax.device_get(_allsum(num_bytes)))), 1.0)
    return summary


def _allsum(value: float):
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return np.sum(multihost_utils.process_allgather(np.asarray(value)))
