"""LSTM LM on Penn Treebank (Mikolov's split), the "small" recipe of Zaremba et al. 2014 (test ppl 114.5).

    python train.py --config=configs/ptb_lstm.py --workdir=runs/ptb_lstm
    python eval.py --workdir=runs/ptb_lstm --data=../shared/data/ptb/ptb.test.txt

2 layers x 200, unroll 20, batch 20 contiguous streams with the state carried across batches, no
dropout, uniform init in [-0.1, 0.1], SGD lr 1 (loss summed over the 20 steps) for 4 epochs then halved
every epoch, clip 5, 13 epochs. `:medium` is their 650-unit recipe (dropout 0.5, 39 epochs, lr decay 0.8
after epoch 6, init 0.05); `:tiny` shrinks everything for tests.
"""

import os
import pathlib

from lmzoo.config import base_config, check_variants, model_section
from lmzoo.objectives import objective_section

PTB = (
    pathlib.Path(os.environ.get("LMZOO_DATA", pathlib.Path(__file__).resolve().parents[2] / "shared" / "data")) / "ptb"
)  # Mikolov's ptb.{train,valid,test}.txt
TRAIN_TOKENS = 929589  # words + <eos> of ptb.train.txt


def get_config(arg: str | None = None):
    c = base_config()
    (size,) = check_variants(arg or "small", known=("small", "medium", "tiny"), single=True)
    medium = size == "medium"
    c.model_name = "lstm"
    c.model = model_section(
        "lstm",
        vocab_size=10000,
        emb_dim=650 if medium else 200,
        num_layers=2,
        dropout_rate=0.5 if medium else 0.0,
        init_scale=0.05 if medium else 0.1,
    )
    c.data.train_path = str(PTB / "ptb.train.txt")
    c.data.validation_path = str(PTB / "ptb.valid.txt")
    c.data.tokenizer.kind = "word"
    c.data.seq_len = 35 if medium else 20  # unroll length
    c.train.batch_size = 20
    epoch_steps = (TRAIN_TOKENS // c.train.batch_size - 1) // c.data.seq_len
    epochs = 39 if medium else 13
    c.objective = objective_section(
        "recurrent_lm", epoch_steps=epoch_steps, decay_start_epoch=6 if medium else 4, lr_decay=0.8 if medium else 0.5
    )
    c.optim.name = "sgd"
    c.optim.learning_rate = 1.0
    c.optim.grad_clip = 5.0
    c.train.steps = epochs * epoch_steps
    c.train.log_every = 200
    c.train.eval_every = epoch_steps
    c.train.checkpoint_every = epoch_steps
    c.train.sample_tokens = 0  # samples come from the "recurrent_samples" evaluator (eval.py)
    c.eval.batch_size = 20
    if size == "tiny":
        c.model.emb_dim, c.model.vocab_size = 16, 10000
        c.objective.epoch_steps = 0
        c.train.steps, c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 4, 2, 2, 2
        c.optim.decay_steps = c.train.steps  # unused (SGD's epoch schedule), set so the run prints no decay_steps note
        c.eval.max_batches = 2
    return c
