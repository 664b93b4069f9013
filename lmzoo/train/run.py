"""The run layer: a `Run` built from a config and a workdir, shared by the loop, `eval.py`, evaluators' callers
and `lmzoo.load`.

`build` makes a `Run`: the validated config, the objective (`lmzoo.objectives`), tokenizer, model, trainer
compiled over the mesh, and a checkpointer. It reads no data unless the tokenizer must be trained on it;
loaders are built on first use, so restoring and scoring a checkpoint needs only its workdir.
`restore_or_init` gives the latest good checkpoint (frozen parameters read again from the paths the config
names, never from the checkpoint) or a fresh state; `restore_step` a kept checkpoint to evaluate, its frozen
parameters read again the same way; `load(workdir)` gives a trained run's model and params.
"""

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from etils import epath

from lmzoo import checkpoint, lora, models, objectives, sharding, storage, tokenizers, weights
from lmzoo import config as config_lib
from lmzoo import workdir as workdir_lib
from lmzoo.data import loaders
from lmzoo.objectives import base
from lmzoo.trainers import base as trainers_base

# What train.py, eval.py and the exporter report as one line: bad flags, config values, files and checkpoints,
# a locked workdir, a full disk, a diverged loss. Each is raised before work that would be lost.
USER_ERRORS = (ValueError, OSError, workdir_lib.WorkdirLockedError, FloatingPointError)


