"""Accuracy and F1 of a sequence classifier's predictions over a split."""

from typing import Any

import jax
import numpy as np

from lmzoo.objectives import classify


def f1_scores(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> dict[str, float]:
    """Accuracy, macro F1 over the classes and (binary tasks) F1 of class 1. labels, predictions [N] ints."""
    f1 = []
    for c in range(num_classes):
        tp = np.sum((predictions == c) & (labels == c))
        fp, fn = np.sum((predictions == c) & (labels != c)), np.sum((predictions != c) & (labels == c))
        f1.append(2 * tp / max(2 * tp + fp + fn, 1))
    scores = {"accuracy": float(np.mean(labels == predictions)), "macro_f1": float(np.mean(f1))}
    if num_classes == 2:
        scores["f1"] = float(f1[1])
    return scores


def evaluate_classification(
    run, state: Any, split: str = "validation", *, max_batches: int | None = None
) -> tuple[dict[str, float], list]:
    """(accuracy / F1 over the split's examples, []); padding rows (example_weights 0) are skipped."""
    params = run.compiled.host_params(state)
    predict = jax.jit(lambda p, batch: classify.classify_logits(run.model, p, batch).argmax(-1))
    labels, predictions = [], []
    for i, batch in enumerate(run.eval_batches(split)):
        if max_batches is not None and i >= max_batches:
            break
        keep = batch["example_weights"] > 0
        labels.append(batch["labels"][keep])
        predictions.append(
            np.asarray(
                predict(params, {k: v for k, v in batch.items() if k in ("inputs", "token_types", "segment_ids")})
            )[keep]
        )
    labels, predictions = np.concatenate(labels), np.concatenate(predictions)
    return {**f1_scores(labels, predictions, run.config.objective.num_classes), "examples": len(labels)}, []
