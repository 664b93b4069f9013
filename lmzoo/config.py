"""The one config system: ml_collections ConfigDicts with every section and its defaults.

`configs/<experiment>.py` files start from `base_config()` and change what differs. Configs are
locked, so an override or a field that does not exist is an error (naming the valid keys),
and `validate` checks the model section against the family's dataclass.
"""

import json
import os
import pathlib
from collections.abc import Callable, Collection
from typing import Any

import ml_collections

from lmzoo import lora, models, storage, tokenizers

# data.tokenizer.kind: a tokenizer kind, or "init_from": the tokenizer that comes with config.init_from's weights
# (an hf: checkpoint's tokenizer.json, a ckpt: run's tokenizer), so that one flag names both.
TOKENIZER_KINDS = (*tokenizers.KINDS, "init_from")


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model_name = "gpt2"
    c.model = ml_collections.ConfigDict()
    c.init_from = ""  # "hf:PATH": start from HuggingFace weights (a folder with config.json + model.safetensors)
    c.init_from_partial = False  # with hf:, load the parameters that fit and initialise the rest (report printed)
    # LoRA (docs/lora.md): targets "" trains every parameter; a regular expression over module names
    # ("query|key|value|out|wi_0|wi_1|wo") trains low-rank adapters of those kernels over the frozen base that init_from
    # (or the objective's reference: dpo's sft, ppo's) gives. base_dtype "": the params' own; "bfloat16" halves the
    # base. train_in_full: modules trained in full beside the adapters (PEFT's modules_to_save), added to the heads
    # the objective trains so (a classifier's or reward model's "classifier", PPO's "value_head"). dropout: PEFT's
    # lora_dropout, on the inputs of the layers' adapted projections while training (DPO, the reward model and the PPO
    # family train without dropout and refuse it).
    c.lora = ml_collections.ConfigDict(
        {
            "targets": "",
            "rank": 8,
            "alpha": 16.0,
            "dropout": 0.0,
            "base_dtype": "",
            "rslora": False,
            "train_in_full": "",
        }
    )

    c.data = ml_collections.ConfigDict()
    # "local" (path), "python_stdlib", "tfds" (name, data_dir), "tsv" (labelled), "pairs" (path), or "store": a token
    # store made by `python -m lmzoo.data.prepare` (path), or several mixed by weight (mixture). Raw text is
    # tokenized once into a store cached under cache_dir (default $LMZOO_CACHE, else ~/.cache/lmzoo).
    c.data.source = "python_stdlib"
    c.data.path = ""
    # Problems with checkable answers (lmzoo.data.problems): the prompt each row becomes, its fields in braces.
    c.data.prompt_template = "Question: {question}\nAnswer:"
    c.data.mixture = ()  # store: ((folder, weight), ...) instead of path; rows drawn by weight from (seed, step)
    c.data.cache_dir = ""
    # A store in a bucket (gs://, s3://) is read through a local cache under cache_dir/objects, bounded to this size.
    c.data.read_cache_gb = 20.0
    c.data.document_unit = "file"  # local .txt files: one document per "file", "paragraph" or "line"
    c.data.text_field = "text"  # field of .jsonl lines / TFDS features holding the text
    c.data.max_files = 400  # python_stdlib: how many source files to read
    c.data.name = ""  # tfds dataset name
    c.data.data_dir = ""  # tfds data_dir
    c.data.train_path = ""  # tsv: labelled train file (GLUE format, header row)
    c.data.validation_path = ""
    c.data.text_fields = (
        "sentence",
    )  # tsv: one column, or two for sentence pairs; pairs: (source, target) or one + split_marker
    c.data.label_field = "label"
    c.data.train_split = "train"
    c.data.validation_split = "validation"
    c.data.validation_fraction = 0.1  # local/stdlib: held-out tail (characters of one file, else documents)
    c.data.seq_len = 128  # tokens per example (text_to_text: of the source)
    c.data.target_seq_len = 128  # text_to_text: tokens of the target
    c.data.split_marker = ""  # pairs with one text field: split at the marker's last occurrence (HH: "\n\nAssistant:")
    c.data.sampler = "random"  # "random" windows (nanoGPT) or "sequential" shuffled non-overlapping windows
    # kind and its files (path: gpt2 folder, wordpiece vocab.txt, hf_json, a saved sentencepiece .model or words.txt),
    # so --config.data.tokenizer.kind=gpt2 --config.data.tokenizer.path=DIR switches a run's tokenizer on the command line
    c.data.tokenizer = ml_collections.ConfigDict({"kind": "byte", "path": ""})

    # name + that objective's fields (`lmzoo.objectives.objective_section`; `python train.py --objectives` lists them)
    c.objective = ml_collections.ConfigDict({"name": "causal_lm"})

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"
    c.optim.learning_rate = 1e-3
    c.optim.min_learning_rate = 1e-4
    c.optim.warmup_steps = 100
    c.optim.decay_steps = 2000  # cosine reaches min_learning_rate here
    c.optim.b1 = 0.9
    c.optim.b2 = 0.99
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.1
    c.optim.decay_embeddings = False
    c.optim.grad_clip = 1.0
    c.optim.expert_bias_rate = 0.0  # routing biases' step a step (DeepSeek-V3: 0.001; 0 keeps them as loaded)
    c.optim.groups = ()  # ((path, {field: value}), ...): other settings for param subtrees (lmzoo/trainers/optim.py)

    c.train = ml_collections.ConfigDict()
    c.train.seed = 0
    c.train.steps = 2000
    c.train.batch_size = 12  # global batch (sequences per optimizer step)
    c.train.grad_accum_steps = 1
    c.train.steps_per_call = 1  # optimizer steps per compiled call (a lax.scan over that many batches)
    c.train.log_every = 50
    c.train.eval_every = 500
    c.train.checkpoint_every = 500
    c.train.keep_checkpoints = 3
    c.train.async_checkpoints = True
    c.train.sample_prompt = "\n"
    c.train.sample_tokens = 200

    c.eval = ml_collections.ConfigDict()
    c.eval.batch_size = 64
    c.eval.max_batches = ml_collections.FieldReference(None, field_type=int)  # None = the whole split
    c.eval.evaluators = ("loss",)  # run during training, by name (lmzoo.evaluation.EVALUATORS); "loss" comes first

    c.sharding = ml_collections.ConfigDict()
    c.sharding.mesh_shape = (-1, 1, 1)  # (data, fsdp, tensor) or (data, fsdp, expert, tensor); -1: the rest
    c.sharding.rules = ()  # overrides of lmzoo.sharding.LOGICAL_AXIS_RULES, e.g. (("vocab", None),)

    c.distributed = ml_collections.ConfigDict()
    c.distributed.coordinator_address = ""  # "" single process; "auto" (TPU pods, SLURM); or "host:port"
    c.distributed.num_processes = 1
    c.distributed.process_id = 0
    c.distributed.cpu_devices_per_process = 0  # >0: simulated CPU devices per process (testing)
    return c


