"""N-gram LMs on Penn Treebank (Mikolov's split) fitted by counting: interpolated modified Kneser-Ney 5-gram
(Mikolov et al. 2011: test ppl 141.2) or the add-k baseline.

    python train.py --config=configs/ptb_ngram.py:kn5 --workdir=runs/ptb_kn5
    python eval.py --workdir=runs/ptb_kn5 --data=../shared/data/ptb/ptb.test.txt

Variants: `kn5` (default), `kn3`, `add_k` (a bigram with k = 0.01), `tiny` (for tests). One training step
counts `batch_size` sentences; steps = one pass over PTB's 42,068 training sentences.
"""

import math
import os
import pathlib

from lmzoo.config import base_config, check_variants, model_section
from lmzoo.objectives import objective_section

PTB = (
    pathlib.Path(os.environ.get("LMZOO_DATA", pathlib.Path(__file__).resolve().parents[2] / "shared" / "data")) / "ptb"
)  # Mikolov's ptb.{train,valid,test}.txt
TRAIN_SENTENCES = 42068


def get_config(arg: str | None = None):
    variants = {
        "kn5": (5, "kneser_ney", 1.0),
        "kn3": (3, "kneser_ney", 1.0),
        "add_k": (2, "add_k", 0.01),
        "tiny": (3, "kneser_ney", 1.0),
    }
    (variant,) = check_variants(arg or "kn5", known=tuple(variants), single=True)
    order, smoothing, add_k = variants[variant]
    c = base_config()
    c.model_name = "ngram"
    c.model = model_section("ngram", order=order, vocab_size=10000, smoothing=smoothing, add_k=add_k)
    c.data.train_path = str(PTB / "ptb.train.txt")
    c.data.validation_path = str(PTB / "ptb.valid.txt")
    c.data.tokenizer.kind = "word"
    c.data.seq_len = 96  # longest sentence + <eos> (PTB: 83)
    c.objective = objective_section("ngram_lm", max_ngrams=1_000_000)  # PTB train: 790,568 distinct 5-gram rows
    c.train.batch_size = 2048  # sentences counted per step
    c.train.steps = math.ceil(TRAIN_SENTENCES / c.train.batch_size)
    c.train.log_every = c.train.eval_every = c.train.checkpoint_every = c.train.steps
    c.train.sample_tokens = 0
    c.eval.batch_size = 512
    if variant == "tiny":
        # the table is sized for the whole split: PTB train has 589,720 distinct 3-gram rows
        c.objective.max_ngrams = 600_000
        c.train.batch_size, c.eval.batch_size = 16, 16
        c.optim.decay_steps = c.train.steps  # unused (a counting trainer), set so the run prints no decay_steps note
    return c