@contextlib.contextmanager
def user_errors():
    """The entry points' one way to fail on a user error (USER_ERRORS): `error: <message>` on stderr, exit
    status 2, no traceback."""
    try:
        yield
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing for the entry points (`app.run(main, flags_parser=parse_flags)`): a flag absl cannot
    parse (`--config.train.steps=abc`, an unknown flag) is a user error, one line and exit status 2 as `user_errors`
    makes them, where absl's own is a "FATAL Flags parsing error" and status 1; `--help` prints the usage and exits 0
    (absl's exits 1). Returns the arguments left."""
    from absl import app, flags

    if "--help" in argv[1:]:
        app.usage(shorthelp=True, writeto_stdout=True, exitcode=0)
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        text = str(e).removeprefix("flag ")
        # a value absl could not parse (not a required flag left out: "must have a value other than None")
        mistyped = isinstance(e, flags.IllegalFlagValueError) and "other than None" not in text
        fix = "; give that flag a value of its type" if mistyped else ""
        print(f"error: {text}{fix} (--helpfull lists every flag)", file=sys.stderr)
        raise SystemExit(2) from None


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config checked and locked (see `validated_objective`)."""
    return validated_objective(config).config


def validated_objective(config: ml_collections.ConfigDict) -> base.Objective:
    """The run's objective, built once from `config` after checking the model section against its dataclass
    and the objective section against its objective's fields (each validating its own values), then the
    objective's checks across sections; its config is locked. An objective chosen on the command line gets
    its own defaults for fields not given."""
    objective = objectives.get(config.objective.name)
    given = {k: v for k, v in config.objective.items() if k != "name"}
    known = objectives.defaults(objective.name)
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(
            f"config.objective has field(s) {unknown} that objective {objective.name!r} does not have; "
            f"its fields: {sorted(known)}"
        )
    with config.unlocked():
        config.objective = objectives.objective_section(objective.name, **given)
    models.make_config(config.model_name, config.model.to_dict())
    built = objective(config)
    built.check()
    evaluators = tuple(config.eval.evaluators)
    if not evaluators or evaluators[0] != "loss" or "reconstruction" in evaluators:
        raise ValueError(
            f"config.eval.evaluators={evaluators} must start with 'loss' and may add {list(objective.evaluators[1:])} "
            "(reconstruction runs from eval.py --reconstruct)"
        )
    for name in evaluators:
        if name not in objective.evaluators:
            raise ValueError(
                f"config.eval.evaluators has {name!r}, which does not apply to objective {objective.name!r}; "
                f"its evaluators: {list(objective.evaluators)}"
            )
    config.lock()
    return built


def load_saved(workdir: str) -> ml_collections.ConfigDict:
    """The config a run saved in `<workdir>/config.json`, over today's defaults (so runs saved before
    a field existed still load; of an older flat objective section, only its objective's fields are kept)."""
    path = storage.path(workdir) / "config.json"
    if not storage.exists(path):
        raise FileNotFoundError(f"{path} not found: is {workdir!r} the workdir of a train.py run?")
    saved = config_lib.read_saved(path)
    objective = saved.pop("objective", {"name": "causal_lm"})
    known = objectives.defaults(objective["name"])
    config = config_lib.base_config()
    config.update(saved)
    config.objective = objectives.objective_section(
        objective["name"], **{k: v for k, v in objective.items() if k in known}
    )
    return config


@dataclasses.dataclass
class Run:
    """What training and evaluation build from a config and a workdir. Data is read on first use."""

    config: ml_collections.ConfigDict
    workdir: epath.Path  # absolute, or a bucket path (lmzoo.storage)
    objective: base.Objective
    tokenizer: tokenizers.Tokenizer
    model: nn.Module
    compiled: trainers_base.CompiledTrainer
    checkpointer: checkpoint.Checkpointer
    splits: dict[str, Any] = dataclasses.field(default_factory=dict)  # raw examples by split name

    @property
    def abstract_state(self) -> Any:
        """Restore target of a checkpoint: the state without its frozen parameters."""
        return self.compiled.abstract_state.replace(frozen={})

    @property
    def shard(self) -> loaders.Shard:
        return loaders.Shard(jax.process_index(), jax.process_count())

    def context(self):
        """Mesh and rules context under which every jitted function of the run is traced and called."""
        return self.compiled.context()

    def raw(self, split: str) -> Any:
        """The raw examples of `split` ("train", "validation", or a name given to `add_split`)."""
        if split not in self.splits:
            if split not in ("train", "validation"):
                raise ValueError(
                    f"unknown split {split!r}; choose one of {sorted({'train', 'validation', *self.splits})}"
                )
            self.splits.update(self.objective.read())
        return self.splits[split]

    def add_split(self, name: str, path: str) -> None:
        """Makes the examples of a file (in the objective's format) evaluable as split `name`."""
        self.splits[name] = self.objective.read_file(path)

    def train_loader(self):
        return self.objective.train_loader(self.tokenizer, self.raw("train"), self.shard)

    def close(self) -> None:
        """Waits for the checkpoints being written and releases what the objective holds (PPO's reward workers)."""
        self.checkpointer.close()
        self.objective.close()

    def eval_batches(self, split: str):
        return self.objective.eval_batches(self.tokenizer, self.raw(split), self.shard)


def has_checkpoints(workdir: epath.Path) -> bool:
    """Whether `workdir` holds a saved step: a step folder (local: a finished one, orbax renames it into place; bucket:
    possibly one whose save was cut short, as orbax writes it in place and commits it by a marker file last)."""
    try:
        return any(name.isdigit() for name in storage.list_dir(workdir / "checkpoints"))
    except FileNotFoundError:
        return False


def _tokenizer(
    config: ml_collections.ConfigDict,
    run_splits: dict,
    objective: base.Objective,
    workdir: epath.Path,
    stage: workdir_lib.StagedRunState | None,
) -> tokenizers.Tokenizer:
    """The run's tokenizer: the workdir's when it has checkpoints (so a resumed run keeps its ids); else
    built (from the run's data for kinds learnt from a corpus; a token store's own for source "store") and, when
    `stage` is given, staged there.
    A tokenizer left by a run that never saved a checkpoint is rebuilt, never reused."""
    saved = workdir / "tokenizer" / "spec.json"
    if storage.exists(saved) and has_checkpoints(workdir):
        with storage.local_copy(saved.parent) as folder:  # tokenizer libraries read local files
            return tokenizers.from_spec(json.loads(storage.read_text(saved)), folder)

    def corpus() -> list[str]:
        run_splits.update(objective.read())
        return objective.corpus(run_splits["train"]) + objective.corpus(run_splits["validation"])

    tokenizer = base.configured_tokenizer(config, corpus)
    if stage is not None:
        stage.write_folder(
            "tokenizer", lambda folder: storage.write_text(f"{folder}/spec.json", json.dumps(tokenizer.save(folder)))
        )
    return tokenizer


def _size(count: float) -> str:
    """A byte count for a person: 1.23 GB, 45.6 MB, 789 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count / 1e3:.0f} kB"


# What the refusal of a state too large for its memory suggests, after the numbers.
_SHARD_IT = (
    "shard it: FSDP over more devices (--config.sharding.mesh_shape='(1,-1,1)'; over several hosts with "
    "--config.distributed.*, docs/SCALING.md), or hold the weights in bfloat16 (--config.model.param_dtype=bfloat16), or "
    "train LoRA adapters over a frozen base (--config.lora.targets='query|key|value|out')"
)


def state_memory(compiled: trainers_base.CompiledTrainer) -> dict[str, Any]:
    """What the run's state will take, from the shapes, dtypes and shardings of its abstract state (nothing is
    allocated): {"params", "optimizer state", "frozen": bytes on this process's devices, "host": their sum,
    "per_device": the most one device holds, "parameters": the models' parameter count (trained and frozen),
    "platform", "devices": this process's devices}. Activations and gradients come on top (a lower bound)."""
    state = compiled.abstract_state
    devices = compiled.mesh.local_devices

    def held(tree) -> tuple[int, int]:  # (bytes on this process's devices, bytes on each device)
        on_host = on_each = 0
        for leaf in jax.tree.leaves(tree):
            shard = int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * getattr(leaf.dtype, "itemsize", 8)
            on_host, on_each = on_host + shard * len(leaf.sharding.addressable_devices), on_each + shard
        return on_host, on_each

    (params, _), (frozen, _), (host, per_device) = held(state.params), held(state.frozen), held(state)
    parameters = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves((state.params, state.frozen)))
    return {
        "params": params,
        "optimizer state": host - params - frozen,  # with the step, rng and any carried state (a few bytes)
        "frozen": frozen,
        "host": host,
        "per_device": per_device,
        "parameters": parameters,
        "platform": devices[0].platform,
        "devices": len(devices),
    }


