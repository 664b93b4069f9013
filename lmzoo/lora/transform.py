"""LoRA (Hu et al. 2021) for every family, as a transform of the parameter tree: no model code changes.

A targeted kernel W gets two adapter matrices, A (its inputs -> rank r) and B (r -> its outputs), and the model runs
on W + scale * A B, scale = alpha / r (rsLoRA: alpha / sqrt(r)). A starts uniform in +-1/sqrt(fan_in) and B at zero,
as PEFT's default, so the adapted model starts as the base. Training differentiates only the adapters (`lora_loss`):
the optimizer state covers them alone, and the base, frozen, may be held in bfloat16 (`freeze`).

Which axes of a kernel are its inputs: lmzoo kernels are [*inputs, *outputs], after leading per-layer ("layers", a
scanned stack) and per-expert ("exp") axes, each of which gets adapters of its own. Their logical axes say where the
inputs end: the model width "embed" stands alone on its side, so query/key/value (embed | heads, kv) take their inputs
from one axis and the attention output (heads, kv | embed) from two; a 2-D kernel is [in, out]. A kernel without
logical axes (a plain `nn.Dense`) must be 2-D. The adapters keep that structure, A [*batch, *inputs, r] and
B [*batch, r, *outputs], boxed with the kernel's logical names (the rank axis replicated), so they shard with it on
any mesh, and `merge` reads the split back from their shapes.

Targets: a regular expression that must fullmatch a kernel's module name ("query", "wi_0") or a trailing part of its
'/'-joined path ("attn/(query|value)", "blocks/layer_0/attn/query"). lmzoo's names: attention query, key, value,
out; feed-forward wi (wi_0, wi_1 gated) and wo; MoE experts' wi_0, wi_1, wo; lm_head, router. A kernel is a leaf
named "kernel", or an experts' weight (first axis "exp", after "layers"); embedding tables are never targets.

The training form (`attach`, applied inside `training_form`, as `lora_loss` does) equals the merged one and needs no
module to know about adapters: every projection kernel of a block stack's layers carries A and scale B beside it and
its module (an Einsum or nn.Dense) adds dropout(x) A (scale B) at its inputs (`layers.adapters`), as PEFT does, so
neither a merged kernel nor the frozen kernel's gradient is formed. Experts' weights are merged, a scanned stack's one
layer at a time inside its rematerialised scan body (`layers.blocks.BlockStack`), and heads outside the layers up
front, whole. Dropout (PEFT's lora_dropout) drops the layers' projection adapters' inputs while training.

Modules trained in full beside the adapters (`train_in_full`, PEFT's modules_to_save): a new head that no base
provides (a classifier's or reward model's "classifier", PPO's "value_head") cannot stay frozen at its random start.
The trained tree holds them at their own paths next to the adapters, so `merge` puts them in place of the base's.

PEFT's adapter files (adapter_config.json + adapter_model.safetensors) are read and written by
`lmzoo.lora.peft`.
"""

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from lmzoo.layers import adapters as adapters_lib
from lmzoo.layers import blocks

