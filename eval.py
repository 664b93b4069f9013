"""Evaluate a checkpoint: python eval.py --workdir=DIR [--split=validation | --data=FILE] [--step=N] [--generate="prompt" ...]

Restores the latest checkpoint (or the kept one of --step) of a train.py run from its workdir alone (its
saved config, tokenizer and checkpoints; the training data is not read unless --split asks for it), runs
every evaluator of its objective and prints one JSON line (also written to DIR/eval_<split>[_step<N>]
[_max<B>batches].json) and the same metrics as a table: loss, perplexity, bits per token, per character and
per UTF-8 byte; accuracy and F1 for classifiers; each with the number of batches and tokens or examples it
was computed over. --data scores a file the run never saw, in the objective's format (text for language models, a TSV
for classifiers, pairs for text_to_text); unk_fraction is the share of it outside the run's vocabulary (<unk> tokens,
or characters a character-level run never saw, which are left out; above 5 percent a note says its perplexity is not
comparable). --max_batches evaluates part of the split (its result goes to
its own file).

Denoising encoder-decoders (T5 span corruption, BART denoising): --reconstruct=N adds BLEU, ROUGE-1/2/L,
exact match and teacher-forced target token accuracy of the reconstructions of N examples to the line
(greedy decoding; beam search with --beam_size=K) and prints a few of them; see lmzoo/evaluation/reconstruction.py.

Other modes (each instead of scoring the split):
  --generate="prompt"   sample a continuation with the KV cache (--num_samples of them); the prompt reads the
                        escapes \\n (newline), \\t (tab) and \\\\ (a backslash), so --generate="ROMEO:\\n" ends
                        in a newline. --prompt_file=FILE instead takes the prompt from a UTF-8 file, as it is
                        (nanoGPT's --start=FILE:). Past the model's positions a decoder slides its window
                        (`lmzoo.decoding.generate`), and a note says so. --chat sends the prompt as the user's turn
                        through the run's chat template (config.objective.chat_template, else its checkpoint's) and
                        prints the assistant's reply, which ends at the template's end of turn or any of the
                        tokenizer's eos ids (a checkpoint's generation_config.json may list several).
  --fewshot=TASK.jsonl  in-context multiple choice for each k of --fewshot_k, demonstrations drawn from
                        --fewshot_train (lmzoo/evaluation/fewshot.py), next to a majority-class baseline;
                        --dump_prompts=FILE writes the prompts used. Result: DIR/eval_fewshot_<task>.json.
  --gsm8k=TEST.jsonl    a decoder's free-form answers to GSM8K-format rows {question, answer ending "#### N"}
                        (lmzoo/evaluation/gsm8k.py): greedy accuracy and pass@k for each k of --gsm8k_k (k > 1:
                        max(k) replies per problem sampled at --temperature > 0, the unbiased estimator), prompts
                        --gsm8k_template, --batch_size a generate call, replies up to --max_new_tokens, EOS or
                        "\\nQuestion:". Result: DIR/eval_gsm8k.json.
  --plot                PNG training curves from the run's TensorBoard event files (DIR/tb) into DIR/plots/:
                        one figure per metric group (loss, accuracy, schedule, throughput, ...), one panel
                        per metric with its train and validation series; expert_load (a mixture of
                        experts) one panel per layer, a line per expert (lmzoo/evaluation/plots.py).

Exit status: 0 done; 2 a user error (a bad flag, file or checkpoint: one line `error: ...`, refused before
anything is evaluated or written); 1 an unexpected failure.
"""

import codecs
import json
import pathlib
import re
import time

from absl import app, flags, logging

from lmzoo import storage

# --max_new_tokens above this is refused: past the model's positions every new token is a forward pass of its own
# (no KV cache), so a mistyped count would run for hours before printing anything.
MAX_NEW_TOKENS = 100_000

