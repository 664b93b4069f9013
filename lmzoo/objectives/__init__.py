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
    classify,
    denoising,
    distill,
    dpo,
    elmo_classify,
    mlm,
    ngram_lm,
    ppo,
    recurrent_lm,
    reward_model,
    sft,
    text_to_text,
    vae_lm,
)

REGISTRY: dict[str, type[base.Objective]] = {}


def register(objective: type[base.Objective]) -> type[base.Objective]:
    """Adds the objective class under its name (also for objectives defined outside lmzoo, e.g. in tests)."""
    REGISTRY[objective.name] = objective
    return objective


for _objective in (
    causal_lm.CausalLM,
    mlm.MaskedLM,
    mlm.NextSentenceMLM,
    mlm.SentenceOrderMLM,
    distill.Distillation,
    classify.Classification,
    denoising.SpanCorruption,
    denoising.Denoising,
    text_to_text.TextToText,
    sft.SFT,
    reward_model.RewardModel,
    ppo.PPO,
    ppo.GRPO,
    ppo.RLOO,
    dpo.DPO,
    recurrent_lm.RecurrentLM,
    ngram_lm.NgramLM,
    vae_lm.VAELanguageModel,
    bilm.BiLMObjective,
    elmo_classify.ELMoClassify,
):
    register(_objective)


def get(name: str) -> type[base.Objective]:
    """The objective class registered as `name` (its fields, evaluators; `build` makes one for a run)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown config.objective.name {name!r}; choose one of {sorted(REGISTRY)}")
    return REGISTRY[name]


def build(config: ml_collections.ConfigDict) -> base.Objective:
    """The objective of a run, built once from its config (config.objective holds every field of it)."""
    return get(config.objective.name)(config)


def defaults(name: str) -> dict:
    """The fields of objective `name` with their defaults."""
    return dataclasses.asdict(get(name).Config())


def describe() -> str:
    """One line per objective: its name, class and fields with their defaults."""
    lines = []
    for name, objective in sorted(REGISTRY.items()):
        fields = ", ".join(f"{k}={v!r}" for k, v in defaults(name).items()) or "(no fields)"
        lines.append(f"{name:16s} {objective.__name__}: {fields}")
    return "\n".join(lines)


def objective_section(name: str, **fields) -> ml_collections.ConfigDict:
    """`name` plus every field of that objective's config (defaults, then `fields`), so each is overridable."""
    known = defaults(name)
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} of objective {name!r}; its fields: {sorted(known)}")
    return ml_collections.ConfigDict({"name": name, **known, **fields})