def model_section(name: str, **fields) -> ml_collections.ConfigDict:
    """Every field of family `name`'s config dataclass (defaults, then `fields`), so each is overridable."""
    import dataclasses

    return ml_collections.ConfigDict(dataclasses.asdict(models.make_config(name, fields)))


# Fields a resumed run may change: how long it trains, how often it logs, evaluates and saves, where it runs, and
# how its layers are compiled (scanned or looped, what they rematerialise: the same function; a checkpoint of the
# other layout is relaid on restore). Every other field changes what the checkpoints were trained with.
RESUMABLE_FIELDS = (
    "model.scan_layers",
    "model.remat_policy",
    "train.steps",
    "train.steps_per_call",
    "train.log_every",
    "train.eval_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.async_checkpoints",
    "train.sample_prompt",
    "train.sample_tokens",
    "eval.",
    "sharding.",
    "distributed.",
    "init_from",
    "init_from_partial",
)


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def read_saved(path: str | os.PathLike) -> dict:
    """The config a run saved as JSON at `path` (local or in a bucket); a damaged file is a ValueError naming it."""
    try:
        saved = json.loads(storage.read_text(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path} is damaged ({e}); put back the run's saved config, or train in a new --workdir"
        ) from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds no config (a JSON object expected); put back the run's saved config")
    return saved


