"""Low-rank adapters attached beside a module's kernels, applied where the module runs.

A kernel leaf `name` [*batch, *inputs, *outputs] (batch: per-expert axes) may carry two siblings in its module's
params, `name + "_lora_a"` [*batch, *inputs, r] and `name + "_lora_b"` [*batch, r, *outputs], the adapters' scale
already in B. Two ways run them:

- on activations, inside `on_activations` (LoRA's training form): a projection module (`layers.linears.Einsum`,
  flax's `nn.Dense`) whose "kernel" carries them computes x W + dropout(x) A B, as PEFT does: no merged kernel and
  no gradient of W are formed, and the adapters' inputs can be dropped;
- merged, W + A B (`merge_attached`), for the kernels no projection module owns (experts' stacked weights) and for
  every kernel outside `on_activations`: `layers.blocks.BlockStack` merges a scanned stack's inside its scan, one
  layer at a time, so a merged kernel and its gradient exist for one layer, not for the whole stack.

`lmzoo.lora.attach` puts adapters there (`lmzoo.lora` is LoRA itself: targets, init, export).
"""

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lmzoo.layers.linears import Einsum, project

SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"
PROJECTION_KERNEL = "kernel"  # the kernel leaf of a projection module, which applies its adapters on activations


def fit(kernel_shape: tuple[int, ...], a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(batch axes, input axes) that make A [*batch, *inputs, r] and B [*batch, r, *outputs] fit the kernel
    [*batch, *inputs, *outputs]; None when they do not."""
    batch = len(a_shape) + len(b_shape) - len(kernel_shape) - 2
    inputs = len(a_shape) - batch - 1
    if batch < 0 or inputs < 1 or len(b_shape) - batch - 1 < 1:
        return None
    r = a_shape[-1]
    fits = (
        a_shape[:batch] == b_shape[:batch]
        and b_shape[batch] == r
        and kernel_shape == (*a_shape[:-1], *b_shape[batch + 1 :])
    )
    return (batch, inputs) if fits else None


def delta(a: jax.Array, b: jax.Array, batch: int, dtype: Any) -> jax.Array:
    """A B over the rank axis: [*batch, *inputs, r] x [*batch, r, *outputs] -> [*batch, *inputs, *outputs]."""
    letters = iter("abcdefghijklmnopqstuvwxyz")  # "r" is the rank
    lead = "".join(next(letters) for _ in range(batch))
    ins = "".join(next(letters) for _ in range(a.ndim - batch - 1))
    outs = "".join(next(letters) for _ in range(b.ndim - batch - 1))
    return jnp.einsum(
        f"{lead}{ins}r,{lead}r{outs}->{lead}{ins}{outs}",
        a,
        b,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=dtype,
    )


def merged_kernel(kernel: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """kernel + A B, in the promoted dtype of the three (a bfloat16 kernel with float32 adapters merges to float32,
    so that small adapter updates are not rounded away). A and B must `fit` the kernel."""
    batch, _ = fit(tuple(kernel.shape), tuple(a.shape), tuple(b.shape))
    dtype = jnp.result_type(kernel.dtype, a.dtype, b.dtype)
    return jnp.asarray(kernel, dtype) + delta(a, b, batch, dtype)


def merge_attached(params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` (a module's nested dict) with every kernel that carries attached adapters replaced by
    `merged_kernel` and the adapters dropped, but for projection kernels inside `on_activations` (their modules
    apply them); unchanged where none are attached."""
    merged, keep_projections = {}, _applied.form is not None
    for name, value in params.items():
        if name.endswith((SUFFIX_A, SUFFIX_B)) and not (keep_projections and name.startswith(PROJECTION_KERNEL + "_")):
            continue
        if isinstance(value, Mapping):
            value = merge_attached(value)
        elif name + SUFFIX_A in params and not (keep_projections and name == PROJECTION_KERNEL):
            value = merged_kernel(value, params[name + SUFFIX_A], params[name + SUFFIX_B])
        merged[name] = value
    return merged


class _ActivationForm:
    """What `on_activations` holds while it is active: the adapters' input dropout, the projection kernels given
    adapters to apply (`attached`, by module path) and the modules that applied them."""

    def __init__(self, dropout_rate: float):
        self.dropout_rate = dropout_rate
        self.attached: set[tuple[str, ...]] = set()
        self.applied: set[tuple[str, ...]] = set()


class _Applied(threading.local):
    form: _ActivationForm | None = None


_applied = _Applied()


def attach_to_projection(module: tuple[str, ...]) -> bool:
    """Inside `on_activations`: records that the projection kernel of `module` (its path) gets attached adapters,
    which its module must apply, and returns True; outside, False (the kernel is to be merged)."""
    if _applied.form is None:
        return False
    _applied.form.attached.add(tuple(module))
    return True


@contextlib.contextmanager
def on_activations(dropout_rate: float = 0.0) -> Iterator[None]:
    """Within (while a model is applied or traced), every `Einsum` or `nn.Dense` whose "kernel" carries attached
    adapters returns x W + dropout(x) A B (B holding the scale): inverted dropout of `dropout_rate` on the adapters'
    inputs only, drawn from the "dropout" rng stream (which the apply must then be given). On leaving, a projection
    kernel given adapters (`attach_to_projection`) whose module did not apply them is a ValueError: no adapter is
    dropped silently."""
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"adapter dropout {dropout_rate!r} must be in [0, 1)")
    outer, form = _applied.form, _ActivationForm(dropout_rate)
    _applied.form = form
    try:
        with nn.intercept_methods(_projection_with_adapters):
            yield
    finally:
        _applied.form = outer
    unapplied = sorted("/".join(path) for path in form.attached - form.applied)
    if unapplied:
        raise ValueError(
            f"adapters were attached to the kernels of {', '.join(unapplied)}, whose modules did not apply them: "
            "only an Einsum (lmzoo.layers.linears) or an nn.Dense applies adapters at its inputs; leave those modules "
            "out of the LoRA targets"
        )


