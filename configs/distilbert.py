"""DistilBERT-style distillation of a configs/bert.py model into a half-depth student (MLM windows).

    python train.py --config=configs/bert.py --workdir=runs/bert                       # the teacher
    python train.py --config=configs/distilbert.py --workdir=runs/distilbert --config.objective.teacher=ckpt:runs/bert

Student: half the layers (initialised from every other teacher layer), no pooler; loss 5.0 * soft CE (T=2) + 2.0 * MLM
+ 1.0 * cosine, as in Sanh et al. 2019. `:tiny` pairs with configs/bert.py:tiny.
"""

import pathlib

from lmzoo.config import base_config, check_variants, model_section
from lmzoo.objectives import objective_section

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


def get_config(arg: str | None = None):
    tiny = "tiny" in check_variants(arg, known=("tiny",))
    teacher = dict(vocab_size=30522, max_len=128, emb_dim=256, num_heads=4, num_layers=4, mlp_dim=1024)
    if tiny:
        teacher.update(emb_dim=32, num_heads=2, num_layers=2, mlp_dim=64, max_len=32)
    c = base_config()
    c.model_name = "bert"
    c.model = model_section(
        "bert", **{**teacher, "num_layers": teacher["num_layers"] // 2, "pooler": False, "sentence_head": False}
    )
    c.objective = objective_section("distill", teacher_model=model_section("bert", **teacher))
    c.data.source = "local"
    c.data.path = str(DATA / "kjv_bible" / "kjv.txt")
    c.data.document_unit = "paragraph"
    c.data.tokenizer = {"kind": "wordpiece", "path": str(DATA / "tokenizers" / "bert_uncased" / "vocab.txt")}
    c.data.seq_len = 64
    c.data.sampler = "sequential"
    c.optim.learning_rate = 5e-4
    c.optim.min_learning_rate = 5e-5
    c.optim.b2 = 0.999
    c.optim.weight_decay = 0.01
    c.train.batch_size = 32
    c.train.steps = c.optim.decay_steps = 2000
    c.train.eval_every = c.train.checkpoint_every = 500
    c.train.sample_tokens = 0
    c.eval.max_batches = 20
    if tiny:
        c.data.seq_len, c.train.batch_size, c.train.steps, c.train.log_every = 32, 4, 4, 2
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.train.eval_every = c.train.checkpoint_every = 2
        c.eval.max_batches = 2
    return c
