"""Default run: a small GPT-2 on the installed Python standard library's source, byte-level.

    python train.py                      # = --config=configs/default.py --workdir=runs/default

Needs no download and no files outside the Python installation; about 3 minutes on 2 quiet CPU
cores (longer when they are shared). Writes checkpoints, TensorBoard logs (runs/default/tb) and a sample (runs/default/sample.txt).
"""

from lmzoo.config import base_config, check_variants, model_section


def get_config(arg: str | None = None):
    tiny = "tiny" in check_variants(arg, known=("tiny",))  # tiny: 1 layer, 4 steps (tests and smoke runs)
    c = base_config()
    c.model_name = "gpt2"
    c.model = model_section(
        "gpt2",
        vocab_size=258,  # 256 bytes + <eos> + <pad>
        max_len=128,
        emb_dim=128,
        num_heads=4,
        num_layers=4,
        mlp_dim=512,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
    )
    c.data.source = "python_stdlib"
    c.data.max_files = 200
    c.data.tokenizer.kind = "byte"
    c.data.seq_len = 128
    c.train.steps = 600
    c.train.batch_size = 16
    c.train.log_every = 50
    c.train.eval_every = 300
    c.train.checkpoint_every = 300
    c.optim.warmup_steps = 50
    c.optim.decay_steps = 600
    c.eval.max_batches = 20
    c.train.sample_prompt = "def "
    if tiny:
        c.model.num_layers, c.model.emb_dim, c.model.mlp_dim, c.model.num_heads = 1, 32, 64, 2
        c.data.max_files, c.data.seq_len, c.model.max_len = 5, 32, 32
        c.train.steps, c.train.batch_size, c.train.log_every = 4, 4, 2
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.train.eval_every = c.train.checkpoint_every = 2
        c.eval.max_batches, c.train.sample_tokens = 2, 8
    return c
