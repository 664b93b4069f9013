"""Train a model: python train.py [--config=configs/NAME.py[:arg]] [--workdir=DIR] [--config.a.b=value ...]

Restarting with the same --workdir resumes from its latest checkpoint. `python train.py --objectives` lists
every objective (config.objective.name) with its fields and defaults.
"""

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", "configs/default.py", "Experiment config file (configs/*.py).", lock_config=True)
flags.DEFINE_string("workdir", "runs/default", "Directory for checkpoints, logs and samples.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from lmzoo import config as config_lib
    from lmzoo import sharding
    from lmzoo.train import loop

    logging.set_verbosity(logging.WARNING)
    config = config_lib.validate(flags.FLAGS.config)
    if config.distributed.cpu_devices_per_process:
        import jax

        jax.config.update("jax_num_cpu_devices", config.distributed.cpu_devices_per_process)
    sharding.initialize_distributed(**{k: config.distributed[k] for k in ("coordinator_address", "num_processes", "process_id")})
    final = loop.train_and_evaluate(config, flags.FLAGS.workdir)
    if final is not None:
        print("final validation: " + ", ".join(f"{k} {v:.4f}" for k, v in final.items()))


if __name__ == "__main__":
    import sys

    if "--objectives" in sys.argv[1:]:
        from lmzoo import objectives

        print(objectives.describe())
        sys.exit(0)

    from lmzoo.config import check_overrides

    try:
        check_overrides(sys.argv[1:])
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    app.run(main)