def check_resume(config: ml_collections.ConfigDict, step: int, workdir, command_line: Collection[str] = ()) -> None:
    """Refuses to resume checkpoints of step `step` written with the config `workdir` saved (its config.json) under a
    config that changes training (any field outside RESUMABLE_FIELDS, or train.steps below `step`), listing each
    change and suggesting a new --workdir, or how to resume: dropping the overrides among `command_line` (the keys
    given as --config.KEY=...) that make a change, setting back the others.

    A run extended with --config.train.steps=N and then rerun without it (the config file's steps now below the
    checkpoint's) continues to the N it was last given, as the command that extended it would: config.train.steps
    is set to it."""
    saved = read_saved(f"{workdir}/config.json")
    last = saved.get("train", {}).get("steps", 0)
    if config.train.steps < step <= last:
        print(
            f"train.steps={config.train.steps} is below the checkpoint's step {step}: continuing the run as last "
            f"configured, to train.steps={last} (pass --config.train.steps=N, N > {last}, to extend it further)"
        )
        config.train.steps = last
    before, after = _flatten(saved), _flatten(json.loads(config.to_json_best_effort()))
    changed = [
        key
        for key in sorted(after)
        if key in before
        and before[key] != after[key]
        # Under LoRA, init_from is the frozen base the checkpoint's adapters were trained on.
        and (not key.startswith(RESUMABLE_FIELDS) or (key == "init_from" and lora.from_config(config) is not None))
    ]
    changes = [f"{key}: {before[key]!r} -> {after[key]!r}" for key in changed]
    given = [key for key in changed if any(key == name or key.startswith(f"{name}.") for name in command_line)]
    fixes = [f"drop the override(s) {', '.join(f'--config.{key}' for key in given)}"] if given else []
    if len(given) < len(changed):
        others = ", ".join(key for key in changed if key not in given)
        fixes.append(f"set {others} back to the run's value(s)")  # not overrides: the config file differs
    if config.train.steps < step:
        changes.append(f"train.steps={config.train.steps} is below the checkpoint's step {step}")
        fixes.append(f"pass --config.train.steps=N with N above {step}")
    if changes:
        raise ValueError(
            f"{workdir} holds checkpoints up to step {step} of a run whose config differs from this one:\n  "
            + "\n  ".join(changes)
            + f"\nTo train with these settings, pass a new --workdir (e.g. --workdir={workdir}_2); to resume, "
            + " and ".join(fixes)
            + " (config.json in the workdir holds the run's config)."
        )


