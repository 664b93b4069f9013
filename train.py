"""Train a model: python train.py [--config=configs/NAME.py[:arg]] [--workdir=DIR] [--config.a.b=value ...]

The workdir defaults to runs/NAME[_ARG] (runs/default for the default config). Restarting with the same workdir
resumes from its latest checkpoint. `python train.py --objectives` lists
every objective (config.objective.name) with its fields and defaults. A config path that does not exist
where train.py runs is looked up in the repository (so `configs/NAME.py` works from any folder). With
`--config.init_from=hf:CHECKPOINT`, config.model takes the checkpoint's config.json as transformers' `from_pretrained`
does: the config file's model fields are defaults it replaces (one line says which), and only a `--config.model.*`
override that contradicts it is an error. A model whose state (params, optimizer state, frozen models) would not fit
the memory it lives in is refused before it is built. `--dry_run` parses the flags and checks what a run checks before
its first step (`dry_run`: the config, the layout on the mesh of the devices the run will have, the memory estimate,
the tokenizer, the data's files), then exits with the run's own refusal or 0: no training data is read, no weights,
and the workdir is not touched.

Exit status: 0 trained to config.train.steps; 2 a user error (a bad flag, config value, file or checkpoint, a
full disk: one line `error: ...`, refused before work that would be lost); 1 an unexpected failure; 75
preempted (SIGTERM) after saving a checkpoint; 130 stopped by Ctrl-C after saving a checkpoint; 143 SIGTERM
while starting, the workdir left as it was. Rerun the same command to resume after 75 or 130.
"""

import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

REPO = pathlib.Path(__file__).resolve().parent


def define_flags(flag_values: flags.FlagValues = flags.FLAGS, argv: list[str] | None = None) -> None:
    """--config, --workdir and --dry_run, on `flag_values` for the command line `argv` (default sys.argv).
    config_flags applies --config.* overrides when the flag is defined, so this runs after check_overrides has
    turned a misspelled key into a one-line error."""
    config_flags.DEFINE_config_file(
        "config",
        str(REPO / "configs" / "default.py"),
        "Experiment config file (configs/*.py).",
        flag_values=flag_values,
        lock_config=True,
        sys_argv=argv,
    )
    flags.DEFINE_string(
        "workdir",
        None,
        "Directory for checkpoints, logs and samples (default runs/CONFIG[_VARIANT], e.g. runs/shakespeare_char_tiny).",
        flag_values=flag_values,
    )
    flags.DEFINE_bool(
        "dry_run",
        False,
        "Parse the flags, check the config as a run does before touching the workdir, and exit (0 if it passes).",
        flag_values=flag_values,
    )


def command_line_overrides(flag_values: flags.FlagValues = flags.FLAGS) -> set[str]:
    """The config keys given on the command line (`--config.model.num_layers=2` gives "model.num_layers")."""
    return set(config_flags.get_override_values(flag_values["config"]))


def take_pretrained_fields(config, command_line: set[str], *, missing_ok: bool = False) -> str:
    """config.model takes an `init_from=hf:` checkpoint's config.json (`config.take_pretrained_fields`: a config file
    sets defaults, a contradicting command-line override is an error). missing_ok (the dry run): a checkpoint not on
    this machine is a note in the returned text instead of an error."""
    from lmzoo import config as config_lib

    try:
        config_lib.take_pretrained_fields(config, command_line)
    except FileNotFoundError as e:
        if not missing_ok:
            raise
        return f"; config.model is the config file's, not the checkpoint's: {e}"
    return ""


def dry_run(config, workdir: str, command_line: set[str] = frozenset()) -> str:
    """What a run checks before its first step (the checkpoint's fields for `init_from=hf:`, the config and the
    objective's checks, then `run.dry_check`: the layout on the mesh, the state's memory, the tokenizer, the data
    reached), without its devices, training data or workdir; raises as the run would. Returns a one-line summary."""
    from lmzoo.train import run as run_lib

    note = take_pretrained_fields(config, command_line, missing_ok=True)
    objective = run_lib.validated_objective(config)
    checked = run_lib.dry_check(objective, pretrained_here=not note)
    return (
        f"dry run: config ok (model {config.model_name}, objective {objective.name}, {config.train.steps} steps, "
        f"workdir {workdir}{note}); {checked}; no training data was read and the workdir was not touched"
    )


def default_workdir(argv: list[str]) -> str:
    """runs/<config file name>[_<variant words>]: each config and variant trains in a home of its own (as nanoGPT's
    out_dir or MaxText's run_name), so a second config never resumes into the first one's checkpoints."""
    spec = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")), "configs/default.py")
    path, _, variant = spec.partition(":")
    words = [w for w in variant.split(",") if w]
    return str(pathlib.Path("runs") / "_".join([pathlib.Path(path).stem, *words]))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from lmzoo import sharding
    from lmzoo.kernels import host_memory
    from lmzoo.train import compilation_cache, loop
    from lmzoo.train import run as run_lib

    logging.set_verbosity(logging.WARNING)
    config = flags.FLAGS.config  # validated once, by the run it builds (or the dry run), before any work
    if config.distributed.cpu_devices_per_process:  # before the backend starts: the run's and its dry run's devices
        import jax

        jax.config.update("jax_num_cpu_devices", config.distributed.cpu_devices_per_process)
    if flags.FLAGS.dry_run:
        with run_lib.user_errors():
            workdir = flags.FLAGS.workdir or default_workdir(sys.argv)
            print(dry_run(config, workdir, command_line_overrides()))
        return
    host_memory.set_up_process()  # before JAX's CPU client and its threads exist: buffers kept, one heap a core
    compilation_cache.enable()  # programs an earlier run compiled are read, not compiled again
    try:
        with run_lib.user_errors():
            sharding.initialize_distributed(
                **{k: config.distributed[k] for k in ("coordinator_address", "num_processes", "process_id")}
            )
            take_pretrained_fields(config, command_line_overrides())
            workdir = flags.FLAGS.workdir or default_workdir(sys.argv)
            final = loop.train_and_evaluate(config, workdir, command_line_overrides())
    except loop.TrainingStopped as stopped:
        print(stopped, file=sys.stderr)
        sys.exit(stopped.exit_code)
    batches = int(final.pop("evaluated_batches", 0))
    scored = {k: v for k, v in final.items() if k not in ("tokens", "examples")}
    amount = f"{int(final['tokens']):,} tokens" if "tokens" in final else f"{int(final.get('examples', 0)):,} examples"
    limit = config.eval.max_batches
    scope = (
        f"the first {batches} batches (config.eval.max_batches={limit})"
        if limit and batches >= limit
        else f"the whole split, {batches} batches"
    )
    print(f"final validation over {scope}, {amount}: " + ", ".join(f"{k} {v:.4f}" for k, v in scored.items()))


if __name__ == "__main__":
    if "--objectives" in sys.argv[1:]:
        from lmzoo import objectives

        print(objectives.describe())
        sys.exit(0)

    from lmzoo.config import check_overrides, resolve_config_path
    from lmzoo.train.run import parse_flags, user_errors

    sys.argv = [sys.argv[0], *resolve_config_path(sys.argv[1:])]
    with user_errors():
        check_overrides(sys.argv[1:], default=str(REPO / "configs" / "default.py"))
    define_flags()
    try:
        app.run(main, flags_parser=parse_flags)
    except SystemExit as exiting:
        if "lmzoo.checkpoint" in sys.modules:  # only a run that saved can have abandoned a save
            sys.modules["lmzoo.checkpoint"].exit_past_abandoned_saves(exiting.code)
        raise
