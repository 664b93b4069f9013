"""The objective registry: config.objective.name -> the Objective that owns that recipe.

Adding an objective touches its module, one line here and its config file(s). `describe()` lists
every objective with its fields and defaults (`python train.py --objectives`).
"""

import dataclasses

import ml_collections

from lmzoo.objectives import (
    base,
    bilm,
    causal_lm,
    classification,
    denoising,
    distillation,
    elbo,
    elmo_classify,
    mlm,
    ngram_lm,
    ppo,
    recurrent_lm,
    reward_model,
    sft,
    text_to_text,
)

REGISTRY: dict[str, base.Objective] = {}


def register(objective: base.Objective) -> base.Objective:
    """Adds `objective` under its name (also for objectives defined outside lmzoo, e.g. in tests)."""
    REGISTRY[objective.name] = objective
    return objective


for _objective in (
    causal_lm.CausalLM(),
    mlm.MaskedLM(),
    mlm.SentencePairMLM("mlm_nsp", "nsp"),
    mlm.SentencePairMLM("mlm_sop", "sop"),
    distillation.Distillation(),
    classification.Classification(),
    denoising.SpanCorruption(),
    denoising.Denoising(),
    text_to_text.TextToText(),
    sft.SFT(),
    reward_model.RewardModel(),
    ppo.PPO(),
    recurrent_lm.RecurrentLM(),
    ngram_lm.NgramLM(),
    elbo.VAELanguageModel(),
    bilm.BiLMObjective(),
    elmo_classify.ELMoClassify(),
):
    register(_objective)


def get(name: str) -> base.Objective:
    if name not in REGISTRY:
        raise ValueError(f"unknown config.objective.name {name!r}; choose one of {sorted(REGISTRY)}")
    return REGISTRY[name]


def defaults(name: str) -> dict:
    """The fields of objective `name` with their defaults."""
    return dataclasses.asdict(get(name).Config())


def describe() -> str:
    """One line per objective: its name, class and fields with their defaults."""
    lines = []
    for name, objective in sorted(REGISTRY.items()):
        fields = ", ".join(f"{k}={v!r}" for k, v in defaults(name).items()) or "(no fields)"
        lines.append(f"{name:16s} {type(objective).__name__}: {fields}")
    return "\n".join(lines)


def objective_section(name: str, **fields) -> ml_collections.ConfigDict:
    """`name` plus every field of that objective's config (defaults, then `fields`), so each is overridable."""
    known = defaults(name)
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} of objective {name!r}; its fields: {sorted(known)}")
    return ml_collections.ConfigDict({"name": name, **known, **fields})
