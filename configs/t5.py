"""T5 span-corruption pretraining (noise density 0.15, mean span 3, sentinels <extra_id_i>).

    python train.py --config=configs/t5.py:tiny --workdir=runs/t5_tiny        # CPU run on The Time Machine
    python train.py --config=configs/t5.py:small --workdir=runs/t5_small      # published t5-small shape (60.5M)
    python train.py --config=configs/t5.py:base,v1_1 --workdir=runs/t5_base   # published t5-v1_1-base shape (247.6M)

Variants: size tiny | small | base (the published t5-small / t5-base shapes, vocabulary 32128); `v1_1` switches to gated
GELU, an untied head and the v1.1 shapes of google/t5-v1_1-small / -base. `base` scans its layers (one encoder and one
decoder layer traced and compiled) and rematerialises them as the platform needs (`remat_policy="auto"`). The tokenizer
is a SentencePiece unigram model trained on the corpus with 100 sentinels above its vocabulary (as in seqio). Needs
../shared/data/timemachine.
"""

import pathlib

from lmzoo.config import base_config, check_variants, model_section
from lmzoo.objectives import objective_section

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
SIZES = {
    "tiny": dict(emb_dim=128, num_heads=4, head_dim=32, num_encoder_layers=2, num_decoder_layers=2, mlp_dim=512),
    "small": dict(emb_dim=512, num_heads=8, head_dim=64, num_encoder_layers=6, num_decoder_layers=6, mlp_dim=2048),
    "base": dict(emb_dim=768, num_heads=12, head_dim=64, num_encoder_layers=12, num_decoder_layers=12, mlp_dim=3072),
}
# T5 v1.1 changed the shapes too (google/t5-v1_1-small / -base): more layers and heads, narrower gated MLPs.
V1_1_SIZES = {
    "tiny": SIZES["tiny"],
    "small": dict(emb_dim=512, num_heads=6, head_dim=64, num_encoder_layers=8, num_decoder_layers=8, mlp_dim=1024),
    "base": dict(emb_dim=768, num_heads=12, head_dim=64, num_encoder_layers=12, num_decoder_layers=12, mlp_dim=2048),
}


def get_config(arg: str | None = None):
    variant = check_variants(arg or "tiny", known=(*SIZES, "v1_1", "test"))
    size = next((v for v in variant if v in SIZES), "tiny")
    c = base_config()
    c.model_name = "seq2seq"
    vocab = 2000 if size == "tiny" else 32000
    padded_vocab = -(-(vocab + 100) // 128) * 128  # pieces + 100 sentinels, padded like T5's 32128
    v1_1 = "v1_1" in variant
    model = dict(
        (V1_1_SIZES if v1_1 else SIZES)[size], vocab_size=padded_vocab, dropout_rate=0.1 if size != "tiny" else 0.0
    )
    if v1_1:
        model.update(activations=("gelu_tanh", "linear"), tie_embeddings=False, scale_tied_logits=False)
    if size == "base":
        model.update(scan_layers=True, remat_policy="auto")
    c.model = model_section("seq2seq", **model)
    c.objective = objective_section("span_corruption")
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
        c.model = model_section(
            "seq2seq", **{**model, "emb_dim": 32, "num_heads": 2, "head_dim": 16, "mlp_dim": 64, "vocab_size": 600}
        )
        c.data.tokenizer.vocab_size = 500
        c.data.seq_len, c.train.batch_size, c.train.steps, c.train.log_every = 32, 4, 4, 2
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.train.eval_every = c.train.checkpoint_every = 2
        c.eval.max_batches = 2
    return c
