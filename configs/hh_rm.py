"""Alignment stage 2: a reward model on the HH-RLHF comparisons, the SFT decoder under a scalar head.

    python train.py --config=configs/hh_rm.py --workdir=runs/hh_rm --config.init_from=ckpt:runs/hh_sft

Each batch element is one prompt with its K = 2 ranked replies (one forward per reply), loss
−log σ(r_chosen − r_rejected); one epoch (InstructGPT: more overfits). In-loop evaluation reports
the held-out pairwise accuracy next to length-only baselines. Variant `tiny`: a few steps of the
1-layer model of configs/hh_sft.py:tiny.
"""

import importlib.util
import pathlib

from lmzoo.config import check_variants, objective_section


def _sft_config(arg):
    spec = importlib.util.spec_from_file_location("hh_sft", pathlib.Path(__file__).with_name("hh_sft.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def get_config(arg: str | None = None):
    tiny = "tiny" in check_variants(arg, ("tiny",))
    c = _sft_config("tiny" if tiny else None)
    c.objective = objective_section("reward_model", heldout_fraction=0.1, split_seed=0, max_responses=2)
    c.optim.learning_rate, c.optim.min_learning_rate = 1e-4, 1e-5
    c.optim.warmup_steps = 10
    c.optim.weight_decay = 0.0
    c.train.batch_size = 16
    c.train.steps = c.optim.decay_steps = 130  # one epoch of the ~2,080 training pairs
    c.train.log_every = 10
    c.train.eval_every = c.train.checkpoint_every = 65
    c.eval.evaluators = ("loss", "preference")
    if tiny:
        c.train.steps, c.train.batch_size, c.train.log_every = 4, 4, 2
        c.train.eval_every = c.train.checkpoint_every = 2
    return c
