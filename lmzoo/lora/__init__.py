"""LoRA (Hu et al. 2021) in one place: its config (`from_config`, the run config's `lora` section), the adapters as
a transform of any family's parameter tree (`transform`), a `Task` trained through them (`task`), a LoRA run's
checkpoint merged into its base on read (`runs`) and PEFT's adapter folders both ways (`peft`, imported on its own:
it reads the HF tensor tables). Inside the layers, `lmzoo.layers.adapters` is the hook that applies them."""

from lmzoo.lora.runs import base_spec, merge_on_read
from lmzoo.lora.task import BASE, lora_task
from lmzoo.lora.transform import (
    LORA_A,
    LORA_B,
    LoraConfig,
    adapter_pairs,
    attach,
    check_base,
    count,
    find_kernels,
    freeze,
    from_config,
    init_adapters,
    lora_loss,
    merge,
    trained_in_full,
    training_form,
)

__all__ = [
    "BASE",
    "LORA_A",
    "LORA_B",
    "LoraConfig",
    "adapter_pairs",
    "attach",
    "base_spec",
    "check_base",
    "count",
    "find_kernels",
    "freeze",
    "from_config",
    "init_adapters",
    "lora_loss",
    "lora_task",
    "merge",
    "merge_on_read",
    "trained_in_full",
    "training_form",
]
