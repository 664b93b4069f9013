"""Alignment from the comparisons directly: DPO of the SFT policy on the HH-RLHF pairs (no reward model, no sampling).

    python train.py --config=configs/hh_dpo.py --workdir=runs/hh_dpo --config.objective.sft=ckpt:runs/hh_sft

Each batch element is a prompt with its chosen and rejected replies (prompt ⊕ reply ⊕ EOS, cut as for the reward
model); the reference is the frozen SFT decoder, which the policy starts from. One epoch of the ~2,080 training
pairs. Variants: `ipo` (the IPO loss), `cdpo` (conservative DPO, label smoothing 0.1), `tiny` (a few steps of the
1-layer model of configs/hh_sft.py:tiny).
"""

import pathlib

from lmzoo.config import check_variants, load_config_file
from lmzoo.objectives import objective_section


def get_config(arg: str | None = None):
    variants = check_variants(arg, ("tiny", "ipo", "cdpo"))
    tiny = "tiny" in variants
    c = load_config_file(pathlib.Path(__file__).with_name("hh_sft.py"), "tiny" if tiny else None)
    objective = dict(heldout_fraction=0.1, split_seed=0, beta=0.1)
    if "ipo" in variants:
        objective.update(loss_type="ipo", beta=0.5)  # IPO's β regularises per-token mean log-ratios: larger
    if "cdpo" in variants:
        objective.update(label_smoothing=0.1)
    c.objective = objective_section("dpo", **objective)
    c.optim.learning_rate, c.optim.min_learning_rate = 5e-5, 5e-6
    c.optim.warmup_steps = 10
    c.optim.weight_decay = 0.0
    c.train.batch_size = 16
    c.train.steps = c.optim.decay_steps = 130  # one epoch of the ~2,080 training pairs
    c.train.log_every = 10
    c.train.eval_every = c.train.checkpoint_every = 65
    if tiny:
        c.optim.learning_rate, c.optim.min_learning_rate = 1e-3, 1e-3
        c.optim.warmup_steps = 0
        c.train.steps, c.train.batch_size, c.train.log_every = 4, 4, 1
        c.optim.decay_steps = c.train.steps  # the schedule ends with the run: no decay_steps note
        c.train.eval_every = c.train.checkpoint_every = 2
    return c
