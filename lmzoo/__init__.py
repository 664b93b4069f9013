"""lmzoo: a JAX/Flax functional model zoo for language models.

`lmzoo.load(workdir)` returns a trained run's model, params, tokenizer and config (see lmzoo.train.run).
"""


def load(workdir: str, step: int | None = None):
    """The model, params, tokenizer, config and step of a train.py run, from its workdir alone."""
    from lmzoo.train import run as run_lib

    return run_lib.load(workdir, step)
