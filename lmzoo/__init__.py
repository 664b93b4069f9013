"""lmzoo: a JAX/Flax functional model zoo for language models.

`lmzoo.load(workdir)` returns a trained run's model, params, tokenizer and config (see lmzoo.train.restore).
"""


def load(workdir: str, step: int | None = None):
    """The model, params, tokenizer, config and step of a train.py run, from its workdir alone."""
    from lmzoo.train import restore

    return restore.load(workdir, step)
