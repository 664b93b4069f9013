"""SST-2 sentiment from frozen ELMo features of a biLM pretrained with configs/ptb_elmo.py.

    python train.py --config=configs/sst2_elmo.py:elmo --workdir=runs/sst2_elmo --config.objective.bilm=ckpt:runs/ptb_elmo \
        --config.data.tokenizer.path=runs/ptb_elmo/tokenizer/words.txt

Variants: `elmo` (scalar mix of every biLM layer), `static` (layer 0 only: the biLM's token embeddings, the
static-embedding baseline), `scratch` (the same classifier over an embedding table trained from random
initialisation on SST-2 alone: no biLM, so no --config.objective.bilm; it still reads the biLM run's words),
`tiny` (tests). Only the mix, gamma and a linear classifier train (Adam 1e-3), and with `scratch` the table.
"""

import os
import pathlib

from lmzoo.config import check_variants, load_config_file
from lmzoo.objectives import objective_section

SST2 = (
    pathlib.Path(os.environ.get("LMZOO_DATA", pathlib.Path(__file__).resolve().parents[2] / "shared" / "data")) / "sst2"
)


def get_config(arg: str | None = None):
    (variant,) = check_variants(arg or "elmo", known=("elmo", "static", "scratch", "tiny"), single=True)
    c = load_config_file(pathlib.Path(__file__).with_name("ptb_elmo.py"), "tiny" if variant == "tiny" else None)
    c.data.source = "tsv"
    c.data.train_path, c.data.validation_path = str(SST2 / "train.tsv"), str(SST2 / "dev.tsv")
    c.data.text_fields, c.data.label_field = ("sentence",), "label"
    c.data.tokenizer.path = ""  # WORKDIR/tokenizer/words.txt of the biLM run (required): the biLM's word ids
    c.data.seq_len = 64
    c.objective = objective_section("elmo_classify", features="elmo" if variant == "tiny" else variant)
    c.train.batch_size = 32
    c.train.steps = c.optim.decay_steps = 2000
    c.optim.learning_rate, c.optim.warmup_steps = 1e-3, 50
    c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 200, 1000, 1000
    if variant == "tiny":
        c.data.seq_len, c.train.batch_size, c.eval.batch_size = 16, 8, 8
        c.train.steps, c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 4, 2, 4, 4
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
    return c