flags.DEFINE_string("workdir", None, "Workdir of a train.py run.", required=True)
flags.DEFINE_string("split", "validation", "Split to evaluate: train or validation.")
flags.DEFINE_string("data", None, "Evaluate this file (in the objective's input format) instead of a split.")
flags.DEFINE_integer("max_batches", None, "Evaluate at most this many batches (default: the whole split).")
flags.DEFINE_integer(
    "seq_len",
    None,
    "Score with this config.data.seq_len instead of the run's (e.g. an n-gram run's longest sentence of --data; "
    "at most config.model.max_len for neural models).",
)
flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the latest that restores).")
flags.DEFINE_string(
    "generate", None, "Prompt to continue; \\n, \\t and \\\\ in it are a newline, a tab and a backslash."
)
flags.DEFINE_string("prompt_file", None, "Continue the text of this UTF-8 file, as it is (instead of --generate).")
flags.DEFINE_bool(
    "chat",
    False,
    "--generate / --prompt_file: send the prompt as the user's turn through the run's chat template and print the "
    "assistant's reply, up to the end of its turn.",
)
flags.DEFINE_integer("max_new_tokens", 200, f"Tokens to sample (at most {MAX_NEW_TOKENS:,}).")
flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 = greedy. --gsm8k: that of the pass@k samples.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1 = off).")
flags.DEFINE_integer("seed", 0, "Sampling seed (sample i uses seed + i); --fewshot: demonstration seed.")
flags.DEFINE_integer("num_samples", 1, "--generate: how many continuations to sample.")
flags.DEFINE_integer("reconstruct", 0, "Denoising runs: score the reconstructions of this many examples (0 = off).")
flags.DEFINE_integer("beam_size", 1, "--reconstruct decoding: 1 = greedy, more = beam search with this many beams.")
flags.DEFINE_integer("show", 2, "--reconstruct: examples to print.")
flags.DEFINE_string("fewshot", None, "JSONL task {context, choices, gold} to evaluate in context.")
flags.DEFINE_string("fewshot_train", None, "JSONL split the demonstrations are drawn from (needed for k > 0).")
flags.DEFINE_list("fewshot_k", ["0"], "Numbers of demonstrations, e.g. 0,1,4,8.")
flags.DEFINE_string("fewshot_template", "{context}", "Prompt of one example; choices are appended to it.")
flags.DEFINE_string("fewshot_separator", "\n\n", "Text between demonstrations.")
flags.DEFINE_integer("fewshot_examples", None, "Evaluate the first N examples of the task (default: all).")
flags.DEFINE_integer("batch_size", 16, "--fewshot: scored continuations per batch; --gsm8k: prompts per generate call.")
flags.DEFINE_string("dump_prompts", None, "--fewshot: write the prompts used here (JSONL: k, index, prompt).")
flags.DEFINE_string(
    "gsm8k",
    None,
    "GSM8K-format JSONL {question, answer ending '#### N'} to answer and score, or a synthetic task "
    "('synthetic:addition?digits=2&n=500&seed=1', lmzoo/data/problems.py).",
)
flags.DEFINE_integer("gsm8k_examples", None, "--gsm8k: evaluate the first N rows (default: all).")
flags.DEFINE_string(
    "gsm8k_template", "Question: {question}\nAnswer:", "--gsm8k: prompt, formatted with a row's fields."
)
flags.DEFINE_list("gsm8k_k", ["1"], "--gsm8k: pass@k for these k (1 = greedy accuracy, always reported), e.g. 1,4,16.")
flags.DEFINE_bool("plot", False, "Write PNG training curves to DIR/plots/ and exit.")
flags.DEFINE_string(
    "mesh_shape",
    None,
    "(data,fsdp,tensor) mesh for evaluation, e.g. '-1,1,1'; default: the run's mesh if this machine has its "
    "devices and they divide the batches, else the most devices, data-parallel, that divide them.",
)
FLAGS = flags.FLAGS


