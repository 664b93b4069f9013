"""XLA's buffer assignment for the LoRA SFT step of a config, compiled from shapes alone (no weights, nothing
allocated), so a shape too large for this machine is measured here:

    python bench/lora_memory.py --config=configs/llama_sft.py:llama3_8b --batch=4 [--targets='query|key|value|out']

Prints the step's arguments (the frozen base, the adapters and their optimizer state), its temporaries (merged
kernels, their gradients, activations) and outputs, in GB, for one microbatch of `--batch` rows of `data.seq_len`
tokens on this machine's backend. XLA:CPU has no bfloat16 matmul: it converts the weights to float32 for its dots,
so on the CPU the temporaries hold a float32 copy of the model that a GPU's would not (docs/finetune.md).
"""

import time

import jax
import jax.numpy as jnp
from absl import app, flags
from ml_collections import config_flags

from lmzoo import lora, sharding
from lmzoo.models import build_model
from lmzoo.objectives import tasks
from lmzoo.trainers import base as trainer_lib
from lmzoo.trainers import optim, supervised

config_flags.DEFINE_config_file("config", None, "A config file with config.lora.targets set.")
flags.DEFINE_integer("batch", 4, "Rows of data.seq_len tokens in the microbatch.")
flags.DEFINE_string("targets", None, "config.lora.targets instead of the config's.")
FLAGS = flags.FLAGS


def main(argv) -> None:
    config = FLAGS.config
    if FLAGS.targets is not None:
        config.lora.targets = FLAGS.targets
    adapted = lora.from_config(config)
    if adapted is None:
        raise app.UsageError("the config trains no LoRA adapters: set --targets or config.lora.targets")
    task = lora.lora_task(tasks.causal_lm_task(build_model(config.model_name, config.model.to_dict())), adapted)
    tx, schedule = optim.make_optimizer(config.optim)
    rows = (FLAGS.batch, config.data.seq_len)
    shapes = {k: jax.ShapeDtypeStruct(rows, jnp.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    shapes["weights"] = jax.ShapeDtypeStruct(rows, jnp.float32)
    compiled = trainer_lib.compile_trainer(
        supervised.SupervisedTrainer(task, tx, schedule, shapes),
        mesh=sharding.make_mesh(),
        rules=sharding.axis_rules(),
        seed=0,
    )
    began = time.perf_counter()
    with compiled.context():
        memory = compiled.step.lower(compiled.abstract_state, shapes).compile().memory_analysis()
    print(
        f"targets {adapted.targets!r}, rank {adapted.rank}, {rows[0]} x {rows[1]} tokens, remat "
        f"{config.model.get('remat_policy', 'none')}, {jax.default_backend()}: arguments "
        f"{memory.argument_size_in_bytes / 1e9:.2f} GB, temporaries {memory.temp_size_in_bytes / 1e9:.2f} GB, outputs "
        f"{memory.output_size_in_bytes / 1e9:.2f} GB (aliased {memory.alias_size_in_bytes / 1e9:.2f}); compiled in "
        f"{time.perf_counter() - began:.0f} s"
    )


if __name__ == "__main__":
    app.run(main)
