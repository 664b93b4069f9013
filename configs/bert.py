"""A small BERT pretrained with MLM (+ NSP) on the King James Bible, WordPiece bert-base-uncased vocabulary.

    python train.py --config=configs/bert.py --workdir=runs/bert                  # MLM + NSP (BERT)
    python train.py --config=configs/bert.py:roberta --workdir=runs/roberta       # dynamic-masking MLM on windows
    python train.py --config=configs/bert.py:albert --workdir=runs/albert         # factorized + shared, MLM + SOP
    python train.py --config=configs/bert.py:base --workdir=runs/bert_base        # BERT-base (:large; :roberta,base)

Documents are chapters (blank-line separated paragraphs of kjv.txt). Needs ../shared/data
(kjv_bible/kjv.txt, tokenizers/bert_uncased/vocab.txt). `:tiny` shrinks it for tests. `base` and `large` are the
published shapes (bert-base-uncased: 12 layers of 768, 12 heads, MLP 3,072; bert-large: 24 of 1,024, 16 heads, 4,096;
512 positions, 514 with RoBERTa's offset of 2) at BERT's learning rate 1e-4, for accelerators: their layers scanned
(one traced and compiled) and rematerialised as the platform needs (`remat_policy="auto"`).
"""

import pathlib

from lmzoo.config import base_config, check_variants, model_section
from lmzoo.objectives import objective_section

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
SIZES = {
    "base": dict(emb_dim=768, num_heads=12, num_layers=12, mlp_dim=3072),
    "large": dict(emb_dim=1024, num_heads=16, num_layers=24, mlp_dim=4096),
}


def get_config(arg: str | None = None):
    variant = check_variants(arg or "bert", known=("bert", "roberta", "albert", "tiny", *SIZES))
    c = base_config()
    c.model_name = "bert"
    model = dict(
        vocab_size=30522,
        max_len=128,
        emb_dim=256,
        num_heads=4,
        num_layers=4,
        mlp_dim=1024,
        dropout_rate=0.1,
        attention_dropout_rate=0.1,
    )
    objective = dict(name="mlm_nsp", static_masking=True)
    if "roberta" in variant:
        model.update(type_vocab_size=1, position_offset=2, pooler=False, sentence_head=False, max_len=130)
        objective = dict(name="mlm", static_masking=False)
    if "albert" in variant:
        model.update(embedding_dim=64, share_layers=True, activation="gelu_tanh")
        objective["name"] = "mlm_sop"
    sizes = [size for size in SIZES if size in variant]
    if len(sizes) > 1:
        raise ValueError(f"config variants {arg!r}: choose one of {', '.join(SIZES)} (each is a model's shape)")
    if sizes:  # `kernels.remat_policy` decides "auto": none on the CPU, the projections kept on accelerators
        model.update(
            SIZES[sizes[0]], max_len=512 + model.get("position_offset", 0), scan_layers=True, remat_policy="auto"
        )
    c.data.source = "local"
    c.data.path = str(DATA / "kjv_bible" / "kjv.txt")
    c.data.document_unit = "paragraph"
    c.data.tokenizer = {"kind": "wordpiece", "path": str(DATA / "tokenizers" / "bert_uncased" / "vocab.txt")}
    c.data.seq_len = 128
    c.data.sampler = "sequential"
    c.optim.learning_rate = 5e-4
    c.optim.min_learning_rate = 5e-5
    c.optim.b2 = 0.999
    c.optim.weight_decay = 0.01
    c.optim.warmup_steps = 200
    c.train.batch_size = 32
    c.train.steps = c.optim.decay_steps = 3000
    c.train.eval_every = c.train.checkpoint_every = 500
    c.train.sample_tokens = 0
    if sizes:  # BERT's
        c.optim.learning_rate, c.optim.min_learning_rate = 1e-4, 1e-5
    c.eval.batch_size = 64
    c.eval.max_batches = 20
    if "tiny" in variant:
        model.update(emb_dim=32, num_heads=2, num_layers=2, mlp_dim=64, max_len=model["max_len"] - 96)
        if "albert" in variant:
            model.update(embedding_dim=16)
        c.data.seq_len, c.train.batch_size, c.train.steps, c.train.log_every = 32, 4, 4, 2
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.train.eval_every = c.train.checkpoint_every = 2
        c.eval.max_batches = 2
        if objective["name"] != "mlm":
            objective.update(num_pair_examples=64, num_eval_pairs=16)
    c.model = model_section("bert", **model)
    c.objective = objective_section(**objective)
    return c
