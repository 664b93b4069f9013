"""Alignment stage 1: supervised fine-tuning of a small byte-level GPT-2 on the chosen HH-RLHF dialogues.

    python train.py --config=configs/hh_sft.py --workdir=runs/hh_sft

Prompt -> chosen reply examples packed into 256-byte rows, loss on the reply only; 10% of the
prompts are held out (the same ones in configs/hh_rm.py and configs/hh_ppo.py). Variant `tiny`
runs a few steps of a 1-layer model on the same file.
"""

import pathlib

from lmzoo.config import base_config, check_variants, model_section
from lmzoo.objectives import objective_section

HH_PATH = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "hh_rlhf" / "harmless-base_test.jsonl.gz"


def alignment_model(tiny: bool) -> dict:
    """The decoder every alignment stage shares (the reward model and PPO load the SFT weights into it)."""
    if tiny:
        return dict(
            vocab_size=258,
            max_len=64,
            emb_dim=32,
            num_heads=2,
            num_layers=1,
            mlp_dim=64,
            dropout_rate=0.0,
            attention_dropout_rate=0.0,
        )
    return dict(
        vocab_size=258,
        max_len=256,
        emb_dim=128,
        num_heads=4,
        num_layers=4,
        mlp_dim=512,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
    )


def get_config(arg: str | None = None):
    tiny = "tiny" in check_variants(arg, ("tiny",))
    c = base_config()
    c.model = model_section("gpt2", **alignment_model(tiny))
    c.data.source = "local"
    c.data.path = str(HH_PATH)
    c.data.tokenizer.kind = "byte"  # 256 bytes + <eos> 256 + <pad> 257
    c.data.seq_len = 256
    c.objective = objective_section("sft", heldout_fraction=0.1, split_seed=0)
    c.optim.learning_rate, c.optim.min_learning_rate = 1e-3, 1e-4
    c.optim.warmup_steps = 30
    c.train.steps = c.optim.decay_steps = 400
    c.train.batch_size = 16
    c.train.log_every = 25
    c.train.eval_every = c.train.checkpoint_every = 200
    c.train.sample_tokens = 0
    c.eval.batch_size = 32
    if tiny:
        c.data.seq_len = 64
        c.train.steps, c.train.batch_size, c.train.log_every = 4, 4, 2
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.train.eval_every = c.train.checkpoint_every = 2
        c.eval.batch_size, c.eval.max_batches = 8, 2
    return c
