"""Evaluation: the evaluators `eval.py` and in-loop evaluation share, by name.

Each evaluator is `fn(run, state, split, **options) -> (metrics, examples)`; an objective lists the
ones that apply to it (`Objective.evaluators`), and `eval.py` runs those asked for.
"""

from lmzoo.evaluation import classification, generation, latent, loss, preference, reconstruction, recurrent


def _loss(run, state, split="validation", *, max_batches=None):
    return loss.evaluate_loss(run, state, split, max_batches=max_batches), []


EVALUATORS = {
    "loss": _loss,
    "reconstruction": reconstruction.evaluate_reconstruction,
    "classification": classification.evaluate_classification,
    "preference": preference.evaluate_preference,
    "generation": generation.evaluate_generation,  # text_to_text: greedy generations vs references (BLEU, ROUGE)
    "recurrent_samples": recurrent.evaluate_samples,
    "latent": latent.evaluate_latent,
}


def scorable(objective) -> bool:
    """Whether eval.py can score `objective`: it lists evaluators and every one of them is registered."""
    return bool(objective.evaluators) and all(name in EVALUATORS for name in objective.evaluators)


def check_scorable(objective) -> None:
    """Raises unless eval.py can score `objective`, naming the objectives it can."""
    from lmzoo import objectives

    if not scorable(objective):
        missing = [name for name in objective.evaluators if name not in EVALUATORS]
        able = sorted(name for name, o in objectives.REGISTRY.items() if scorable(o))
        why = f"its evaluators {missing} are not registered" if missing else "it lists no evaluators"
        raise ValueError(
            f"eval.py cannot score objective {objective.name!r}: {why} in lmzoo.evaluation.EVALUATORS; "
            f"objectives it can score: {able}"
        )


def check_evaluator(objective, name: str) -> None:
    """Raises unless evaluator `name` applies to `objective`, naming those that do."""
    if name not in objective.evaluators:
        raise ValueError(
            f"evaluator {name!r} does not apply to objective {objective.name!r}; "
            f"its evaluators: {list(objective.evaluators)}"
        )
