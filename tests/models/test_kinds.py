"""Every family declares what it is; evaluation dispatches on that, not on classes."""

import pytest

from lmzoo import models, testing
from lmzoo.evaluation import scoring
from lmzoo.models import kinds

EXPECTED = {
    "gpt2": kinds.DECODER,
    "llama": kinds.DECODER,
    "deepseek": kinds.DECODER,
    "qwen3_5": kinds.DECODER,
    "bert": kinds.ENCODER,
    "seq2seq": kinds.ENCODER_DECODER,
    "lstm": kinds.RECURRENT,
    "vae_lm": kinds.LATENT,
    "elmo": kinds.RECURRENT,
    "ngram": kinds.COUNTED,
}


def test_every_registered_family_declares_its_kind():
    assert set(EXPECTED) == set(models.REGISTRY)
    for name, (_, module) in models.REGISTRY.items():
        declared = module.kind if name != "ngram" else models.REGISTRY[name][0].kind
        assert declared == EXPECTED[name], name


def test_scoring_asks_for_the_kind():
    decoder = models.build_model("gpt2", testing.TINY_GPT2)
    assert kinds.kind_of(decoder) == kinds.DECODER
    assert scoring.max_positions(decoder) == testing.TINY_GPT2["max_len"]

    class Unknown:
        config = None

    with pytest.raises(ValueError, match="cannot score continuations"):
        scoring.loglikelihoods(Unknown(), {}, [([1], [2])])
