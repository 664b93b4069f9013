"""Trained checkpoints back into Python: `load(workdir)`, and pretrained weights merged into fresh params.

`load` needs only the workdir (its config.json, tokenizer/ and checkpoints/): the state's shapes come
from the model and the objective's input shapes, so no training data is read and nothing is trained.
"""

import dataclasses
import pathlib
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from flax import traverse_util

from lmzoo import config as config_lib
from lmzoo import tokenizers


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
    from lmzoo.train import loop

    workdir = str(pathlib.Path(workdir).expanduser().absolute())
    run = open_run(workdir, mesh_shape=mesh_shape, batches=False)
    try:
        step, state = restore_step(run, step)
        params = loop.host_params(run, state)
    finally:
        run.checkpointer.close()
    return Loaded(model=run.model, params=params, tokenizer=run.tokenizer, config=run.config, step=step)


def open_run(workdir: str, *, mesh_shape: tuple[int, ...] | None = None, batches: bool = True):
    """A `loop.Run` of an existing workdir, for evaluation (fails if the workdir has no run); `batches=False`
    when only its params are wanted (`loop.build`)."""
    from lmzoo.train import loop

    config = config_lib.load_saved(workdir)
    if mesh_shape is not None:
        config.sharding.mesh_shape = tuple(mesh_shape)
    elif int(np.prod([abs(x) for x in config.sharding.mesh_shape])) > jax.device_count():
        config.sharding.mesh_shape = (-1, 1, 1)
    if not (pathlib.Path(workdir) / "tokenizer" / "spec.json").exists():
        raise FileNotFoundError(f"{workdir}/tokenizer is missing: is {workdir!r} the workdir of a train.py run?")
    return loop.build(config, workdir, batches=batches)


def restore_step(run, step: int | None = None) -> tuple[int, Any]:
    """(step, state) of the latest checkpoint that restores, or of `step`; frozen parameters left out."""
    if step is None:
        restored = run.checkpointer.restore_latest(run.abstract_state)
        if restored is None:
            raise FileNotFoundError(f"no checkpoint found in {run.checkpointer.directory}; train first with train.py --workdir={run.workdir}")
        return restored[0], restored[1]
    if step not in run.checkpointer.steps():
        raise FileNotFoundError(f"no checkpoint for step {step} in {run.checkpointer.directory}; kept steps: {run.checkpointer.steps()}")
    return step, run.checkpointer.restore(step, run.abstract_state)[0]


def read_params(spec: str, model_name: str, model_config, target, *, allow_partial: bool = False):
    """Params from "hf:PATH" (HuggingFace safetensors folder, converted to `model_config`'s layout) or
    "ckpt:WORKDIR" (another lmzoo run's latest checkpoint; a classifier run gives its backbone).

    allow_partial: an HF checkpoint that fits only in part gives the parameters that fit (see
    `lmzoo.convert.hf.convert_pretrained`) instead of an error."""
    if spec.startswith("hf:"):
        from lmzoo.convert import hf

        return hf.convert_pretrained(spec, model_name, model_config, target, allow_partial=allow_partial)[0]
    if spec.startswith("ckpt:"):
        source = load(spec.removeprefix("ckpt:")).params
        return source.get("backbone", source)
    raise ValueError(f"pretrained weights spec {spec!r} must be 'hf:PATH' or 'ckpt:WORKDIR'")


TOKEN_TABLES = ("wte/embedding",)  # token embeddings that may gain rows for new special tokens (GPT classifier)


def merge_pretrained(fresh, source, model_name: str, model_config=None, *, name: str | None = None, allow_partial: bool = False):
    """`fresh` params with every parameter `source` (params, or a read_params spec, read for `model_config`
    with `allow_partial`) provides replaced.

    A classifier takes the weights into its backbone and keeps its new head; pretraining heads the
    target lacks are dropped. A token table (TOKEN_TABLES) with more rows than the source's keeps its
    new rows' fresh init (added special tokens), and says so; any other shape mismatch is an error.
    """
    name = name or str(source)
    target = fresh["backbone"] if "backbone" in fresh else fresh
    if isinstance(source, str):
        source = read_params(source, model_name, model_config, target, allow_partial=allow_partial)
    flat_target, flat_source = traverse_util.flatten_dict(target, sep="/"), traverse_util.flatten_dict(source, sep="/")
    grown = {k for k, v in flat_target.items() if k in TOKEN_TABLES and k in flat_source
             and flat_source[k].shape[1:] == v.shape[1:] and flat_source[k].shape[0] < v.shape[0]}  # fmt: skip
    mismatched = [f"{k}: {flat_source[k].shape} vs model {v.shape}" for k, v in flat_target.items()
                  if k in flat_source and k not in grown and flat_source[k].shape != v.shape]  # fmt: skip
    if mismatched:
        raise ValueError(f"weights from {name} do not fit the configured model:\n  " + "\n  ".join(mismatched))
    loaded = {k: np.asarray(flat_source[k], dtype=v.dtype) if k in flat_source else v for k, v in flat_target.items()}
    for k in grown:
        loaded[k] = np.concatenate([loaded[k], np.asarray(flat_target[k])[len(loaded[k]) :]])
    fresh_keys = sorted(set(flat_target) - set(flat_source))
    if jax.process_index() == 0:
        print(f"{name}: loaded {len(flat_target) - len(fresh_keys)} parameters; newly initialised: {fresh_keys or 'none'}")
        for k in sorted(grown):
            print(f"{name}: {k} has {len(flat_source[k])} pretrained rows; rows {len(flat_source[k])}.."
                  f"{len(flat_target[k]) - 1} (new tokens) keep their fresh initialisation")  # fmt: skip
    merged = traverse_util.unflatten_dict(loaded, sep="/")
    return {**fresh, "backbone": merged} if "backbone" in fresh else merged
