"""Zaremba et al. "small" LSTM LM on Penn Treebank through the real loop: train, then valid/test perplexity.

    PYTHONPATH=$PWD python scripts/ptb_lstm.py --workdir=runs/ptb_lstm [--variant=small] [--steps=N]

Trains configs/ptb_lstm.py with `loop.train_and_evaluate` (checkpoints every epoch, resumable with the
same command), then scores ptb.valid.txt and ptb.test.txt with the "loss" evaluator, each with its own
carry over the whole split, and prints three samples. Zaremba et al. report valid 120.7 / test 114.5.

"""

import argparse
import os
import pathlib
import time

from bench.common import cpu_model_and_isa
from configs import ptb_lstm
from lmzoo.evaluation import loss as loss_eval
from lmzoo.evaluation import recurrent
from lmzoo.train import loop
from lmzoo.train import run as run_lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--variant", default="small")
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0 = the recipe's)")
    args = parser.parse_args()
    config = ptb_lstm.get_config(args.variant)
    if args.steps:
        config.train.steps = args.steps
    workdir = pathlib.Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"cpu: {cpu_model_and_isa()[0]}, {os.cpu_count()} cores shared with other jobs", flush=True)
    start = time.perf_counter()
    loop.train_and_evaluate(config, str(workdir))
    print(f"train wall time {time.perf_counter() - start:.0f} s", flush=True)
    run = run_lib.open_run(str(workdir))
    step, state = run_lib.restore_step(run)
    run.add_split("test", str(ptb_lstm.PTB / "ptb.test.txt"))
    for split in ("validation", "test"):
        metrics = loss_eval.evaluate_loss(run, state, split)
        print(
            f"step {step} {split}: perplexity {metrics['perplexity']:.2f} over {metrics['tokens']:.0f} tokens",
            flush=True,
        )
    recurrent.evaluate_samples(run, state)
    run.close()


if __name__ == "__main__":
    main()
