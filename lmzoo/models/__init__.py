"""Model registry: family name -> (config dataclass, module class).

`build_model(name, model_config)` turns the `config.model` section into a Flax module; unknown
names and unknown or missing fields are errors that list the valid choices.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn

from lmzoo.models import bert, deepseek, elmo, gpt2, llama, lstm, ngram, qwen3_5, seq2seq, vae_lm

REGISTRY: dict[str, tuple[type, type[nn.Module]]] = {
    "gpt2": (gpt2.GPT2Config, gpt2.GPT2),
    "llama": (llama.LlamaConfig, llama.Llama),
    "deepseek": (deepseek.DeepseekConfig, deepseek.Deepseek),
    "qwen3_5": (qwen3_5.Qwen3_5Config, qwen3_5.Qwen3_5),
    "bert": (bert.BertConfig, bert.Bert),
    "seq2seq": (seq2seq.Seq2SeqConfig, seq2seq.Seq2Seq),
    "lstm": (lstm.LSTMConfig, lstm.LSTM),
    "vae_lm": (vae_lm.VAELMConfig, vae_lm.VAELM),
    "elmo": (elmo.ELMoConfig, elmo.BiLM),
    "ngram": (ngram.NgramConfig, lambda config: config),  # counted, not a Flax module: the model is its config
}


def make_config(name: str, fields: Mapping[str, Any]) -> Any:
    """The family's frozen config dataclass from a mapping; unknown keys name the valid ones."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model_name {name!r}; registered models: {sorted(REGISTRY)}")
    config_cls = REGISTRY[name][0]
    valid = [f.name for f in dataclasses.fields(config_cls)]
    unknown = sorted(set(fields) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in config.model for {name!r}; valid keys: {valid}")
    return config_cls(**dict(fields))


def build_model(name: str, fields: Mapping[str, Any] | Any) -> nn.Module:
    """A Flax module of family `name` from config.model fields (a mapping or the config dataclass)."""
    config = fields if dataclasses.is_dataclass(fields) else make_config(name, fields)
    return REGISTRY[name][1](config)
