"""Pretrained weights from elsewhere: another run's checkpoint ("ckpt:WORKDIR") or a HuggingFace folder ("hf:PATH"),
merged into fresh params. Below the objectives, which read their frozen models with it.

Each merged parameter takes the placement of the fresh one it replaces: a host numpy array, or a jax.Array in the
fresh one's sharding. An HF folder is streamed tensor by tensor straight into that placement (`lmzoo.convert.hf`);
a checkpoint's params are read from its own metadata (no config, model or trainer is built), on the host.
"""

import dataclasses
import json
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import traverse_util

from lmzoo import checkpoint, lora, storage, tokenizers
from lmzoo import config as config_lib
from lmzoo.convert import hf, mapping
from lmzoo.kernels import host_memory


@dataclasses.dataclass(frozen=True)
class Role:
    """A frozen model a run needs (a reference policy, a reward model, a teacher, the base LoRA adapts), declared by
    its objective (`lmzoo.objectives.base.Objective.roles`) and read by the run layer at every start (`read_role`)
    into the state's frozen entry of the same name: never checkpointed, so a resumed run reads it again from `source`.

    Attributes:
        source: "ckpt:WORKDIR" or "hf:PATH" (a folder, a bucket prefix or a cached Hub id).
        model_name, model_fields: the model the weights are read for (`read_params`).
        read: "merged": every parameter the source provides replaces the fresh one (`merge_pretrained`); "params":
            the source's params as they are, which `check` compares with the fresh tree; "run": a train.py run's
            whole params, its head included (a reward model), checked by `check`.
        allow_partial: an HF checkpoint that fits only in part gives what fits (config.init_from_partial).
        check: (fresh, read) -> None, raising a ValueError that names the source when what was read does not fit.
        adapters: the LoRA config of adapters trained over this model: it is held as their frozen base
            (`lora.freeze`: its matrices in the adapters' base_dtype); None: as read.
    """

    source: str
    model_name: str
    model_fields: Any
    read: str = "merged"
    allow_partial: bool = False
    check: Callable[[Any, Any], None] | None = None
    adapters: lora.LoraConfig | None = None


def read_role(role: Role, fresh: Any) -> Any:
    """The frozen entry `role` declares, read from its source into the layout of `fresh` (its fresh params: host
    arrays), checked by the role's `check`, held as LoRA's frozen base where adapters adapt it."""
    if role.read == "run":
        loaded = run_params(role.source.removeprefix("ckpt:"), fresh)
    else:
        target = fresh.get("backbone", fresh)
        loaded = read_params(role.source, role.model_name, role.model_fields, target, allow_partial=role.allow_partial)
    if role.check is not None:
        role.check(fresh, loaded)
    if role.read == "merged":
        loaded = merge_pretrained(fresh, loaded, role.model_name, role.model_fields, name=role.source)
    loaded = jax.tree.map(np.asarray, loaded)
    return loaded if role.adapters is None else lora.freeze(loaded, role.adapters)


def checkpoint_params(workdir: str, placed: Any = None) -> Any:
    """The params of the latest checkpoint of a train.py run (or of `python -m lmzoo.cli.convert`) that restores, its
    workdir local or in a bucket: host numpy arrays, or straight in the sharding and dtype of `placed`'s leaf of the
    same path and shape (`checkpoint.Checkpointer.restore_params`)."""
    folder = storage.path(workdir) / "checkpoints"
    if not storage.exists(folder):
        raise FileNotFoundError(f"{folder} not found: is {workdir!r} the workdir of a train.py run with checkpoints?")
    checkpointer = checkpoint.Checkpointer(str(folder), async_save=False)
    try:
        with host_memory.large_blocks_unmapped_when_freed():
            restored = checkpointer.restore_latest_params(placed)
    finally:
        checkpointer.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint found in {folder}; train first with train.py --workdir={workdir}")
    return restored[1]


def saved_config(workdir: str) -> dict | None:
    """The config a train.py run at `workdir` (local or in a bucket) saved; None where there is none (the run's
    checkpoints are then refused when read)."""
    saved = storage.path(workdir) / "config.json"
    return config_lib.read_saved(saved) if storage.exists(saved) else None


def saved_objective(workdir: str) -> str | None:
    """The objective a train.py run at `workdir` trained (`saved_config`), or None."""
    return (saved_config(workdir) or {}).get("objective", {}).get("name")


def pretrained_tokenizer(spec: str) -> tokenizers.Tokenizer:
    """The tokenizer that comes with pretrained weights (config.data.tokenizer.kind "init_from"): the tokenizer.json of
    an "hf:" checkpoint (a folder, a bucket prefix or a cached Hub id) with its special tokens, chat template and
    generation settings (`tokenizers.PRETRAINED_FILES`, as transformers reads the folder), or the saved tokenizer of a
    "ckpt:" run."""
    if spec.startswith("hf:"):
        folder = hf.resolve_folder(spec.removeprefix("hf:"))
        if not storage.exists(f"{folder}/tokenizer.json"):
            raise FileNotFoundError(
                f"{folder} has no tokenizer.json, which config.data.tokenizer.kind='init_from' reads; set "
                "config.data.tokenizer to the checkpoint's tokenizer (kind and path)"
            )
        if not storage.is_remote(folder):
            return tokenizers.build_tokenizer("hf_json", path=f"{folder}/tokenizer.json")
        with tempfile.TemporaryDirectory(prefix="lmzoo-tokenizer-") as local:  # tokenizers read local files, eagerly
            for name in ("tokenizer.json", *tokenizers.PRETRAINED_FILES):
                if name == "tokenizer.json" or storage.exists(f"{folder}/{name}"):
                    storage.write_bytes(f"{local}/{name}", storage.read_bytes(f"{folder}/{name}"))
            return tokenizers.build_tokenizer("hf_json", path=f"{local}/tokenizer.json")
    if spec.startswith("ckpt:"):
        saved = storage.path(spec.removeprefix("ckpt:")) / "tokenizer"
        if not storage.exists(saved / "spec.json"):
            raise FileNotFoundError(f"{saved}/spec.json not found: {spec} saved no tokenizer")
        with storage.local_copy(saved) as folder:
            return tokenizers.from_spec(json.loads(storage.read_text(saved / "spec.json")), folder)
    raise ValueError(
        f"config.data.tokenizer.kind='init_from' reads the tokenizer of config.init_from, which is {spec!r}: set it to "
        "'hf:PATH' (or a Hub id, 'hf:ORG/NAME') or 'ckpt:WORKDIR'"
    )