def check_memory(compiled: trainers_base.CompiledTrainer, config: ml_collections.ConfigDict) -> str:
    """Refuses a run whose state (params, optimizer state, frozen models: `state_memory`) is larger than the memory it
    would live in, before any of it is allocated: on CPU devices this host's available memory
    (`config.available_memory`, /proc/meminfo's MemAvailable), on accelerators each device's (its memory_stats
    bytes_limit, where the platform reports one). ValueError, one line with the numbers and how to shard it. Returns
    the estimate as one line."""
    memory = state_memory(compiled)
    cpu = memory["platform"] == "cpu"
    need = memory["host"] if cpu else memory["per_device"]
    if cpu:
        have, where = config_lib.available_memory(), "host memory"
    else:
        stats = getattr(compiled.mesh.local_devices[0], "memory_stats", lambda: None)() or {}
        have, where = stats.get("bytes_limit"), f"memory on each {memory['platform']} device"
    parts = ", ".join(f"{part} {_size(memory[part])}" for part in ("params", "optimizer state", "frozen"))
    line = (
        f"the {config.model_name} model's state needs about {_size(need)} of {where} "
        f"({memory['parameters']:,} parameters; {parts} on {memory['devices']} {memory['platform']} device"
        f"{'s' if memory['devices'] > 1 else ''})"
    )
    if have is not None and need > have:
        source = "/proc/meminfo MemAvailable" if cpu else "the device's bytes_limit"
        raise ValueError(f"{line}, more than the {_size(have)} available ({source}), so it is not built; {_SHARD_IT}")
    return line + ("" if have is None else f", of {_size(have)} available")


def data_parallel_size(sizes: Sequence[int]) -> int:
    """Devices a batch is split over: the data x fsdp x expert sizes of a (data, fsdp, expert, tensor) mesh (the
    "act_batch" rule of `sharding.LOGICAL_AXIS_RULES`)."""
    return sizes[0] * sizes[1] * sizes[2]


