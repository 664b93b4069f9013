"""Held-out pairwise accuracy of a reward model, next to a length-only baseline on the same comparisons."""

from typing import Any

import jax
import numpy as np

from lmzoo.rl import reward


def pairwise_accuracy(scores: np.ndarray, ranks: np.ndarray, valid: np.ndarray, *, tie: float) -> tuple[float, int]:
    """(Σ over pairs (w above l) of [s_w > s_l] + tie·[s_w = s_l], number of pairs); scores, ranks, valid [N, K]."""
    pairs = np.asarray(reward.preference_pairs(ranks, valid)).astype(bool)
    margins = scores[:, :, None] - scores[:, None, :]
    return float(np.sum(pairs & (margins > 0)) + tie * np.sum(pairs & (margins == 0))), int(np.sum(pairs))


def evaluate_preference(
    run, state: Any, split: str = "validation", *, max_batches: int | None = None
) -> tuple[dict[str, float], list]:
    """Reward-model accuracy over the split's comparisons (exact ties count as wrong) and two length-only
    baselines on the same pairs: the reply with more tokens wins ("longer"), or the one with fewer ("shorter");
    length ties count ½. Token counts are of the replies as the model reads them (after truncation to seq_len)."""
    params = run.compiled.host_params(state)
    pad_id = run.tokenizer.pad_id
    score = jax.jit(lambda p, tokens: reward.score(run.model, p, tokens, pad_id=pad_id))
    correct = longer = shorter = 0.0
    pairs = 0
    for i, batch in enumerate(run.eval_batches(split)):
        if max_batches is not None and i >= max_batches:
            break
        keep = batch["example_weights"] > 0
        ranks, valid = batch["ranks"][keep], batch["valid"][keep]
        scores = np.asarray(score(params, batch["tokens"]))[keep]
        lengths = batch["lengths"][keep].astype(np.float32)
        hits, count = pairwise_accuracy(scores, ranks, valid, tie=0.0)
        correct, pairs = correct + hits, pairs + count
        longer += pairwise_accuracy(lengths, ranks, valid, tie=0.5)[0]
        shorter += pairwise_accuracy(-lengths, ranks, valid, tie=0.5)[0]
    if not pairs:
        raise ValueError(
            f"the {split} split holds no ranked pair; check config.data.path and config.objective.heldout_fraction"
        )
    return {
        "pairwise_accuracy": correct / pairs,
        "length_longer_accuracy": longer / pairs,
        "length_shorter_accuracy": shorter / pairs,
        "pairs": float(pairs),
    }, []
