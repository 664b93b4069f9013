"""A GPT-2 decoder trained on SST-2's movie-review sentences (no labels) for in-context evaluation.

    python scripts/sst2_icl_data.py --out=runs/sst2_icl/data
    python train.py --config=configs/sst2_lm.py --workdir=runs/sst2_icl/gpt2
    python eval.py --workdir=runs/sst2_icl/gpt2 --fewshot=runs/sst2_icl/data --fewshot_k=0,1,4,8

GPT-2's byte-level BPE (../shared/data/tokenizers/gpt2), so the checkpoint exports to an HF folder that
transformers and lm-eval read with the same tokenizer. `:tiny` shrinks it for tests.
"""

import pathlib

from lmzoo.config import base_config, check_variants, model_section

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


def get_config(arg: str | None = None):
    c = base_config()
    c.model_name = "gpt2"
    model = dict(
        vocab_size=50257,
        max_len=256,
        emb_dim=128,
        num_heads=4,
        num_layers=4,
        mlp_dim=512,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
    )
    c.data.source = "local"
    c.data.path = "runs/sst2_icl/data/corpus.txt"  # scripts/sst2_icl_data.py
    c.data.document_unit = "line"  # one sentence per document
    c.data.tokenizer = {"kind": "gpt2", "path": str(DATA / "tokenizers" / "gpt2")}
    c.data.seq_len = 128
    c.train.batch_size = 16
    c.train.steps = c.optim.decay_steps = 1500
    c.optim.warmup_steps = 100
    c.train.log_every = 50
    c.train.eval_every = c.train.checkpoint_every = 250
    c.train.sample_prompt = "this movie is"
    c.eval.max_batches = 20
    if "tiny" in check_variants(arg, known=("tiny",)):
        model.update(emb_dim=32, num_heads=2, num_layers=1, mlp_dim=64, max_len=64)
        c.data.seq_len, c.train.batch_size, c.train.steps, c.train.log_every = 32, 4, 4, 2
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.train.eval_every = c.train.checkpoint_every = 2
        c.eval.max_batches, c.train.sample_tokens = 2, 8
    c.model = model_section("gpt2", **model)
    return c
