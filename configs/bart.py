"""BART denoising pretraining: text infilling (Poisson(3) spans, 30% of tokens, one [MASK] per span)
and sentence permutation, reconstructing the original text.

    python train.py --config=configs/bart.py:tiny --workdir=runs/bart_tiny     # CPU run on the KJV Bible
    python train.py --config=configs/bart.py:base --workdir=runs/bart_base     # BART-base shape

The noising list is `config.objective.noising` (any of text_infilling, sentence_permutation, token_masking,
token_deletion, document_rotation, applied in order). Tokenizer: SentencePiece unigram trained on the corpus with a
[MASK] symbol. `tiny` trains on ../shared/data/kjv_bible with text infilling only; `test` and `base` keep
../shared/data/timemachine and both transforms. `base` scans its layers and rematerialises them as the platform needs
(`remat_policy="auto"`).
"""

import pathlib

from lmzoo.config import base_config, check_variants, model_section
from lmzoo.objectives import objective_section

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
SIZES = {
    "tiny": dict(emb_dim=128, num_heads=4, head_dim=32, num_encoder_layers=2, num_decoder_layers=2, mlp_dim=512),
    "base": dict(emb_dim=768, num_heads=12, head_dim=64, num_encoder_layers=6, num_decoder_layers=6, mlp_dim=3072),
}
BART = dict(
    positions="learned",
    position_offset=2,
    pre_norm=False,
    norm="layer",
    use_bias=True,
    embedding_norm=True,
    activations=("gelu",),
    attention_scale=0.0,
    scale_tied_logits=False,
    final_logits_bias=True,
    layer_norm_epsilon=1e-5,
    embedding_init_std=0.02,
    init_scheme="normal",
)


def get_config(arg: str | None = None):
    variant = check_variants(arg or "tiny", known=(*SIZES, "test"))
    size = next((v for v in variant if v in SIZES), "tiny")
    c = base_config()
    c.model_name = "seq2seq"
    vocab = 2000 if size == "tiny" else 32000
    c.data.seq_len = 128
    model = dict(
        SIZES[size], **BART, vocab_size=vocab, max_len=c.data.seq_len + 2, dropout_rate=0.1 if size != "tiny" else 0.0
    )
    if size == "base":
        model.update(scan_layers=True, remat_policy="auto")
    noising = (
        ("sentence_permutation", {"sentence_end_ids": "auto"}),  # ids of ".", "!", "?" in the vocabulary
        ("text_infilling", {"mask_ratio": 0.3, "poisson_lambda": 3.0}),
    )
    c.data.source = "local"
    c.data.path = str(DATA / "timemachine" / "timemachine.txt")
    c.data.document_unit = "paragraph"
    if size == "tiny" and "test" not in variant:
        # The Time Machine (52k tokens, ~117 passes in 1,500 steps) let the tiny model memorise its training
        # text and ignore the encoder; the KJV Bible (one document per chapter) has 24x the bytes. Text
        # infilling alone (the BART paper's best single transform) keeps the copy monotonic.
        noising = (("text_infilling", {"mask_ratio": 0.3, "poisson_lambda": 3.0}),)
        c.data.path = str(DATA / "kjv_bible" / "kjv.txt")
    c.data.tokenizer = {
        "kind": "sentencepiece",
        "vocab_size": vocab,
        "model_type": "unigram",
        "user_defined_symbols": ["[MASK]"],
    }
    c.data.sampler = "sequential"
    c.optim.learning_rate = 1e-3
    c.optim.min_learning_rate = 1e-4
    c.optim.weight_decay = 0.01
    c.optim.b2 = 0.999
    c.train.batch_size = 32
    c.train.steps = c.optim.decay_steps = 1500
    c.train.eval_every = c.train.checkpoint_every = 500
    c.train.sample_tokens = 0
    c.eval.batch_size = 64
    if "test" in variant:
        model.update(emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64, vocab_size=500, max_len=34)
        c.data.tokenizer.vocab_size = 500
        c.data.seq_len, c.train.batch_size, c.train.steps, c.train.log_every = 32, 4, 4, 2
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.train.eval_every = c.train.checkpoint_every = 2
        c.eval.max_batches = 2
    c.model = model_section("seq2seq", **model)
    c.objective = objective_section("denoising", noising=noising)
    return c