def check_layout(
    objective: base.Objective, trainer: Any | None, sizes: Sequence[int], rules: tuple, *, batches: bool
) -> Any:
    """Every check a run makes of its layout before anything is placed, from the mesh's sizes (data, fsdp, expert,
    tensor) alone, so that a dry run makes them for devices this machine need not have: the config's values with the
    batch sizes over the data-parallel axes (`config.check_values`; the mesh it suggests instead is one the
    parameters divide), the model traced on the mesh (its own checks: an expert axis that does not divide the
    experts), every parameter axis over the mesh axes it is split over (`sharding.split_problems`), and a trainer
    that runs in phases taking one step a call. trainer None (a dry run whose model is not known yet): the values
    alone; rules: the run's logical-axis rules (`sharding.axis_rules(config.sharding.rules)`). ValueError naming the
    fix. Returns the state traced on the mesh (`trainers.base.traced_state`; None without a trainer), which
    `trainers.base.compile_trainer` takes instead of tracing the model again."""
    config, dp = objective.config, data_parallel_size(sizes)
    seed = config.train.seed
    # the same shapes and axes on any mesh
    unplaced = functools.cache(lambda: trainers_base.traced_state(trainer, rules=rules, seed=seed))

    def mesh_fits(shape: tuple[int, ...]) -> bool:
        return not sharding.split_problems(unplaced(), rules, sharding.mesh_shape(shape))

    more = objective.value_problems(data_parallel_size=dp, batches=batches)
    config_lib.check_values(
        config,
        data_parallel_size=dp,
        devices=math.prod(sizes),
        batches=batches,
        more_problems=tuple(more),
        mesh_fits=None if trainer is None else mesh_fits,
    )
    if trainer is None:
        return None
    traced = trainers_base.traced_state(trainer, rules=rules, seed=seed, sizes=sizes)
    problems = sharding.split_problems(traced, rules, sizes)
    if problems:
        mesh = config_lib.working_mesh(config, math.prod(sizes), mesh_fits) if batches else None
        replicated = tuple((name, None) for name in problems)
        raise ValueError(
            f"config.sharding.mesh_shape={tuple(config.sharding.mesh_shape)} splits parameter axes over mesh axes that "
            f"do not divide them: {'; '.join(problems.values())}; "
            + (f"use {config_lib.mesh_flag(mesh)} (the same devices; the batches split), or " if mesh else "")
            + f'replicate those axes with --config.sharding.rules="{replicated}"'
        )
    if getattr(trainer, "phases", ()) and config.train.steps_per_call > 1:
        raise ValueError(
            f"config.train.steps_per_call={config.train.steps_per_call}: objective {objective.name!r} runs its step "
            "in phases (rollout, scoring, update), one step per call; set --config.train.steps_per_call=1"
        )
    return traced


def dry_check(objective: base.Objective, *, pretrained_here: bool = True) -> str:
    """What a run of `objective` checks before its first step, made without its devices, reading no training data
    and not touching the workdir (`train.py --dry_run`): `check_layout` on the mesh's sizes over the devices the run
    will have (`dry_mesh_sizes`), `check_memory` where this machine has that mesh, then `check_inputs`.
    pretrained_here=False: config.init_from is not on this machine, so config.model is not yet the checkpoint's and
    only the values and the data are checked. Returns what was checked, and what was not, as one line; raises as the
    run would."""
    config = objective.config
    sizes, devices = dry_mesh_sizes(config)
    trainer = objective.trainer(objective.model()) if pretrained_here else None
    rules = sharding.axis_rules(config.sharding.rules)
    check_layout(objective, trainer, sizes, rules, batches=True)
    if trainer is None:
        said = "layout, memory and tokenizer not checked (config.model is the checkpoint's only once it is read)"
        return f"{said}; {check_inputs(objective, tokenizer=False)}"
    said = f"mesh {sizes} (data, fsdp, expert, tensor) over {devices}"
    if len(jax.devices()) != math.prod(sizes):
        said += f"; memory not estimated (this machine has {len(jax.devices())} devices)"
    else:
        compiled = trainers_base.compile_trainer(trainer, mesh=run_mesh(config), rules=rules, seed=config.train.seed)
        said += f"; {check_memory(compiled, config)}"
    return f"{said}; {check_inputs(objective)}"


