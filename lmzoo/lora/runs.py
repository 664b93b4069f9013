"""What a LoRA run saved, read back as a model: its checkpoint holds only what it trained (adapters, and modules
trained in full such as a reward model's head); the model is them merged into the base it adapted, read again."""

from collections.abc import Callable
from typing import Any

from lmzoo.lora import transform

Params = Any


def base_spec(saved: dict) -> str:
    """The weights a run's adapters adapt: its init_from, or the SFT reference a DPO or PPO run adapts."""
    return saved.get("init_from") or saved.get("objective", {}).get("sft", "")


def merge_on_read(trained: Params, saved: dict, placed: Params, read_base: Callable[[str, Params], Params]) -> Params:
    """The model params of a run's checkpoint `trained`, given the config it saved: as they are for a run without LoRA;
    for a LoRA run, its adapters merged into the base `read_base(spec, target)` reads (into the run's decoder or
    classifier backbone, `target` the matching part of `placed`: the placement wanted, or None for host arrays)."""
    adapted = transform.from_config(saved)
    if adapted is None:
        return trained
    inner = "backbone" if "backbone" in trained else "decoder" if "value_head" in trained else None
    target = placed.get(inner, placed) if inner and placed is not None else placed
    base = read_base(base_spec(saved), target)
    return transform.merge({inner: base} if inner else base, trained, adapted)
