"""nanoGPT's CPU "baby GPT" on Tiny Shakespeare, character level (target: val loss <= 1.89).

    python train.py --config=configs/shakespeare_char.py --workdir=runs/shakespeare_char

4 layers, 4 heads, 128 dims, context 64, batch 12, 2000 iterations, AdamW lr 1e-3 (warmup 100,
cosine to 1e-4 at 2000), beta2 0.99, weight decay 0.1 on all matrices (embeddings too, as in
nanoGPT), clip 1.0, no dropout, no biases, exact GELU, 90/10 split by characters; ten steps a compiled call.
`:tiny` shrinks it for tests.
"""

import pathlib

from lmzoo.config import base_config, check_variants, model_section

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"


def get_config(arg: str | None = None):
    c = base_config()
    c.model_name = "gpt2"
    c.model = model_section(
        "gpt2",
        vocab_size=66,  # 65 characters + <eos>
        max_len=64,
        emb_dim=128,
        num_heads=4,
        num_layers=4,
        mlp_dim=512,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
        use_bias=False,  # nanoGPT's default
        activation="gelu",  # exact GELU, as nanoGPT's nn.GELU()
    )
    c.data.source = "local"
    c.data.path = str(DATA)
    c.data.tokenizer.kind = "char"
    c.data.seq_len = 64
    c.data.validation_fraction = 0.1
    c.optim.learning_rate = 1e-3
    c.optim.min_learning_rate = 1e-4
    c.optim.warmup_steps = 100
    c.optim.decay_steps = 2000
    c.optim.b2 = 0.99
    c.optim.weight_decay = 0.1
    c.optim.decay_embeddings = True
    c.optim.grad_clip = 1.0
    c.train.steps = 2000
    c.train.batch_size = 12
    c.train.log_every = 100
    c.train.steps_per_call = 10  # ten steps a compiled call: the host's per-step dispatch paid once per ten
    c.train.eval_every = 500
    c.train.checkpoint_every = 500
    c.train.sample_prompt = "ROMEO:"
    c.train.sample_tokens = 300
    if "tiny" in check_variants(arg, known=("tiny",)):
        c.train.steps, c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 4, 2, 2, 2
        c.train.steps_per_call = 1
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.model.num_layers, c.eval.max_batches, c.train.sample_tokens = 1, 2, 8
    return c