def check_inputs(objective: base.Objective, *, tokenizer: bool = True) -> str:
    """That the run's inputs are there, reading no training data: its tokenizer built as a new run builds it (unless
    it is learnt from the data), against the model's vocabulary, and the data's files and stores reached (the reader's
    fingerprint, which a run records: their sizes and manifests). Raises as the run would; returns what it checked."""
    config = objective.config
    said = []
    if tokenizer:
        kind = config.data.tokenizer.kind
        if config.data.source != "store" and kind in base.CORPUS_KINDS and not config.data.tokenizer.get("path"):
            said.append(f"the {kind} tokenizer is learnt from the data when the run starts")
        else:
            check_vocabulary(config, base.configured_tokenizer(config))
    objective.reader.fingerprint(config)
    return "; ".join([*said, f"data found: {objective.reader.describe(config)}"])


def dry_mesh_sizes(config: ml_collections.ConfigDict) -> tuple[tuple[int, ...], str]:
    """(the run's mesh sizes, data fsdp expert tensor; the devices they were resolved over, in words) without
    starting them: a mesh shape without -1 names its devices; -1 takes those the run will have (config.distributed's
    cpu_devices_per_process, else this machine's, times num_processes), or 1 where coordinator_address=auto leaves
    the processes unknown until the run joins them."""
    given, dist = tuple(config.sharding.mesh_shape), config.distributed
    try:
        known = math.prod(size for size in sharding.mesh_shape(given) if size != -1)
        if -1 not in given:
            devices, said = known, f"the {known} device(s) it names"
        elif dist.coordinator_address == "auto":
            devices, said = known, "-1 taken as 1 (coordinator_address=auto: the devices are known when the run joins)"
        else:
            local = dist.cpu_devices_per_process or jax.local_device_count()
            devices, said = local * dist.num_processes, f"{local * dist.num_processes} device(s)"
        return sharding.resolve_mesh_shape(given, devices), said
    except ValueError as e:
        raise ValueError(f"config.sharding.mesh_shape={given}: {e}") from None


def run_mesh(config: ml_collections.ConfigDict, devices: list | None = None) -> jax.sharding.Mesh:
    """The mesh of config.sharding.mesh_shape over `devices` (default: all); ValueError naming the field."""
    try:
        return sharding.make_mesh(tuple(config.sharding.mesh_shape), devices)
    except ValueError as e:
        raise ValueError(f"config.sharding.mesh_shape={tuple(config.sharding.mesh_shape)}: {e}") from None


def check_vocabulary(config: ml_collections.ConfigDict, tokenizer: tokenizers.Tokenizer) -> None:
    """Refuses a model whose vocabulary is smaller than its tokenizer's."""
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"config.model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); set --config.model.vocab_size={tokenizer.vocab_size} (or larger)"
        )


def build(
    config: ml_collections.ConfigDict,
    workdir: str,
    stage: workdir_lib.StagedRunState | None = None,
    *,
    batches: bool = True,
    devices: list | None = None,
) -> Run:
    """`assemble` on the objective of `config`, validated (`validated_objective`)."""
    return assemble(validated_objective(config), workdir, stage, batches=batches, devices=devices)


def assemble(
    objective: base.Objective,
    workdir: str,
    stage: workdir_lib.StagedRunState | None = None,
    *,
    batches: bool = True,
    devices: list | None = None,
) -> Run:
    """Tokenizer, model, compiled trainer and checkpointer for a workdir, from the run's validated objective
    (`validated_objective`: the config is validated once per run, before the workdir is touched). Each check comes
    before the work the next one needs, in the order a dry run (`dry_check`) makes them: the layout on the mesh
    (`check_layout`), the state's memory, the tokenizer (which a learnt kind builds by reading the data).

    stage: where a training run stages a newly built tokenizer (None: a new tokenizer is not saved).
    batches: check that batch sizes split over the mesh (False for a run opened only to restore params).
    devices: the mesh's devices (default: all).
    """
    config = objective.config
    mesh, rules = run_mesh(config, devices), sharding.axis_rules(config.sharding.rules)
    model = objective.model()
    trainer = objective.trainer(model)
    traced = check_layout(objective, trainer, tuple(mesh.shape.values()), rules, batches=batches)
    compiled = trainers_base.compile_trainer(trainer, mesh=mesh, rules=rules, seed=config.train.seed, traced=traced)
    check_memory(compiled, config)  # from the state's shapes: refused here, before restore_or_init allocates it
    workdir_path = storage.path(workdir)
    splits: dict[str, Any] = {}
    tokenizer = _tokenizer(config, splits, objective, workdir_path, stage)
    check_vocabulary(config, tokenizer)
    checkpointer = checkpoint.Checkpointer(
        os.fspath(workdir_path / "checkpoints"),
        max_to_keep=config.train.keep_checkpoints,
        async_save=config.train.async_checkpoints,
    )
    return Run(
        config=config,
        workdir=workdir_path,
        objective=objective,
        tokenizer=tokenizer,
        model=model,
        compiled=compiled,
        checkpointer=checkpointer,
        splits=splits,
    )


