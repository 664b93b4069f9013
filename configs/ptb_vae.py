"""Gaussian VAE-LM (Bowman et al. 2016) on Penn Treebank sentences, with or without KL annealing.

    python train.py --config=configs/ptb_vae.py:annealed --workdir=runs/ptb_vae
    python eval.py --workdir=runs/ptb_vae --data=../shared/data/ptb/ptb.test.txt

One sentence a row (PTB's longest is 83 tokens with <eos>), LSTM encoder and decoder of 256 units sharing a
256-dim embedding, 32 latent dimensions, Adam 1e-3; word dropout off (`--config.objective.word_dropout=0.25`
replaces a quarter of the decoder's input words by <unk> in training, as Bowman et al. do to keep z in use).
`annealed` raises the KL weight linearly over 4 epochs; `plain` keeps it at 1 from the start (the setting in which the posterior collapses);
`tiny` shrinks everything for tests. eval.py adds the K-sample importance-weighted perplexity, the KL, the
active units, prior samples and an interpolation (the "latent" evaluator). `plain` with
`--config.model.latent_dim=0` is the decoder alone, an LSTM LM on the same sentences (KL 0, exact likelihood).
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
    (variant,) = check_variants(arg or "annealed", known=("annealed", "plain", "tiny"), single=True)
    c = base_config()
    c.model_name = "vae_lm"
    c.model = model_section("vae_lm", vocab_size=10000, emb_dim=256, latent_dim=32, dropout_rate=0.0, init_scale=0.1)
    c.data.train_path = str(PTB / "ptb.train.txt")
    c.data.validation_path = str(PTB / "ptb.valid.txt")
    c.data.tokenizer.kind = "word"
    c.data.seq_len = 83
    c.train.batch_size = 32
    epoch_steps = TRAIN_SENTENCES // c.train.batch_size
    c.objective = objective_section(
        "vae_lm", kl_anneal_steps=4 * epoch_steps if variant == "annealed" else 0, num_iw_samples=50
    )
    c.optim.learning_rate = 1e-3
    c.optim.min_learning_rate = 1e-4
    c.optim.warmup_steps = 100
    c.optim.decay_steps = c.train.steps = 10 * epoch_steps
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 5.0
    c.train.log_every = 200
    c.train.eval_every = c.train.checkpoint_every = epoch_steps
    c.train.sample_tokens = 0  # eval.py's "latent" evaluator prints samples
    c.eval.batch_size = 64
    if variant == "tiny":
        c.model.emb_dim, c.model.latent_dim = 16, 4
        c.data.seq_len, c.train.batch_size, c.eval.batch_size = 83, 8, 8
        c.objective.kl_anneal_steps, c.objective.num_iw_samples = 4, 5
        c.train.steps, c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 4, 1, 4, 4
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.eval.max_batches = 2
    return c