def read_params(spec: str, model_name: str, model_config, target, *, allow_partial: bool = False):
    """Params from "hf:PATH" (HuggingFace safetensors folder, converted to `model_config`'s layout and to the dtypes
    and placement of `target`'s leaves: see `lmzoo.convert.hf.convert_pretrained`) or "ckpt:WORKDIR" (another lmzoo
    run's latest checkpoint: in the sharding and dtype of `target`'s leaves where it gives them, else host numpy, its
    layer stacks in target's layout; a classifier run gives its backbone).

    allow_partial: an HF checkpoint that fits only in part gives the parameters that fit instead of an error."""
    if spec.startswith("hf:"):
        return hf.convert_pretrained(spec, model_name, model_config, target, allow_partial=allow_partial)[0]
    if spec.startswith("ckpt:"):
        source = run_params(spec.removeprefix("ckpt:"), target)
        if "backbone" in source:  # a classifier or reward model gives its backbone
            source = source["backbone"]
        elif "value_head" in source:  # an RL policy its decoder
            source = source["decoder"]
        return mapping.to_layout(source, target)  # a run of the other scan_layers: its layer stacks relaid
    raise ValueError(f"pretrained weights spec {spec!r} must be 'hf:PATH' or 'ckpt:WORKDIR'")


def run_params(workdir: str, placed: Any = None) -> Any:
    """The model params of a train.py run's latest checkpoint (`checkpoint_params`); a LoRA run's adapters merged
    into the base it adapted, read again (`lora.merge_on_read`)."""
    source = checkpoint_params(workdir, placed)
    saved = saved_config(workdir) or {}

    def read_base(spec, target):
        return read_params(spec, saved["model_name"], saved["model"], target)

    return lora.merge_on_read(source, saved, placed, read_base)


TOKEN_TABLES = ("wte/embedding",)  # token embeddings that may gain rows for new special tokens (GPT classifier)


def merge_pretrained(
    fresh, source, model_name: str, model_config=None, *, name: str | None = None, allow_partial: bool = False
):
    """`fresh` params with every parameter `source` (params, or a read_params spec, read for `model_config`
    with `allow_partial`) provides replaced, in the fresh parameter's dtype and placement (host numpy, or a
    jax.Array in its sharding).

    A classifier takes the weights into its backbone and keeps its new head; pretraining heads the
    target lacks are dropped. A token table (TOKEN_TABLES) with more rows than the source's keeps its
    new rows' fresh init (added special tokens), and says so; any other shape mismatch is an error.
    """
    name = name or str(source)
    target = fresh["backbone"] if "backbone" in fresh else fresh
    if isinstance(source, str):
        source = read_params(source, model_name, model_config, target, allow_partial=allow_partial)
    flat_target, flat_source = traverse_util.flatten_dict(target, sep="/"), traverse_util.flatten_dict(source, sep="/")
    grown = {
        k
        for k, v in flat_target.items()
        if k in TOKEN_TABLES
        and k in flat_source
        and flat_source[k].shape[1:] == v.shape[1:]
        and flat_source[k].shape[0] < v.shape[0]
    }
    mismatched = [
        f"{k}: {flat_source[k].shape} vs model {v.shape}"
        for k, v in flat_target.items()
        if k in flat_source and k not in grown and flat_source[k].shape != v.shape
    ]
    if mismatched:
        raise ValueError(f"weights from {name} do not fit the configured model:\n  " + "\n  ".join(mismatched))
    loaded = dict(flat_target)
    for k in flat_source.keys() & flat_target.keys():
        value = flat_source[k]
        if k in grown:  # the pretrained rows, then the new tokens' fresh ones
            value = np.concatenate([np.asarray(value), np.asarray(flat_target[k])[len(value) :]])
        loaded[k] = mapping.place(value, flat_target[k])
    fresh_keys = sorted(set(flat_target) - set(flat_source))
    if jax.process_index() == 0:
        print(
            f"{name}: loaded {len(flat_target) - len(fresh_keys)} parameters; newly initialised: {fresh_keys or 'none'}"
        )
        for k in sorted(grown):
            print(
                f"{name}: {k} has {len(flat_source[k])} pretrained rows; rows {len(flat_source[k])}.."
                f"{len(flat_target[k]) - 1} (new tokens) keep their fresh initialisation"
            )
    merged = traverse_util.unflatten_dict(loaded, sep="/")
    return {**fresh, "backbone": merged} if "backbone" in fresh else merged