def load_frozen(run: Run) -> Any:
    """The frozen models the objective declares (`Objective.roles`), each read once from its source, held as LoRA's
    frozen base where adapters adapt it, sharded like the state's."""
    if not jax.tree.leaves(run.compiled.abstract_state.frozen):
        return run.compiled.abstract_state.frozen
    with run.context():
        key = jax.random.key(run.config.train.seed)
        fresh = jax.device_get(run.compiled.init_program(key)(key).frozen)
    frozen = dict(fresh)
    for name, role in run.objective.roles().items():
        frozen[name] = weights.read_role(role, fresh[name])
    return jax.device_put(frozen, run.compiled.state_shardings.frozen)


def restore_or_init(run: Run, meanwhile: Callable[[], None] = lambda: None) -> tuple[Any, dict]:
    """The latest good checkpoint (with frozen parameters read again), or a fresh state whose frozen
    parameters are read, whose params the objective may adjust, which takes config.init_from's weights and which the
    trainer prepares (`prepare`: its first phase, e.g. PPO's reward normalisation; checkpointed with the state).

    meanwhile: called (once or more) as the work begins that leaves Python's interpreter lock free: the reading of a
    checkpoint found to fit, or the init program's run once it is traced and compiled; what it starts on a thread runs
    beside it (the loop compiles its first call)."""
    frozen = load_frozen(run)
    restored = run.checkpointer.restore_latest(run.abstract_state, reading=meanwhile)
    if restored is not None:
        _, state, data_state = restored
        return state.replace(frozen=frozen), data_state
    cfg = run.config
    key = jax.random.key(cfg.train.seed)
    with run.context():
        init = run.compiled.init_program(key)
        meanwhile()
        state = init(key)
    # The params stay on the mesh: `init_from` weights are read tensor by tensor into each parameter's sharding
    # (`weights.merge_pretrained`), so no host holds the whole model.
    fresh = state.params
    adapted = lora.from_config(cfg) is not None  # adapters start as they are (B = 0: the base's function)
    params = fresh if adapted else run.objective.init_params(fresh, frozen)
    if cfg.get("init_from") and not adapted:
        params = weights.merge_pretrained(
            params, cfg.init_from, cfg.model_name, cfg.model.to_dict(), allow_partial=cfg.init_from_partial
        )
    state = state.replace(frozen=frozen)
    if params is not fresh:
        with run.context():
            state = run.compiled.with_params(state, jax.device_put(params, run.compiled.state_shardings.params))
    batch = None if run.compiled.prepare is None else run.objective.prepare_batch()
    if batch is not None:
        with run.context():
            state, fitted = run.compiled.prepare(state, batch)
        if jax.process_index() == 0:
            print("prepared before the first step: " + ", ".join(f"{k} {float(v):.4g}" for k, v in fitted.items()))
    return state, {"step": 0}


@dataclasses.dataclass
class Loaded:
    """A trained model: `model.apply({"params": params}, ...)`, with its tokenizer and config."""

    model: nn.Module
    params: Any
    tokenizer: tokenizers.Tokenizer
    config: ml_collections.ConfigDict
    step: int