def load_config_file(path: str | pathlib.Path, arg: str | None = None) -> ml_collections.ConfigDict:
    """`get_config(arg)` of the config file at `path` (`configs/NAME.py`), executed as a module."""
    import importlib.util

    if not pathlib.Path(path).is_file():
        raise FileNotFoundError(f"config file {str(path)!r} not found; pass configs/NAME.py (a variant goes in `arg`)")
    spec = importlib.util.spec_from_file_location(f"_lmzoo_config_{pathlib.Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


# The repository's root: its configs/ folder is where a config path given from any other folder is looked up.
REPO = pathlib.Path(__file__).resolve().parents[1]


def resolve_config_path(argv: list[str], flag: str = "config") -> list[str]:
    """argv with a relative `--FLAG=PATH[:arg]` that is missing here but present in the repository made absolute, so
    that `--config=configs/NAME.py` works from any folder."""
    resolved = []
    for arg in argv:
        if arg.startswith(f"--{flag}="):
            path, sep, variant = arg[len(f"--{flag}=") :].partition(":")
            if not storage.exists(path) and storage.exists(REPO / path):
                arg = f"--{flag}={REPO / path}{sep}{variant}"
        resolved.append(arg)
    return resolved


def check_overrides(argv: list[str], flag: str = "config", default: str = "configs/default.py") -> None:
    """Fails fast, naming the valid keys, on `--config.a.b=v` overrides of keys the config lacks (and on an
    unknown variant, for config files that check theirs)."""
    spec_arg = next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{flag}=")), default)
    path, _, variant = spec_arg.partition(":")
    if not pathlib.Path(path).exists():
        raise FileNotFoundError(f"config file {path!r} not found; pass --{flag}=configs/NAME.py")
    config = load_config_file(path, variant or None)
    for arg in argv:
        if not arg.startswith(f"--{flag}."):
            continue
        keys = arg[len(f"--{flag}.") :].split("=", 1)[0].split(".")
        node, seen = config, []
        for key in keys:
            if not isinstance(node, ml_collections.ConfigDict) or key not in node:
                section = "config" + "".join(f".{k}" for k in seen)
                valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
                raise ValueError(f"unknown config key {'.'.join(keys)!r} in {arg!r}; valid keys of {section}: {valid}")
            node, seen = node[key], seen + [key]


def take_pretrained_fields(
    config: ml_collections.ConfigDict, command_line: Collection[str] = ()
) -> dict[str, tuple[Any, Any]]:
    """`from_pretrained` for config.init_from="hf:..." (a folder, a cached Hub id, a bucket prefix): config.model's
    fields set, in place, to what the checkpoint fixes (its config.json: `convert.hf.checkpoint_fields`), so what a
    config file sets is a default the checkpoint replaces. The changed fields are printed as one line (field: from ->
    to). A field given on the command line (`command_line`: the overridden keys, e.g. "model.num_layers", as
    config_flags records them) that contradicts the checkpoint is an error naming both values, unless
    config.init_from_partial loads only what fits (the field then stays as given). Returns {field: (from, to)};
    nothing is read or changed for other init_from values."""
    from lmzoo.convert import hf

    if not str(config.get("init_from") or "").startswith("hf:"):
        return {}
    fields = hf.checkpoint_fields(config.init_from, config.model_name)
    given = {key.removeprefix("model.") for key in command_line if key.startswith("model.")}

    def comparable(value: Any) -> Any:
        return tuple(value) if isinstance(value, list | tuple) else value

    differing = {
        field: (config.model.get(field), value)
        for field, value in fields.items()
        if field not in config.model or comparable(config.model[field]) != comparable(value)
    }
    contradicted = {field: change for field, change in differing.items() if field in given}
    if contradicted and not config.init_from_partial:
        raise ValueError(
            f"--config.model.{next(iter(contradicted))}: checkpoint {config.init_from!r} does not fit the command "
            "line's model: "
            + "; ".join(
                f"config.model.{f}={ours!r}, checkpoint {theirs!r}" for f, (ours, theirs) in contradicted.items()
            )
            + ". Drop the override(s) to take the checkpoint's values, or pass --config.init_from_partial=True to load "
            "only the parameters that fit"
        )
    changes = {field: change for field, change in differing.items() if field not in given}
    with config.unlocked():
        for field, (_, value) in changes.items():
            if field in config.model and type(config.model[field]) is not type(value):
                del config.model[field]  # an int the file wrote where the checkpoint gives a float, or back
            config.model[field] = value
    import jax  # after `sharding.initialize_distributed`: the processes of one run say it once

    if changes and jax.process_index() == 0:
        print(
            f"{config.init_from}: config.model takes the checkpoint's config.json: "
            + ", ".join(f"{field} {before!r}->{after!r}" for field, (before, after) in changes.items())
        )
    return changes


def available_memory() -> int | None:
    """Bytes of host memory available to a new allocation (/proc/meminfo's MemAvailable: free memory and reclaimable
    caches); None where there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_variants(arg: str | None, known: tuple[str, ...], *, single: bool = False) -> tuple[str, ...]:
    """The comma-separated variant words of `--config=FILE:arg`; an unknown word (a typo) is an error, and
    so is more than one word for a config whose variants exclude each other (`single`)."""
    words = tuple(w for w in (arg or "").split(",") if w)
    unknown = [w for w in words if w not in known]
    if unknown:
        raise ValueError(f"unknown config variant {unknown[0]!r} in {arg!r}; known variants: {', '.join(known)}")
    if single and len(words) > 1:
        raise ValueError(f"config variants {arg!r}: choose one of {', '.join(known)}")
    return words


def check_values(
    config: ml_collections.ConfigDict,
    *,
    data_parallel_size: int,
    devices: int | None = None,
    batches: bool = True,
    more_problems: tuple[str, ...] = (),
    mesh_fits: Callable[[tuple[int, ...]], bool] | None = None,
) -> None:
    """Raises one ValueError listing every out-of-range value (and `more_problems`, the objective's), each naming
    its field and the fix.

    data_parallel_size: devices the batch is split over (the mesh's data x fsdp x expert axes), so a global
    batch, and each gradient-accumulation microbatch of it, must be a multiple of it (checked with
    `batches`; a run opened only to restore its params never splits a batch). devices and mesh_fits: the mesh's
    size, and whether the model's parameters split over a mesh shape of it, to suggest a mesh that keeps the batch
    sizes (the devices the batch cannot use shard the model over the tensor axis instead; the expert axis is kept).
    mesh_fits is asked only when every other value is in range (it traces the model).
    """
    from lmzoo.data import sources

    train, evals, data, optim = config.train, config.eval, config.data, config.optim
    problems = []

    def value(field: str):
        found = config
        for key in field.split("."):
            found = found[key]
        return found

    def require(ok: bool, field: str, why: str) -> None:
        if not ok:
            problems.append(f"config.{field}={value(field)!r}: {why}")

    for field in (
        "train.steps",
        "train.batch_size",
        "train.grad_accum_steps",
        "train.steps_per_call",
        "train.log_every",
        "train.eval_every",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "eval.batch_size",
        "data.seq_len",
    ):
        require(value(field) >= 1, field, f"must be a positive integer; set --config.{field}=N with N >= 1")
    splittable = batches and not problems  # batch sizes are positive: check how they split
    require(train.sample_tokens >= 0, "train.sample_tokens", "must be >= 0 (0 skips sampling)")
    require(
        evals.max_batches is None or evals.max_batches >= 1,
        "eval.max_batches",
        "must be None (the whole split) or >= 1",
    )
    if data.source == "python_stdlib":
        require(data.max_files >= 1, "data.max_files", "must be >= 1 (python_stdlib reads that many files)")
    require(
        0 < data.validation_fraction < 1, "data.validation_fraction", "must be between 0 and 1 (exclusive), e.g. 0.1"
    )
    require(
        data.document_unit in sources.DOCUMENT_UNITS, "data.document_unit", f"choose one of {sources.DOCUMENT_UNITS}"
    )
    require(data.sampler in ("random", "sequential"), "data.sampler", "choose 'random' or 'sequential'")
    if data.source == "store":
        require(
            bool(data.path) != bool(data.mixture),
            "data.path",
            "source 'store' reads one store (data.path) or a mixture (data.mixture), exactly one of them",
        )
        for entry in data.mixture:
            require(
                len(entry) == 2 and isinstance(entry[1], int | float) and entry[1] > 0,
                "data.mixture",
                f"entry {tuple(entry)!r} must be (store folder, weight > 0)",
            )
        require(data.sampler == "random" or not data.mixture, "data.sampler", "a mixture draws 'random' windows")
        require(data.read_cache_gb > 0, "data.read_cache_gb", "must be > 0 (the local cache of bucket stores, in GB)")
    else:
        require(not data.mixture, "data.mixture", "mixes token stores: set config.data.source='store'")
    require(
        data.tokenizer.kind in TOKENIZER_KINDS, "data.tokenizer.kind", f"choose one of {', '.join(TOKENIZER_KINDS)}"
    )
    require(
        data.tokenizer.kind != "init_from" or bool(config.get("init_from")),
        "data.tokenizer.kind",
        "'init_from' reads the tokenizer of config.init_from's checkpoint: set config.init_from (hf:PATH, hf:ORG/NAME or "
        "ckpt:WORKDIR)",
    )
    if data.source not in ("local", "pairs", "store"):
        require(
            not data.path,
            "data.path",
            f"is ignored by config.data.source={data.source!r}; add --config.data.source=local to train on it",
        )
    require(optim.learning_rate > 0, "optim.learning_rate", "must be > 0, e.g. 1e-3")
    require(
        0 <= optim.min_learning_rate <= optim.learning_rate,
        "optim.min_learning_rate",
        "must be in [0, optim.learning_rate]",
    )
    require(optim.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    require(
        optim.decay_steps >= 1,
        "optim.decay_steps",
        "must be >= 1 (the step where the cosine reaches min_learning_rate)",
    )
    for field in ("optim.b1", "optim.b2"):
        require(0 <= value(field) < 1, field, "must be in [0, 1), e.g. 0.9 / 0.99")
    require(optim.eps > 0, "optim.eps", "must be > 0, e.g. 1e-8")
    require(optim.weight_decay >= 0, "optim.weight_decay", "must be >= 0 (0 turns weight decay off)")
    require(optim.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 turns clipping off)")
    require(optim.expert_bias_rate >= 0, "optim.expert_bias_rate", "must be >= 0 (0 keeps the routing biases fixed)")
    mesh = tuple(config.sharding.mesh_shape)
    require(
        len(mesh) in (3, 4) and all(n >= 1 or n == -1 for n in mesh) and mesh.count(-1) <= 1,
        "sharding.mesh_shape",
        "must be 3 sizes (data, fsdp, tensor) or 4 (data, fsdp, expert, tensor), each >= 1, one of them may be -1 "
        "(the remaining devices)",
    )
    if splittable:
        fits = mesh_fits if devices and mesh_fits and not problems and not more_problems else None
        problems += _batch_split_problems(config, data_parallel_size, devices or 0, fits)
    problems += more_problems
    if problems:
        raise ValueError("invalid config values:\n  " + "\n  ".join(problems))


def mesh_flag(shape: tuple[int, ...]) -> str:
    """The override that sets config.sharding.mesh_shape to `shape`, as a shell takes it."""
    return f"--config.sharding.mesh_shape='({','.join(map(str, shape))})'"


def working_mesh(
    config: ml_collections.ConfigDict, devices: int, mesh_fits: Callable[[tuple[int, ...]], bool]
) -> tuple[int, ...] | None:
    """A mesh shape of `devices` devices, written as config.sharding.mesh_shape is (3 or 4 sizes), whose
    data-parallel axes split the batch sizes and whose parameters divide (`mesh_fits`): the most data-parallel one,
    the devices the batch cannot use sharding the model over the tensor axis, the config's expert size kept. None
    if there is none."""
    train, evals = config.train, config.eval
    given = tuple(config.sharding.mesh_shape)
    expert = given[2] if len(given) == 4 and given[2] > 0 else 1
    for d in range(devices, 0, -1):
        if devices % d or d % expert or train.batch_size % (train.grad_accum_steps * d) or evals.batch_size % d:
            continue
        shape = (d // expert, 1, expert, devices // d) if len(given) == 4 else (d, 1, devices // d)
        if mesh_fits(shape):
            return shape
    return None


def _batch_split_problems(
    config: ml_collections.ConfigDict,
    data_parallel_size: int,
    devices: int,
    mesh_fits: Callable[[tuple[int, ...]], bool] | None,
) -> list[str]:
    """`check_values`' batch sizes over the data-parallel devices; each refusal names the batch size that splits and,
    where `mesh_fits` is given, the `working_mesh` that keeps the batch sizes."""
    train, evals = config.train, config.eval
    accum, multiple = train.grad_accum_steps, train.grad_accum_steps * data_parallel_size
    if not train.batch_size % multiple and not evals.batch_size % data_parallel_size:
        return []  # asked before any mesh is sought: `mesh_fits` traces the model
    mesh = working_mesh(config, devices, mesh_fits) if mesh_fits is not None else None
    keep = (
        ""
        if mesh is None
        else f", or keep the batch sizes and shard the model over the other devices: {mesh_flag(mesh)}"
    )
    problems = []
    if train.batch_size % multiple:
        problems.append(
            f"config.train.batch_size={train.batch_size}: must be a multiple of {multiple} (grad_accum_steps={accum} "
            f"x {data_parallel_size} data-parallel devices); set "
            f"--config.train.batch_size={max(multiple, train.batch_size // multiple * multiple)}{keep}"
        )
    if evals.batch_size % data_parallel_size:
        problems.append(
            f"config.eval.batch_size={evals.batch_size}: must be a multiple of the {data_parallel_size} data-parallel "
            f"devices; set --config.eval.batch_size="
            f"{max(data_parallel_size, evals.batch_size // data_parallel_size * data_parallel_size)}{keep}"
        )
    return problems
