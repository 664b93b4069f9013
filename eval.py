"""Evaluate a checkpoint: python eval.py --workdir=DIR [--split=validation] [--step=N] [--generate="prompt" ...]

Restores the latest checkpoint (or the kept one of --step) of a train.py run with the config it saved, prints loss,
perplexity, bits per token and bits per character as one JSON line (also written to
DIR/eval_<split>.json), and optionally samples a continuation of a prompt with the KV cache.

Denoising encoder-decoders (T5 span corruption, BART denoising): --reconstruct=N adds BLEU, ROUGE-1/2/L,
exact match and teacher-forced target token accuracy of the reconstructions of N examples to the line
(greedy decoding; beam search with --beam_size=K) and prints a few of them; see lmzoo/train/reconstruction.py.
"""

import json
import pathlib

from absl import app, flags, logging

flags.DEFINE_string("workdir", None, "Workdir of a train.py run.", required=True)
flags.DEFINE_string("split", "validation", "Split to evaluate: train or validation.")
flags.DEFINE_integer("max_batches", None, "Evaluate at most this many batches (default: the whole split).")
flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the latest that restores).")
flags.DEFINE_string("generate", None, "Prompt to continue.")
flags.DEFINE_integer("max_new_tokens", 200, "Tokens to sample.")
flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 = greedy.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("reconstruct", 0, "Denoising runs: score the reconstructions of this many examples (0 = off).")
flags.DEFINE_integer("beam_size", 1, "--reconstruct decoding: 1 = greedy, more = beam search with this many beams.")
flags.DEFINE_integer("show", 2, "--reconstruct: examples to print.")
flags.DEFINE_string("mesh_shape", None, "(data,fsdp,tensor) mesh for evaluation, e.g. '-1,1,1'; default: the run's "
                    "mesh if this machine has enough devices, else all devices data-parallel.")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import jax
    import numpy as np

    from lmzoo import config as config_lib
    from lmzoo.train import loop, reconstruction

    logging.set_verbosity(logging.WARNING)
    config = config_lib.load_saved(FLAGS.workdir)
    if FLAGS.reconstruct:
        try:
            reconstruction.check_objective(config.objective.name)
        except ValueError as e:
            raise SystemExit(f"--reconstruct: {e}") from None
    if FLAGS.mesh_shape:
        config.sharding.mesh_shape = tuple(int(x) for x in FLAGS.mesh_shape.strip("()").split(","))
    elif int(np.prod([abs(x) for x in config.sharding.mesh_shape])) > jax.device_count():
        print(f"the run's mesh {tuple(config.sharding.mesh_shape)} needs more than the {jax.device_count()} devices here; "
              "evaluating with mesh (-1, 1, 1) (checkpoints reshard on restore)")
        config.sharding.mesh_shape = (-1, 1, 1)
    setup = loop.build(config, FLAGS.workdir)
    if FLAGS.step is None:
        restored = setup.checkpointer.restore_latest(setup.abstract_state)
        if restored is None:
            raise SystemExit(f"no checkpoint found in {setup.checkpointer.directory}; train first with train.py --workdir={FLAGS.workdir}")
        step, state, _ = restored
    elif FLAGS.step not in setup.checkpointer.steps():
        raise SystemExit(f"no checkpoint for step {FLAGS.step} in {setup.checkpointer.directory}; kept steps: {setup.checkpointer.steps()}")
    else:
        step, (state, _) = FLAGS.step, setup.checkpointer.restore(FLAGS.step, setup.abstract_state)
    if FLAGS.split not in ("train", "validation"):
        raise SystemExit(f"unknown split {FLAGS.split!r}; choose train or validation")
    result = {"step": step, "split": FLAGS.split, **loop.evaluate(setup, state, FLAGS.split, FLAGS.max_batches)}
    examples = []
    if FLAGS.reconstruct:
        scores, examples = reconstruction.evaluate_reconstruction(setup, state, FLAGS.split, FLAGS.reconstruct, beam_size=FLAGS.beam_size)
        result.update(scores)
    line = json.dumps(result)
    print(line)
    suffix = "" if FLAGS.step is None else f"_step{step}"
    (pathlib.Path(FLAGS.workdir) / f"eval_{FLAGS.split}{suffix}.json").write_text(line + "\n")
    for i, example in enumerate(examples[: FLAGS.show]):
        print(f"--- example {i} ---")
        for key in ("corrupted", "reconstruction", "original"):
            print(f"[{key}]\n{example[key]}")
    if FLAGS.generate is not None:
        text = loop.sample_text(
            setup, loop.host_params(setup, state), FLAGS.generate, max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
            top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed,
        )  # fmt: skip
        print(FLAGS.generate + text)
    setup.checkpointer.close()


if __name__ == "__main__":
    app.run(main)
