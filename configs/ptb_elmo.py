"""ELMo biLM pretraining on Penn Treebank sentences (forward + backward LSTM LMs, shared embedding and softmax).

    python train.py --config=configs/ptb_elmo.py --workdir=runs/ptb_elmo

2 layers x 256, dropout 0.1, Adam 1e-3, batch 32 shuffled sentences of similar length, 5 epochs; the "loss"
metric is the mean of the forward and backward per-token losses. `tiny` shrinks everything for tests.
"""

import os
import pathlib

from lmzoo.config import base_config, check_variants, model_section
from lmzoo.objectives import objective_section

PTB = (
    pathlib.Path(os.environ.get("LMZOO_DATA", pathlib.Path(__file__).resolve().parents[2] / "shared" / "data")) / "ptb"
)  # Mikolov's ptb.{train,valid,test}.txt
TRAIN_SENTENCES = 42068


def get_config(arg: str | None = None):
    check_variants(arg, known=("tiny",))
    c = base_config()
    c.model_name = "elmo"
    c.model = model_section("elmo", vocab_size=10000, emb_dim=256, num_layers=2, dropout_rate=0.1, init_scale=0.1)
    c.data.train_path = str(PTB / "ptb.train.txt")
    c.data.validation_path = str(PTB / "ptb.valid.txt")
    c.data.tokenizer.kind = "word"
    c.data.seq_len = 83  # longest PTB sentence with its <eos>
    c.objective = objective_section("bilm")
    c.train.batch_size = 32
    epoch_steps = -(-TRAIN_SENTENCES // c.train.batch_size)
    c.train.steps = c.optim.decay_steps = 5 * epoch_steps
    c.optim.learning_rate, c.optim.min_learning_rate, c.optim.warmup_steps, c.optim.weight_decay = 1e-3, 1e-4, 100, 0.0
    c.optim.grad_clip = 5.0
    c.train.log_every = 200
    c.train.eval_every = c.train.checkpoint_every = epoch_steps
    c.train.sample_tokens = 0
    c.eval.batch_size = 64
    if arg == "tiny":
        c.model.emb_dim, c.data.seq_len, c.train.batch_size, c.eval.batch_size = 16, 83, 8, 8
        c.train.steps, c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 4, 2, 4, 4
        c.optim.warmup_steps, c.eval.max_batches = 0, 2
        # the schedule ends with the run (no decay_steps note), at a constant rate as the 4 steps of the full one were
        c.optim.decay_steps, c.optim.min_learning_rate = c.train.steps, c.optim.learning_rate
    return c