def format_table(result: dict) -> str:
    """Two aligned columns, one row per metric (nested lists and dicts as JSON)."""
    rows = [
        (k, f"{v:.4f}" if isinstance(v, float) else json.dumps(v) if isinstance(v, list | dict) else str(v))
        for k, v in result.items()
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def fewshot_table(baseline: dict, results: list[dict]) -> str:
    lines = [f"{'k':>8}  {'examples':>8}  {'accuracy':>8}  {'95% CI':>15}  {'acc_norm':>8}  {'95% CI':>15}  truncated"]
    for r in [{"k": "majority", **baseline, "accuracy_norm": None}, *results]:
        norm = (
            ("-", "")
            if r["accuracy_norm"] is None
            else (f"{r['accuracy_norm']:.4f}", "{:.3f}-{:.3f}".format(*r["accuracy_norm_ci95"]))
        )
        lines.append(
            f"{r['k']!s:>8}  {r['examples']:>8}  {r['accuracy']:>8.4f}  {'{:.3f}-{:.3f}'.format(*r['accuracy_ci95']):>15}  "
            f"{norm[0]:>8}  {norm[1]:>15}  {r.get('truncated_prompts', '-')}"
        )
    return "\n".join(lines)


def run_fewshot(loaded) -> None:
    from lmzoo.evaluation import fewshot

    examples = fewshot.read_task(FLAGS.fewshot)[: FLAGS.fewshot_examples]
    train = fewshot.read_task(FLAGS.fewshot_train) if FLAGS.fewshot_train else []
    baseline = {"examples": len(examples), **fewshot.majority_baseline(train or examples, examples)}
    results, dumped = [], []
    for k in (int(k) for k in FLAGS.fewshot_k):
        try:
            result, prompts = fewshot.evaluate_fewshot(
                loaded.model,
                loaded.params,
                loaded.tokenizer,
                examples,
                train,
                k=k,
                template=FLAGS.fewshot_template,
                separator=FLAGS.fewshot_separator,
                seed=FLAGS.seed,
                batch_size=FLAGS.batch_size,
            )
        except ValueError as e:
            raise ValueError(f"--fewshot k={k}: {e}") from None
        results.append(result)
        dumped += [{"k": k, "index": i, "prompt": p} for i, p in enumerate(prompts)]
    line = json.dumps(
        {
            "step": loaded.step,
            "task": FLAGS.fewshot,
            "template": FLAGS.fewshot_template,
            "seed": FLAGS.seed,
            "majority": baseline,
            "fewshot": results,
        }
    )
    print(line)
    print(fewshot_table(baseline, results))
    storage.write_text(
        storage.path(FLAGS.workdir) / f"eval_fewshot_{pathlib.Path(FLAGS.fewshot).stem}.json", line + "\n"
    )
    if FLAGS.dump_prompts:
        storage.write_text(FLAGS.dump_prompts, "".join(json.dumps(d) + "\n" for d in dumped))


def gsm8k_k_values() -> list[int]:
    """--gsm8k_k as sorted distinct ints >= 1, 1 among them."""
    try:
        values = sorted({1, *(int(k) for k in FLAGS.gsm8k_k)})
    except ValueError:
        raise ValueError(f"--gsm8k_k={','.join(FLAGS.gsm8k_k)}: give whole numbers, e.g. 1,4,16") from None
    if values[0] < 1:
        raise ValueError(f"--gsm8k_k={','.join(FLAGS.gsm8k_k)}: each k must be >= 1 (pass@k of k replies)")
    return values


def run_gsm8k(mesh_shape) -> None:
    from lmzoo.data import problems
    from lmzoo.evaluation import gsm8k
    from lmzoo.train import run as run_lib

    k_values = gsm8k_k_values()
    rows = gsm8k.read_rows(FLAGS.gsm8k)[: FLAGS.gsm8k_examples]
    for index, row in enumerate(rows):  # a bad template is refused before the checkpoint is read
        problems.format_prompt(FLAGS.gsm8k_template, row, index)
    loaded = run_lib.load(FLAGS.workdir, FLAGS.step, mesh_shape=mesh_shape)
    start = time.perf_counter()
    result = gsm8k.evaluate(
        loaded.model,
        loaded.params,
        loaded.tokenizer,
        rows,
        template=FLAGS.gsm8k_template,
        k_values=k_values,
        max_new_tokens=FLAGS.max_new_tokens,
        temperature=FLAGS.temperature,
        top_k=FLAGS.top_k,
        top_p=FLAGS.top_p,
        batch_size=FLAGS.batch_size,
        seed=FLAGS.seed,
    )
    seconds = time.perf_counter() - start
    sampled = k_values[-1] > 1
    line = json.dumps(
        {
            "step": loaded.step,
            "data": FLAGS.gsm8k,
            "template": FLAGS.gsm8k_template,
            "max_new_tokens": FLAGS.max_new_tokens,
            **({"temperature": FLAGS.temperature, "top_k": FLAGS.top_k, "top_p": FLAGS.top_p} if sampled else {}),
            "seed": FLAGS.seed,
            "seconds": round(seconds, 2),
            **result,
        }
    )
    print(line)
    columns = ["accuracy", *(f"pass@{k}" for k in k_values if k > 1)]
    cells = [f"{result[c]:.4f}" for c in columns] + [str(result["examples"]), f"{seconds:.1f}"]
    names = [*columns, "examples", "seconds"]
    widths = [max(len(n), len(c)) for n, c in zip(names, cells, strict=True)]
    print("  ".join(f"{n:>{w}}" for n, w in zip(names, widths, strict=True)))
    print("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    storage.write_text(storage.path(FLAGS.workdir) / "eval_gsm8k.json", line + "\n")


def check_text_file(path: str, flag: str) -> None:
    """Raises unless `path` (local or in a bucket) is a non-empty UTF-8 text file (no NUL bytes), naming the flag that
    gave it."""
    try:
        with storage.open_read(path) as file:
            size = _check_utf8(file, path, flag)
    except IsADirectoryError:
        raise FileNotFoundError(f"{flag}={path}: is a directory") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag}={path}: no such file") from None
    if size == 0:
        raise ValueError(f"{flag}={path}: the file is empty")


def _check_utf8(file, path: str, flag: str) -> int:
    """The size of an open binary `file`; ValueError at its first byte that is NUL or not UTF-8."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    while chunk := file.read(1 << 20):
        bad = chunk.find(b"\0")  # NUL is valid UTF-8 but marks a binary file
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError as e:
            bad = e.start if bad < 0 else min(bad, e.start)
        if bad >= 0:
            raise ValueError(f"{flag}={path}: not UTF-8 text (byte {offset + bad}); pass a text file, not a binary one")
        offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ValueError(f"{flag}={path}: not UTF-8 text (it ends inside a character)") from None
    return offset


PROMPT_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def read_escapes(text: str) -> str:
    """`text` with the escapes \\n, \\t and \\\\ replaced by a newline, a tab and a backslash (a shell passes them
    to --generate as two characters); any other backslash is kept."""
    return re.sub(r"\\([nt\\])", lambda m: PROMPT_ESCAPES[m.group(1)], text)


def generation_prompt() -> str | None:
    """The prompt to continue: --prompt_file's text, or --generate's with its escapes read; None when neither."""
    if FLAGS.prompt_file is not None:
        if FLAGS.generate is not None:
            raise ValueError("--generate and --prompt_file both give the prompt; pass one of them")
        check_text_file(FLAGS.prompt_file, "--prompt_file")
        return storage.read_text(FLAGS.prompt_file)
    return None if FLAGS.generate is None else read_escapes(FLAGS.generate)


def check_flags() -> None:
    """Flag values eval.py refuses before restoring anything."""
    from lmzoo import decoding
    from lmzoo.data import problems

    if FLAGS.seq_len is not None and FLAGS.seq_len < 1:
        raise ValueError(f"--seq_len={FLAGS.seq_len}: must be >= 1 (omit it to use the run's config.data.seq_len)")
    if FLAGS.max_batches is not None and FLAGS.max_batches < 1:
        raise ValueError(f"--max_batches={FLAGS.max_batches}: must be >= 1 (omit it to evaluate the whole split)")
    if FLAGS.chat and FLAGS.generate is None and FLAGS.prompt_file is None:
        raise ValueError("--chat sends --generate's (or --prompt_file's) prompt as the user's turn: pass one of them")
    if FLAGS.generate is not None or FLAGS.prompt_file is not None:
        if not 1 <= FLAGS.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(
                f"--max_new_tokens={FLAGS.max_new_tokens}: ask for 1 to {MAX_NEW_TOKENS:,} new tokens (eval.py's bound, "
                "so that a mistyped count does not sample for hours)"
            )
        if FLAGS.num_samples < 1:
            raise ValueError(f"--num_samples={FLAGS.num_samples}: ask for at least one sample")
        try:
            decoding.check_sampling(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p)
        except ValueError as e:
            raise ValueError(f"--{e}") from None
    if FLAGS.data:
        check_text_file(FLAGS.data, "--data")
    elif FLAGS.split not in ("train", "validation"):
        raise ValueError(f"--split={FLAGS.split}: choose train or validation, or pass --data=FILE")
    if FLAGS.fewshot:
        if any(int(k) > 0 for k in FLAGS.fewshot_k) and not FLAGS.fewshot_train:
            raise ValueError("--fewshot_k asks for demonstrations; pass --fewshot_train=TRAIN.jsonl to draw them from")
        check_text_file(FLAGS.fewshot, "--fewshot")
        if FLAGS.fewshot_train:
            check_text_file(FLAGS.fewshot_train, "--fewshot_train")
    if FLAGS.gsm8k:
        if FLAGS.fewshot:
            raise ValueError("--fewshot and --gsm8k are two evaluations; pass one of them")
        k_values = gsm8k_k_values()
        if k_values[-1] > 1 and not FLAGS.temperature > 0:
            raise ValueError(
                f"--gsm8k_k={','.join(FLAGS.gsm8k_k)} samples {k_values[-1]} replies per problem: pass --temperature > 0 "
                f"(not {FLAGS.temperature}); k=1 is greedy whatever the temperature"
            )
        if not 1 <= FLAGS.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"--max_new_tokens={FLAGS.max_new_tokens}: ask for 1 to {MAX_NEW_TOKENS:,} new tokens")
        if FLAGS.batch_size < 1 or (FLAGS.gsm8k_examples is not None and FLAGS.gsm8k_examples < 1):
            raise ValueError(
                f"--batch_size={FLAGS.batch_size} and --gsm8k_examples={FLAGS.gsm8k_examples} must be >= 1"
            )
        try:
            decoding.check_sampling(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p)
        except ValueError as e:
            raise ValueError(f"--{e}") from None
        if not FLAGS.gsm8k.startswith(problems.SYNTHETIC):  # generated in memory: nothing to check on disk
            check_text_file(FLAGS.gsm8k, "--gsm8k")
    if FLAGS.reconstruct < 0 or FLAGS.beam_size < 1:
        raise ValueError(f"--reconstruct={FLAGS.reconstruct} must be >= 0 and --beam_size={FLAGS.beam_size} >= 1")
    workdir = storage.path(FLAGS.workdir)
    if storage.read_only(workdir):
        raise PermissionError(
            f"--workdir={workdir} is read-only and eval.py writes its result there (eval_*.json); "
            "make it writable or evaluate a copy"
        )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from lmzoo.kernels import host_memory
    from lmzoo.train import compilation_cache
    from lmzoo.train import run as run_lib

    logging.set_verbosity(logging.WARNING)
    host_memory.one_heap_per_core()  # what each compile frees, the next reuses
    compilation_cache.enable()  # programs train.py (or an earlier eval.py) compiled are read, not compiled again
    with run_lib.user_errors():
        evaluate()


def evaluate() -> None:
    from lmzoo import evaluation, objectives
    from lmzoo.data import chat
    from lmzoo.evaluation.generation import sample_text
    from lmzoo.train import run as run_lib

    if FLAGS.plot:  # the event files and the figures are read and written through lmzoo.storage: any workdir
        from lmzoo.evaluation import plots

        print("\n".join(str(p) for p in plots.plot_metrics(FLAGS.workdir)))
        return
    check_flags()
    prompt = generation_prompt()
    mesh_shape = tuple(int(x) for x in FLAGS.mesh_shape.strip("()").split(",")) if FLAGS.mesh_shape else None
    objective = objectives.get(run_lib.load_saved(FLAGS.workdir).objective.name)
    evaluation.check_scorable(objective)
    if FLAGS.reconstruct:
        evaluation.check_evaluator(objective, "reconstruction")
    if FLAGS.gsm8k:
        return run_gsm8k(mesh_shape)
    if FLAGS.fewshot:
        return run_fewshot(run_lib.load(FLAGS.workdir, FLAGS.step, mesh_shape=mesh_shape))
    run = run_lib.open_run(FLAGS.workdir, mesh_shape=mesh_shape, seq_len=FLAGS.seq_len)
    split = FLAGS.split
    if FLAGS.data:
        split = "data"
        run.add_split(split, FLAGS.data)
    elif prompt is None:
        try:
            run.raw(split)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"the run's {split} data cannot be read ({e}); score a file with --data=FILE instead"
            ) from None
    if prompt is not None and FLAGS.top_k > run.tokenizer.vocab_size:
        raise ValueError(
            f"--top_k={FLAGS.top_k}: the run's vocabulary has {run.tokenizer.vocab_size} tokens; pass at most "
            f"{run.tokenizer.vocab_size} (0 keeps every token)"
        )
    stops, shown = (), prompt
    if prompt is not None and FLAGS.chat:  # the template is read before the checkpoint
        prompt, end_of_turn = chat.user_turn(chat.run_template(run.config, run.tokenizer), prompt)
        stops, shown = tuple(s for s in (end_of_turn,) if s), ""
    # sampling needs only the params, unless they are LoRA adapters: the model is them merged into the frozen base
    step, state = run_lib.restore_step(run, FLAGS.step, frozen=prompt is None or bool(run.config.lora.targets))
    if prompt is not None:
        params = run.compiled.host_params(state)
        for index in range(FLAGS.num_samples):
            text = sample_text(
                run,
                params,
                prompt,
                max_new_tokens=FLAGS.max_new_tokens,
                temperature=FLAGS.temperature,
                top_k=FLAGS.top_k,
                top_p=FLAGS.top_p,
                seed=FLAGS.seed + index,
                note_window=index == 0,
                stop_ids=run.tokenizer.eos_ids if FLAGS.chat else (),
                stops=stops,
            )
            if FLAGS.num_samples > 1:
                print(f"--- sample {index + 1} (seed {FLAGS.seed + index}) ---")
            print(shown + text)
        run.close()
        return
    result = {"step": step, "split": split, **({"data": FLAGS.data} if FLAGS.data else {})}
    if FLAGS.max_batches is not None:
        result["max_batches"] = FLAGS.max_batches
    examples = []
    for name in [n for n in objective.evaluators if n != "reconstruction"]:
        try:
            metrics, _ = evaluation.EVALUATORS[name](run, state, split, max_batches=FLAGS.max_batches)
        except ValueError as e:
            if "config.data.seq_len" not in str(e):
                raise
            raise ValueError(f"{e} (eval.py sets it with --seq_len=N)") from None  # eval.py has no --config flags
        result.update(metrics)
    if FLAGS.reconstruct:
        scores, examples = evaluation.EVALUATORS["reconstruction"](
            run, state, split, num_examples=FLAGS.reconstruct, beam_size=FLAGS.beam_size
        )
        result.update(scores)
    if FLAGS.data:
        with storage.open_read(FLAGS.data, text=True) as text:
            result["unk_fraction"] = run.tokenizer.unknown_fraction(text.read())
    line = json.dumps(result)
    print(line)
    print(format_table(result))
    if result.get("unk_fraction", 0) > 0.05:
        print(
            f"note: {result['unk_fraction']:.1%} of --data is outside the run's vocabulary (<unk> tokens, or characters "
            "a character vocabulary lacks, left out); "
            "its loss and perplexity are not comparable with those of text the vocabulary covers"
        )
    name = f"data_{pathlib.Path(FLAGS.data).name}" if FLAGS.data else split
    suffix = ("" if FLAGS.step is None else f"_step{step}") + (
        "" if FLAGS.max_batches is None else f"_max{FLAGS.max_batches}batches"
    )
    storage.write_text(storage.path(FLAGS.workdir) / f"eval_{name}{suffix}.json", line + "\n")
    for i, example in enumerate(examples[: FLAGS.show]):
        print(f"--- example {i} ---")
        for key in ("corrupted", "reconstruction", "original"):
            print(f"[{key}]\n{example[key]}")
    run.close()


if __name__ == "__main__":
    from lmzoo.train.run import parse_flags

    app.run(main, flags_parser=parse_flags)
