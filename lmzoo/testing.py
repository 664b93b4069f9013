"""Tiny configs and batches shared by the tests (B=2, T=8, D=16, N=2, vocab 32)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmzoo import models

TINY_GPT2 = dict(vocab_size=32, max_len=16, emb_dim=16, num_heads=2, num_layers=2, mlp_dim=32,
                 dropout_rate=0.0, attention_dropout_rate=0.0)  # fmt: skip


def tiny_gpt2(**overrides):
    """(model, unboxed params) of a 2-layer GPT-2 with random weights."""
    model = models.build_model("gpt2", {**TINY_GPT2, **overrides})
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["params"])
    return model, params


def random_tokens(shape=(2, 8), vocab_size: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, size=shape).astype(np.int32)


def tiny_config(objective: str = "causal_lm", **train):
    """configs/default.py:tiny (a 1-layer GPT-2 on 5 standard-library files, 4 steps) with `objective`
    and config.train fields replaced."""
    import pathlib

    from lmzoo import config as config_lib

    config = config_lib.load_config_file(pathlib.Path(__file__).resolve().parents[1] / "configs" / "default.py", "tiny")
    if objective != config.objective.name:
        config.objective = config_lib.objective_section(objective)
    config.train.update(train)
    return config