def load(workdir: str, step: int | None = None, *, mesh_shape: tuple[int, ...] | None = None) -> Loaded:
    """The model, host params, tokenizer and config of a train.py run's latest (or `step`'s) checkpoint.

    mesh_shape: restore onto this (data, fsdp, tensor) mesh; default: the run's mesh if this machine has
    its devices, else every device data-parallel (checkpoints reshard on restore).
    """
    workdir = os.fspath(storage.path(workdir))
    run = open_run(workdir, mesh_shape=mesh_shape, batches=False)
    try:
        # LoRA's params are adapters: the model's params are them merged into the frozen base, read again
        step, state = restore_step(run, step, frozen=lora.from_config(run.config) is not None)
        params = run.compiled.host_params(state)
    finally:
        run.close()
    return Loaded(model=run.model, params=params, tokenizer=run.tokenizer, config=run.config, step=step)


def evaluation_layout(config: ml_collections.ConfigDict, *, batches: bool = True) -> tuple[tuple, list | None]:
    """(mesh shape, devices or None for all) to evaluate a saved run on this machine: the run's mesh when this
    machine has its devices and (with `batches`) its batches split over them; else the most devices, data-parallel,
    that split config.eval.batch_size and each microbatch of config.train.batch_size (checkpoints reshard)."""
    shape = tuple(config.sharding.mesh_shape)
    try:
        dp = data_parallel_size(sharding.resolve_mesh_shape(shape, jax.device_count()))
    except ValueError:
        dp = None
    train, evals = config.train, config.eval

    def splits(d: int) -> bool:
        return not batches or (evals.batch_size % d == 0 and train.batch_size % (train.grad_accum_steps * d) == 0)

    if dp is not None and splits(dp):
        return shape, None
    d = max(d for d in range(1, jax.device_count() + 1) if splits(d))
    return (d, 1, 1), jax.devices()[:d]


def open_run(
    workdir: str, *, mesh_shape: tuple[int, ...] | None = None, batches: bool = True, seq_len: int | None = None
):
    """A `Run` of an existing workdir, for evaluation (fails if the workdir has no run), on `mesh_shape` or on
    `evaluation_layout`'s; `batches=False` when only its params are wanted; `seq_len` replaces config.data.seq_len."""
    config = load_saved(workdir)
    if seq_len is not None:
        config.data.seq_len = seq_len
    devices = None
    if mesh_shape is not None:
        config.sharding.mesh_shape = tuple(mesh_shape)
    else:
        config.sharding.mesh_shape, devices = evaluation_layout(config, batches=batches)
    if not storage.exists(storage.path(workdir) / "tokenizer" / "spec.json"):
        raise FileNotFoundError(f"{workdir}/tokenizer is missing: is {workdir!r} the workdir of a train.py run?")
    if not has_checkpoints(storage.path(workdir)):  # refused before the checkpointer makes an empty checkpoints/
        raise no_checkpoint(storage.path(workdir))
    return build(config, workdir, batches=batches, devices=devices)


def no_checkpoint(workdir: epath.Path) -> FileNotFoundError:
    """The error of a workdir that holds no checkpoint to evaluate or load."""
    return FileNotFoundError(
        f"no checkpoint found in {workdir / 'checkpoints'}; train first with train.py --workdir={workdir}"
    )


def restore_step(run, step: int | None = None, *, frozen: bool = True) -> tuple[int, Any]:
    """(step, state) of the latest checkpoint that restores, or of `step`, with the frozen parameters its objective
    evaluates against (a reference policy, a reward model, a teacher) read again as a resumed run reads them
    (`load_frozen`); `frozen=False` leaves them out, for callers that want only the trained params."""
    if step is None:
        restored = run.checkpointer.restore_latest(run.abstract_state)
        if restored is None:
            raise no_checkpoint(run.workdir)
        step, state, _ = restored
    elif step not in run.checkpointer.steps():
        raise FileNotFoundError(
            f"no checkpoint for step {step} in {run.checkpointer.directory}; kept steps: {run.checkpointer.steps()}"
        )
    else:
        state = run.checkpointer.restore_step(step, run.abstract_state)[0]
    return step, state.replace(frozen=load_frozen(run)) if frozen else state
