"""T5 span-corruption pretraining (noise density 0.15, mean span 3, sentinels <extra_id_i>).

    python train.py --config=configs/t5.py:tiny --workdir=runs/t5_tiny        # CPU run on The Time Machine
    python train.py --config=configs/t5.py:small --workdir=runs/t5_small      # published T5-small shape (60M)
    python train.py --config=configs/t5.py:base,v1_1 --workdir=runs/t5_base   # T5 v1.1 base shape

Variants: size tiny | small | base; `v1_1` switches to gated GELU and an untied head. The tokenizer is a
SentencePiece unigram model trained on the corpus with 100 sentinels above its vocabulary (as in
seqio). Needs ../shared/data/timemachine.
"""

import pathlib

from lmzoo.config import base_config, model_section

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
SIZES = {
    "tiny": dict(emb_dim=128, num_heads=4, head_dim=32, num_encoder_layers=2, num_decoder_layers=2, mlp_dim=512),
    "small": dict(emb_dim=512, num_heads=8, head_dim=64, num_encoder_layers=6, num_decoder_layers=6, mlp_dim=2048),
    "base": dict(emb_dim=768, num_heads=12, head_dim=64, num_encoder_layers=12, num_decoder_layers=12, mlp_dim=3072),
}


def get_config(arg: str | None = None):
    variant = (arg or "tiny").split(",")
    size = next((v for v in variant if v in SIZES), "tiny")
    c = base_config()
    c.model_name = "seq2seq"
    vocab = 2000 if size == "tiny" else 32000
    model = dict(SIZES[size], vocab_size=vocab + 100, dropout_rate=0.1 if size != "tiny" else 0.0)
    if "v1_1" in variant:
        model.update(activations=("gelu_tanh", "linear"), tie_embeddings=False)
    c.model = model_section("seq2seq", **model)
    c.objective.name = "span_corruption"
    c.data.source = "local"
    c.data.path = str(DATA / "timemachine" / "timemachine.txt")
    c.data.document_unit = "paragraph"
    c.data.tokenizer = {"kind": "sentencepiece", "vocab_size": vocab, "model_type": "unigram", "extra_ids": 100}
    c.data.seq_len = 128  # encoder input length; targets are sized by span_corruption_lengths
    c.data.sampler = "sequential"
    c.optim.learning_rate = 1e-3
    c.optim.min_learning_rate = 1e-4
    c.optim.weight_decay = 0.0
    c.optim.b2 = 0.999
    c.train.batch_size = 32
    c.train.steps = c.optim.decay_steps = 1500
    c.train.eval_every = c.train.checkpoint_every = 500
    c.train.sample_tokens = 0
    c.eval.batch_size = 64
    if "test" in variant:
        c.model = model_section("seq2seq", **{**model, "emb_dim": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64, "vocab_size": 600})
        c.data.tokenizer.vocab_size = 500
        c.data.seq_len, c.train.batch_size, c.train.steps, c.train.log_every = 32, 4, 4, 2
        c.train.eval_every = c.train.checkpoint_every = 2
        c.eval.max_batches = 2
    return c