Params = Any
BATCH_AXES = ("layers", "exp")  # leading axes whose every slice is a kernel of its own, with adapters of its own
LORA_A, LORA_B = "lora_a", "lora_b"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What to adapt and how.

    Attributes:
        targets: regular expression over module names or trailing paths ("query|key|value|out", "wi_0|wi_1|wo").
        rank: r, at least 1 and at most min(inputs, outputs) of every targeted kernel.
        alpha: the adapters' product is scaled by alpha / r (alpha / sqrt(r) with rslora).
        dropout: PEFT's lora_dropout: the inputs of the layers' projection adapters are dropped while training.
        base_dtype: dtype the frozen base's matrices are held in ("bfloat16"); None keeps theirs.
        rslora: rank-stabilised scaling, alpha / sqrt(r) (PEFT's use_rslora).
        train_in_full: regular expression over module names or trailing paths, as targets, of modules trained in
            full beside the adapters (PEFT's modules_to_save: "classifier"); "" for none.
    """

    targets: str
    rank: int
    alpha: float
    dropout: float = 0.0
    base_dtype: str | None = None
    rslora: bool = False
    train_in_full: str = ""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank!r} must be an integer >= 1 (PEFT's r; 8 or 16 are common)")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha={self.alpha!r} must be > 0 (the adapters are scaled by alpha / rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout={self.dropout!r} must be in [0, 1)")
        if self.base_dtype is not None and not jnp.issubdtype(jnp.dtype(self.base_dtype), jnp.floating):
            raise ValueError(f"LoRA base_dtype={self.base_dtype!r} must be a float dtype (e.g. 'bfloat16') or None")
        for field in ("targets", "train_in_full"):
            try:
                re.compile(getattr(self, field))
            except (re.error, TypeError) as e:
                raise ValueError(f"LoRA {field}={getattr(self, field)!r} is not a regular expression: {e}") from None

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class Kernel(NamedTuple):
    """One targeted kernel: where its leaf is, and its axes [*batch, *inputs, *outputs] by count."""

    leaf: tuple[str, ...]
    shape: tuple[int, ...]
    names: tuple[str | None, ...] | None
    batch: int
    inputs: int

    @property
    def fan_in(self) -> int:
        return math.prod(self.shape[self.batch : self.batch + self.inputs])

    @property
    def fan_out(self) -> int:
        return math.prod(self.shape[self.batch + self.inputs :])


def _module(leaf: tuple[str, ...]) -> tuple[str, ...]:
    """A kernel's module path: its leaf path without the trailing "kernel"."""
    return leaf[:-1] if leaf[-1] == "kernel" else leaf


def _batch_axes(names: tuple | None) -> int:
    """How many leading axes are per-layer or per-expert ("layers", "exp")."""
    batch = 0
    while names is not None and batch < len(names) and names[batch] in BATCH_AXES:
        batch += 1
    return batch


def _is_kernel(leaf: tuple[str, ...], names: tuple | None, ndim: int) -> bool:
    """A leaf named "kernel", or an experts' weight (axes "exp", ...), with two or more axes besides the batch ones."""
    batch = _batch_axes(names)
    experts = names is not None and "exp" in names[:batch] and leaf[-1] != "embedding"
    return (leaf[-1] == "kernel" or experts) and ndim - batch >= 2


def _split(leaf: tuple[str, ...], shape: tuple[int, ...], names: tuple | None) -> tuple[int, int]:
    """(batch axes, input axes) of a kernel, from its logical names (module docstring)."""
    if names is None:
        if len(shape) != 2:
            raise ValueError(
                f"kernel {'/'.join(leaf)} of shape {shape} carries no logical axes, so which of its axes are inputs "
                "is unknown; pass the boxed params (as model.init returns them, or jax.eval_shape of it)"
            )
        return 0, 1
    batch = _batch_axes(names)
    rest = names[batch:]
    if len(rest) == 2 or (len(rest) > 2 and rest[0] == "embed"):
        return batch, 1
    if len(rest) > 2 and rest[-1] == "embed":
        return batch, len(rest) - 1
    raise ValueError(
        f"kernel {'/'.join(leaf)} has logical axes {names}: LoRA needs [*inputs, *outputs] with 'embed' alone on one "
        "side (or two axes after 'layers' / 'exp')"
    )


def _matches(pattern: re.Pattern, module: tuple[str, ...]) -> bool:
    return any(pattern.fullmatch("/".join(module[i:])) for i in range(len(module)))


def _trained_in_full(config: LoraConfig, leaf: tuple[str, ...]) -> bool:
    """Whether `leaf` lies in a module `config.train_in_full` selects (the pattern matches a prefix's trailing part)."""
    if not config.train_in_full:
        return False
    pattern = re.compile(config.train_in_full)
    return any(_matches(pattern, leaf[:end]) for end in range(1, len(leaf)))


def check_base(config: LoraConfig, source: str, fresh: Params, loaded: Params) -> None:
    """Refuses a base read from `source` (`loaded`, into a model whose fresh params are `fresh`; a classifier's base
    is its backbone) that leaves parameters as initialised outside the modules trained in full: frozen at their
    random start they would never learn."""
    prefix = ("backbone",) if "backbone" in fresh else ()
    read = {(*prefix, *path) for path in traverse_util.flatten_dict(loaded)}
    missing = sorted(
        "/".join(path)
        for path in traverse_util.flatten_dict(fresh)
        if path not in read and not _trained_in_full(config, path)
    )
    if missing:
        raise ValueError(
            f"config.lora.targets={config.targets!r} trains adapters over a frozen base, but config.init_from="
            f"{source!r} leaves parameters that would stay as initialised ({', '.join(missing[:4])}): train them in "
            "full beside the adapters (--config.lora.train_in_full='MODULE|...') or train this run without LoRA "
            "(--config.lora.targets='')"
        )


def find_kernels(params: Params, config: LoraConfig) -> dict[tuple[str, ...], Kernel]:
    """The kernels `config.targets` selects, by module path, outside the modules trained in full; params boxed (names
    known) or not (2-D kernels only). A pattern that matches no kernel, or a rank above a kernel's min(inputs,
    outputs), is a ValueError."""
    pattern = re.compile(config.targets)
    flat = traverse_util.flatten_dict(params, keep_empty_nodes=False)
    found, candidates = {}, {}
    for leaf, value in flat.items():
        if _trained_in_full(config, leaf):
            continue
        boxed = isinstance(value, nn.Partitioned)
        names, shape = (tuple(value.names) if boxed else None), tuple((value.value if boxed else value).shape)
        if not _is_kernel(leaf, names, len(shape)):
            continue
        module = _module(leaf)
        candidates.setdefault(module[-1], None)
        if _matches(pattern, module):
            found[module] = Kernel(leaf, shape, names, *_split(leaf, shape, names))
    if not found:
        raise ValueError(
            f"LoRA targets={config.targets!r} match no kernel of these params; a pattern fullmatches a module name "
            f"or a trailing part of its path (e.g. 'attn/query'); the module names here: {', '.join(candidates)}"
        )
    too_large = [
        f"{'/'.join(module)} ({k.fan_in} -> {k.fan_out})"
        for module, k in found.items()
        if config.rank > min(k.fan_in, k.fan_out)
    ]
    if too_large:
        raise ValueError(
            f"LoRA rank={config.rank} exceeds min(inputs, outputs) of {', '.join(too_large)}; choose a rank of at "
            "most the smallest of these, or leave those modules out of targets"
        )
    return found


def _boxed(value: jax.Array, names: tuple | None) -> Any:
    return value if names is None else nn.LogicallyPartitioned(value, names)


def init_adapters(rng: jax.Array, params: Params, config: LoraConfig) -> Params:
    """The trained tree over `params` (arrays or ShapeDtypeStructs, boxed or not): adapters for the kernels
    `config.targets` selects, {module path...: {"lora_a": [*batch, *inputs, r], "lora_b": [*batch, r, *outputs]}} in
    float32, A uniform in +-1/sqrt(fan_in) (PEFT's kaiming_uniform(a=sqrt(5))), B zero, boxed with logical axes when
    `params` are; and the leaves of the modules `config.train_in_full` selects, as `params` holds them."""
    kernels = find_kernels(params, config)
    flat = traverse_util.flatten_dict(params, keep_empty_nodes=False)
    if config.train_in_full and not any(_trained_in_full(config, leaf) for leaf in flat):
        raise ValueError(
            f"LoRA train_in_full={config.train_in_full!r} matches no module of these params; a pattern fullmatches a "
            "module name or a trailing part of its path (e.g. 'classifier')"
        )
    r, adapters = config.rank, {leaf: value for leaf, value in flat.items() if _trained_in_full(config, leaf)}
    for i, (module, k) in enumerate(sorted(kernels.items())):
        batch, ins, outs = k.shape[: k.batch], k.shape[k.batch : k.batch + k.inputs], k.shape[k.batch + k.inputs :]
        bound = 1.0 / math.sqrt(k.fan_in)
        a = jax.random.uniform(jax.random.fold_in(rng, i), (*batch, *ins, r), jnp.float32, -bound, bound)
        b = jnp.zeros((*batch, r, *outs), jnp.float32)
        names = k.names
        adapters[(*module, LORA_A)] = _boxed(a, None if names is None else (*names[: k.batch + k.inputs], None))
        adapters[(*module, LORA_B)] = _boxed(
            b, None if names is None else (*names[: k.batch], None, *names[k.batch + k.inputs :])
        )
    return traverse_util.unflatten_dict(adapters)


def trained_in_full(trained: Params) -> dict[tuple[str, ...], Any]:
    """{leaf path: value} of the leaves of a trained tree that are not adapters: the modules trained in full."""
    flat = traverse_util.flatten_dict(nn.unbox(trained), keep_empty_nodes=False)
    return {path: value for path, value in flat.items() if path[-1] not in (LORA_A, LORA_B)}


def adapter_pairs(trained: Params) -> dict[tuple[str, ...], tuple[Any, Any]]:
    """{module path: (A, B)} of a trained tree's adapters (its modules trained in full left out); a module with only
    one of the two is a ValueError."""
    flat = traverse_util.flatten_dict(nn.unbox(trained), keep_empty_nodes=False)
    pairs: dict[tuple[str, ...], dict[str, Any]] = {}
    for path, value in flat.items():
        if path[-1] in (LORA_A, LORA_B):
            pairs.setdefault(path[:-1], {})[path[-1]] = value
    lone = ["/".join(module) for module, pair in pairs.items() if len(pair) != 2]
    if lone:
        raise ValueError(f"adapters of {lone} lack {LORA_A} or {LORA_B}")
    return {module: (pair[LORA_A], pair[LORA_B]) for module, pair in pairs.items()}


def _combine(params: Params, adapters: Params, config: LoraConfig, *, attaching: bool) -> Params:
    """`merge`, or `attach` when `attaching`: the kernels it leaves unmerged (see `attach`) get A and scale B
    beside them. Adapters that do not fit the params are a ValueError naming every module."""
    flat = traverse_util.flatten_dict(nn.unbox(params), keep_empty_nodes=False)
    problems, combined = [], {}
    for leaf, value in trained_in_full(adapters).items():
        if leaf in flat and tuple(flat[leaf].shape) != tuple(value.shape):
            problems.append(f"{'/'.join(leaf)}: {tuple(flat[leaf].shape)} in the params, {tuple(value.shape)} trained")
        combined[leaf] = value
    for module, (a, b) in adapter_pairs(adapters).items():
        leaf = (*module, "kernel") if (*module, "kernel") in flat else module
        if leaf not in flat:
            problems.append(f"{'/'.join(module)}: no such kernel in the params")
            continue
        w = flat[leaf]
        if adapters_lib.fit(tuple(w.shape), tuple(a.shape), tuple(b.shape)) is None:
            problems.append(
                f"{'/'.join(module)}: kernel {tuple(w.shape)}, adapters {LORA_A} {tuple(a.shape)} and "
                f"{LORA_B} {tuple(b.shape)}"
            )
            continue
        scaled_b = config.scale * b
        layer_projection = leaf[-1] == adapters_lib.PROJECTION_KERNEL and any(blocks.is_layer(n) for n in module)
        if attaching and ((layer_projection and adapters_lib.attach_to_projection(module)) or blocks.SCANNED in module):
            combined[(*leaf[:-1], leaf[-1] + adapters_lib.SUFFIX_A)] = a
            combined[(*leaf[:-1], leaf[-1] + adapters_lib.SUFFIX_B)] = scaled_b
        else:
            combined[leaf] = adapters_lib.merged_kernel(w, a, scaled_b)
    if problems:
        raise ValueError(
            "these adapters do not fit the params (adapters of another base model, or of another config.model?): "
            + "; ".join(problems)
        )
    return traverse_util.unflatten_dict(flat | combined)


def merge(params: Params, adapters: Params, config: LoraConfig) -> Params:
    """`params` (unboxed: boxed ones are unboxed) with each adapted kernel W replaced by W + A (scale B), in the
    promoted dtype of W and the adapters (a bfloat16 base with float32 adapters merges to float32), and the modules
    trained in full (`adapters`' other leaves) in place of the base's: the weights to evaluate and export. Adapters
    that do not fit the params (another base model's) are a ValueError naming every module and its shapes."""
    return _combine(params, adapters, config, attaching=False)


def attach(params: Params, adapters: Params, config: LoraConfig) -> Params:
    """The training form of `merge`, equal to it in value, its kernels carrying their adapters beside them
    (`layers.adapters`). Inside `training_form`, every projection kernel ("kernel": an Einsum's or nn.Dense's) of a
    block stack's layers does, and its module applies them at its inputs, so no merged kernel nor gradient of the
    base kernel is formed. The other kernels (experts' weights), and every kernel outside `training_form`: a scanned
    stack's (`layers.blocks.SCANNED`) are merged one layer at a time inside its scan, so that merged kernels and their
    gradients exist for one layer, not for every layer at once; the rest (heads, which losses may read as matrices)
    are merged here."""
    return _combine(params, adapters, config, attaching=True)


def freeze(params: Params, config: LoraConfig) -> Params:
    """The frozen base: `params` (boxed or not) with every float matrix in `config.base_dtype` (None: unchanged).
    Vectors (norm scales, biases) keep their dtype: they are small, and rounding them gains nothing."""
    if config.base_dtype is None:
        return params
    dtype = jnp.dtype(config.base_dtype)

    def cast(x):
        return x.astype(dtype) if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, params)


@contextlib.contextmanager
def training_form(config: LoraConfig, *, train: bool) -> Iterator[None]:
    """The context `attach`'s params are applied in to train: projections apply their adapters at their inputs, with
    `config.dropout` on those inputs when `train` (the apply must then be given a "dropout" rng); see
    `layers.adapters.on_activations`."""
    with adapters_lib.on_activations(config.dropout if train else 0.0):
        yield


def lora_loss(loss_fn: Callable[..., Any], config: LoraConfig) -> Callable[..., Any]:
    """The training form: `loss_fn(params, *args, **kwargs)` as a function of (adapters, base, *args, **kwargs), the
    model applied to attach(base, adapters) in `training_form`, its dropout on when the call passes train=True (the
    Task protocol's flag); differentiate its first argument. The base is behind a stop_gradient."""

    def loss(adapters: Params, base: Params, *args: Any, **kwargs: Any) -> Any:
        with training_form(config, train=kwargs.get("train") is True):
            return loss_fn(attach(jax.lax.stop_gradient(base), adapters, config), *args, **kwargs)

    return loss


def count(adapters: Params) -> int:
    """The number of trained parameters: the adapters and the modules trained in full."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(adapters)))


def from_config(config: Any) -> LoraConfig | None:
    """A run config's `lora` section (a ConfigDict, or the dict a run saved) as a LoraConfig; None when LoRA is off
    (targets ""). Bad values are a ValueError naming the field."""
    section = config.get("lora") if config is not None else None
    if section is None:
        return None
    fields = dict(section.to_dict() if hasattr(section, "to_dict") else section)
    if not fields.get("targets"):
        return None
    fields["base_dtype"] = fields.get("base_dtype") or None
    try:
        return LoraConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.lora: {e}") from None
