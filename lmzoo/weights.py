"""Pretrained weights from elsewhere: another run's checkpoint ("ckpt:WORKDIR") or a HuggingFace folder ("hf:PATH"),
merged into fresh params. Below the objectives, which read their frozen models with it.

Each merged parameter takes the placement of the fresh one it replaces: a host numpy array, or a jax.Array in the
fresh one's sharding. An HF folder is streamed tensor by tensor straight into that placement (`lmzoo.convert.hf`);
a checkpoint's params are read from its own metadata (no config, model or trainer is built), on the host.
"""

import pathlib
from typing import Any

import jax
import numpy as np
from flax import traverse_util

from lmzoo import checkpoint
from lmzoo.convert import hf, mapping


def checkpoint_params(workdir: str) -> Any:
    """The params (host numpy arrays) of the latest checkpoint of a train.py run that restores."""
    folder = pathlib.Path(workdir).expanduser() / "checkpoints"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} not found: is {workdir!r} the workdir of a train.py run with checkpoints?")
    checkpointer = checkpoint.Checkpointer(str(folder), async_save=False)
    try:
        restored = checkpointer.restore_latest_params()
    finally:
        checkpointer.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint found in {folder}; train first with train.py --workdir={workdir}")
    return restored[1]


def read_params(spec: str, model_name: str, model_config, target, *, allow_partial: bool = False):
    """Params from "hf:PATH" (HuggingFace safetensors folder, converted to `model_config`'s layout and to the dtypes
    and placement of `target`'s leaves: see `lmzoo.convert.hf.convert_pretrained`) or "ckpt:WORKDIR" (another lmzoo
    run's latest checkpoint, host numpy; a classifier run gives its backbone).

    allow_partial: an HF checkpoint that fits only in part gives the parameters that fit instead of an error."""
    if spec.startswith("hf:"):
        return hf.convert_pretrained(spec, model_name, model_config, target, allow_partial=allow_partial)[0]
    if spec.startswith("ckpt:"):
        source = checkpoint_params(spec.removeprefix("ckpt:"))
        return source.get("backbone", source)
    raise ValueError(f"pretrained weights spec {spec!r} must be 'hf:PATH' or 'ckpt:WORKDIR'")


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
