"""The original Transformer (Vaswani et al. 2017) as a denoising encoder-decoder: sinusoidal positions,
embeddings scaled by sqrt(d_model) and shared with the output layer, post-LN, ReLU, dropout 0.1.

    python train.py --config=configs/transformer.py:tiny --workdir=runs/transformer_tiny   # CPU run on The Time Machine
    python train.py --config=configs/transformer.py:base --workdir=runs/transformer_base   # "base" shape (6+6 x 512, 8 heads, 2048)

The objective is BART-style text infilling (any list of `config.objective.noising` transforms works, see
configs/bart.py); the tokenizer is a SentencePiece unigram model trained on the corpus with a [MASK]
symbol. Needs ../shared/data/timemachine.

    python train.py --config=configs/transformer.py:tiny,hh --workdir=runs/transformer_hh

`hh` trains it as a supervised text-to-text model instead: HH-RLHF dialogues (harmless-base test, 2,312)
split at the last "\n\nAssistant:" into the conversation so far (source) and the final response (target).
"""

import pathlib

from lmzoo.config import base_config, check_variants, model_section
from lmzoo.objectives import objective_section

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
SIZES = {
    "tiny": dict(emb_dim=128, num_heads=4, head_dim=32, num_encoder_layers=2, num_decoder_layers=2, mlp_dim=512),
    "base": dict(emb_dim=512, num_heads=8, head_dim=64, num_encoder_layers=6, num_decoder_layers=6, mlp_dim=2048),
}
TRANSFORMER = dict(
    positions="sinusoidal",
    pre_norm=False,
    norm="layer",
    use_bias=True,
    scale_embeddings=True,
    activations=("relu",),
    attention_scale=0.0,
    scale_tied_logits=False,
    layer_norm_epsilon=1e-6,
    init_scheme="normal",
)


def get_config(arg: str | None = None):
    variant = check_variants(arg or "tiny", known=(*SIZES, "hh", "test"))
    size = next((v for v in variant if v in SIZES), "tiny")
    c = base_config()
    c.model_name = "seq2seq"
    vocab = 2000 if size == "tiny" else 32000
    c.data.seq_len = 128
    model = dict(SIZES[size], **TRANSFORMER, vocab_size=vocab, max_len=c.data.seq_len, dropout_rate=0.1)
    model["embedding_init_std"] = model["emb_dim"] ** -0.5  # tensor2tensor's embedding init, scaled back up by sqrt(d)
    c.objective = objective_section(
        "denoising", noising=(("text_infilling", {"mask_ratio": 0.3, "poisson_lambda": 3.0}),)
    )
    c.data.source = "local"
    c.data.path = str(DATA / "timemachine" / "timemachine.txt")
    c.data.document_unit = "paragraph"
    c.data.tokenizer = {
        "kind": "sentencepiece",
        "vocab_size": vocab,
        "model_type": "unigram",
        "user_defined_symbols": ["[MASK]"],
    }
    c.data.sampler = "sequential"
    c.optim.learning_rate = 1e-3
    c.optim.min_learning_rate = 1e-4
    c.optim.b2 = 0.98  # Vaswani et al.
    c.optim.eps = 1e-9
    c.optim.weight_decay = 0.0
    c.train.batch_size = 32
    c.train.steps = c.optim.decay_steps = 1500
    c.train.eval_every = c.train.checkpoint_every = 500
    c.train.sample_tokens = 0
    c.eval.batch_size = 64
    if "hh" in variant:
        c.objective = objective_section("text_to_text")
        c.data.source = "pairs"
        c.data.path = str(DATA / "hh_rlhf" / "harmless-base_test.jsonl.gz")
        c.data.text_fields = ("chosen",)
        c.data.split_marker = "\n\nAssistant:"
        c.data.seq_len, c.data.target_seq_len = 256, 64
        model["max_len"] = c.data.seq_len
        c.data.tokenizer = {"kind": "sentencepiece", "vocab_size": vocab, "model_type": "unigram"}
        c.train.steps = c.optim.decay_steps = 600
        c.train.eval_every = c.train.checkpoint_every = 200
    if "test" in variant:
        model.update(emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64, vocab_size=500, max_len=32, dropout_rate=0.0)
        c.data.tokenizer.vocab_size = 500
        c.data.seq_len, c.data.target_seq_len, c.train.batch_size, c.train.steps, c.train.log_every = 32, 16, 4, 4, 2
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.train.eval_every = c.train.checkpoint_every = 2
        c.eval.max_batches = 2
    c.model = model_section("seq2seq", **model)
    return c