def _projection_with_adapters(next_fun, args, kwargs, context):
    """`on_activations`' flax interceptor: a projection's output, plus its attached adapters' at its inputs."""
    module = context.module
    if (
        context.method_name != "__call__"
        or not isinstance(module, Einsum | nn.Dense)
        or not module.has_variable("params", PROJECTION_KERNEL + SUFFIX_A)
    ):
        return next_fun(*args, **kwargs)
    y = next_fun(*args, **kwargs)
    a = module.get_variable("params", PROJECTION_KERNEL + SUFFIX_A)
    b = module.get_variable("params", PROJECTION_KERNEL + SUFFIX_B)
    if isinstance(module, Einsum):
        eqn, x = args[0] if args else kwargs["eqn"], args[1] if len(args) > 1 else kwargs["x"]
    else:
        x = args[0] if args else kwargs["inputs"]
        letters = "abcdefghijklmnopq"[: x.ndim - 1]
        eqn = f"{letters}y,yz->{letters}z"
    form = _applied.form
    if form.dropout_rate:
        keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - form.dropout_rate, x.shape)
        x = jnp.where(keep, x / (1.0 - form.dropout_rate), 0.0).astype(x.dtype)
    form.applied.add(tuple(module.path))
    return y + low_rank_projection(eqn, x, a, b).astype(y.dtype)


def low_rank_projection(eqn: str, x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """`einsum(eqn, x, A B)` without forming A B: x A [.., r], then B. `eqn` is the projection's ("BTD,DNH->BTNH"),
    its kernel [*inputs, *outputs] split where A's rank axis stands."""
    inputs, output = eqn.replace(" ", "").split("->")
    x_spec, kernel_spec = inputs.split(",")
    rank = next(letter for letter in "rRzZyYqQ" if letter not in eqn)
    kernel_in, kernel_out = kernel_spec[: a.ndim - 1], kernel_spec[a.ndim - 1 :]
    kept = "".join(letter for letter in x_spec if letter not in kernel_in)
    dtype = jnp.result_type(x.dtype, a.dtype)
    h = project(f"{x_spec},{kernel_in}{rank}->{kept}{rank}", x.astype(dtype), a.astype(dtype))
    return project(f"{kept}{rank},{rank}{kernel_out}->{output}", h, b.astype(dtype))
