"""Convert a HuggingFace checkpoint once into an lmzoo checkpoint, which fine-tuning runs then restore sharded.

    python -m lmzoo.cli.convert --config=configs/llama.py:llama3_8b --from=hf:/models/Meta-Llama-3-8B \\
        --out=gs://BUCKET/converted/llama3_8b
    python train.py --config=configs/llama.py:llama3_8b --config.init_from=ckpt:gs://BUCKET/converted/llama3_8b ...

`init_from=hf:` converts every time a run starts: each tensor is read, transposed and cast on the host before it is
placed. A converted checkpoint holds the parameters in lmzoo's layout, dtypes and (scanned) layers, written by orbax;
`init_from=ckpt:OUT` (and a frozen model's `ckpt:`) restores each parameter straight into its sharding, every process
reading only the shards its devices hold, as MaxText restores its converted checkpoints.

The model is the one --config describes (and --config.* overrides), on its mesh: convert on the mesh the fine-tuning
runs use (`config.sharding.mesh_shape`), or any mesh (orbax reshards on restore). --out holds
`checkpoints/0/` (the params at step 0) and `config.json` (the config converted to, and where from). A user error
exits with status 2 and one `error:` line.
"""

import json
import os
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from lmzoo import config as config_lib
from lmzoo import storage, weights
from lmzoo import workdir as workdir_lib
from lmzoo.train import run as run_lib

config_flags.DEFINE_config_file("config", None, "The config of the runs that will start from the checkpoint.")
flags.DEFINE_string("from", None, "The checkpoint to convert: hf:FOLDER (local, gs:// or s3://).")
flags.DEFINE_string("out", None, "Where to write the converted checkpoint (a new folder or bucket prefix).")


def convert(config, source: str, out: str) -> dict:
    """Converts `source` ("hf:FOLDER") into an lmzoo checkpoint at `out` for the model of `config`; returns a
    summary. `out` must hold no checkpoint."""
    if not source.startswith("hf:"):
        raise ValueError(f"--from={source}: give hf:FOLDER (a HuggingFace folder with config.json and safetensors)")
    if run_lib.has_checkpoints(storage.path(out)):  # a folder an earlier failure left empty is taken
        raise FileExistsError(f"--out={out} holds checkpoints already; pass a new folder")
    with workdir_lib.lock(out):
        run = run_lib.build(config, out, batches=False)
        try:
            target = run.compiled.abstract_state.params
            params = weights.read_params(source, config.model_name, config.model.to_dict(), target)
            run.checkpointer.save(0, {"params": params}, {"step": 0}, force=True)
            run.checkpointer.wait()
        finally:
            run.close()
        record = json.loads(config.to_json_best_effort()) | {"converted_from": source}
        storage.write_text(storage.path(out) / "config.json", json.dumps(record, indent=2))
    sizes = [leaf.size for leaf in jax.tree.leaves(params)]
    return {"out": os.fspath(storage.path(out)), "from": source, "parameters": int(sum(sizes)), "tensors": len(sizes)}


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # orbax's INFO lines
    config, source, out = flags.FLAGS.config, flags.FLAGS["from"].value, flags.FLAGS.out
    with run_lib.user_errors():
        if config is None or not source or not out:
            raise ValueError("give --config=CONFIG_FILE[:VARIANT], --from=hf:FOLDER and --out=FOLDER")
        summary = convert(config, source, out)
    print(json.dumps(summary))
    print(f"fine-tune from it: python train.py --config=... --config.init_from=ckpt:{summary['out']}", file=sys.stderr)


if __name__ == "__main__":
    sys.argv = [sys.argv[0], *config_lib.resolve_config_path(sys.argv[1:])]  # configs/NAME.py from any folder
    app.run(main, flags_parser=run_lib.parse_flags)
