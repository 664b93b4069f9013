"""Evaluation: the evaluators `eval.py` and in-loop evaluation share, by name.

Each evaluator is `fn(run, state, split, **options) -> (metrics, examples)`; an objective lists the
ones that apply to it (`Objective.evaluators`), and `eval.py` runs those asked for.
"""

from lmzoo.evaluation import classification, latent, loss, reconstruction, recurrent


def _loss(run, state, split="validation", *, max_batches=None):
    return loss.evaluate_loss(run, state, split, max_batches=max_batches), []


EVALUATORS = {
    "loss": _loss,
    "reconstruction": reconstruction.evaluate_reconstruction,
    "classification": classification.evaluate_classification,
    "recurrent_samples": recurrent.evaluate_samples,
    "latent": latent.evaluate_latent,
}


def check_evaluator(objective, name: str) -> None:
    """Raises unless evaluator `name` applies to `objective`, naming those that do."""
    if name not in objective.evaluators:
        raise ValueError(f"evaluator {name!r} does not apply to objective {objective.name!r}; "
                         f"its evaluators: {list(objective.evaluators)}")  # fmt: skip
