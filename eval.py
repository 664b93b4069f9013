"""Evaluate a checkpoint: python eval.py --workdir=DIR [--split=validation | --data=FILE] [--step=N] [--generate="prompt" ...]

Restores the latest checkpoint (or the kept one of --step) of a train.py run from its workdir alone (its
saved config, tokenizer and checkpoints; the training data is not read unless --split asks for it) and
prints the objective's metrics as one JSON line (also written to DIR/eval_<split>[_step<N>].json): loss,
perplexity, bits per token and per character; accuracy and F1 for classifiers. --data scores a file the run
never saw, in the objective's format (text for language models, a TSV for classifiers, pairs for
text_to_text). Optionally samples a continuation of a prompt with the KV cache.

Denoising encoder-decoders (T5 span corruption, BART denoising): --reconstruct=N adds BLEU, ROUGE-1/2/L,
exact match and teacher-forced target token accuracy of the reconstructions of N examples to the line
(greedy decoding; beam search with --beam_size=K) and prints a few of them; see lmzoo/evaluation/reconstruction.py.
"""

import json
import pathlib

from absl import app, flags, logging

flags.DEFINE_string("workdir", None, "Workdir of a train.py run.", required=True)
flags.DEFINE_string("split", "validation", "Split to evaluate: train or validation.")
flags.DEFINE_string("data", None, "Evaluate this file (in the objective's input format) instead of a split.")
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
    from lmzoo import config as config_lib
    from lmzoo import evaluation, objectives
    from lmzoo.evaluation.generation import sample_text
    from lmzoo.train import loop, restore

    logging.set_verbosity(logging.WARNING)
    mesh_shape = tuple(int(x) for x in FLAGS.mesh_shape.strip("()").split(",")) if FLAGS.mesh_shape else None
    try:
        objective = objectives.get(config_lib.load_saved(FLAGS.workdir).objective.name)
        if FLAGS.reconstruct:
            evaluation.check_evaluator(objective, "reconstruction")
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    try:
        run = restore.open_run(FLAGS.workdir, mesh_shape=mesh_shape)
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}") from None
    names = ["loss"] + [n for n in objective.evaluators if n not in ("loss", "reconstruction")]
    split = FLAGS.split
    if FLAGS.data:
        if not pathlib.Path(FLAGS.data).exists():
            raise SystemExit(f"error: --data file {FLAGS.data!r} does not exist")
        split = "data"
        run.add_split(split, FLAGS.data)
    elif split not in ("train", "validation"):
        raise SystemExit(f"unknown split {split!r}; choose train or validation, or pass --data=FILE")
    try:
        step, state = restore.restore_step(run, FLAGS.step)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    result = {"step": step, "split": split, **({"data": FLAGS.data} if FLAGS.data else {})}
    examples = []
    for name in names:
        metrics, _ = evaluation.EVALUATORS[name](run, state, split, max_batches=FLAGS.max_batches)
        result.update(metrics)
    if FLAGS.reconstruct:
        scores, examples = evaluation.EVALUATORS["reconstruction"](run, state, split, num_examples=FLAGS.reconstruct,
                                                                    beam_size=FLAGS.beam_size)  # fmt: skip
        result.update(scores)
    line = json.dumps(result)
    print(line)
    name = f"data_{pathlib.Path(FLAGS.data).name}" if FLAGS.data else split
    suffix = "" if FLAGS.step is None else f"_step{step}"
    (pathlib.Path(FLAGS.workdir) / f"eval_{name}{suffix}.json").write_text(line + "\n")
    for i, example in enumerate(examples[: FLAGS.show]):
        print(f"--- example {i} ---")
        for key in ("corrupted", "reconstruction", "original"):
            print(f"[{key}]\n{example[key]}")
    if FLAGS.generate is not None:
        try:
            text = sample_text(
                run, loop.host_params(run, state), FLAGS.generate, max_new_tokens=FLAGS.max_new_tokens,
                temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.seed,
            )  # fmt: skip
        except ValueError as e:
            raise SystemExit(f"--generate: {e}") from None
        print(FLAGS.generate + text)
    run.checkpointer.close()


if __name__ == "__main__":
    app.run(main)
