"""The one train-step and eval-step builder, for every family and objective.

`make_train_step(task, tx, schedule)` returns a pure `(state, batch) -> (state, metrics)` that
`lmzoo.train.loop` jits with shardings derived from the logical-axis rules. Gradient
accumulation scans over microbatches (the scalar loss of each microbatch is averaged; metrics
are exact (sum, count) pairs).
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lmzoo import sharding
from lmzoo.train.state import Metrics, Task, TrainState


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


def split_microbatches(batch: dict[str, jax.Array], count: int) -> dict[str, jax.Array]:
    """[B, ...] -> [count, B / count, ...]; microbatch i takes rows i, i + count, ... so that each
    microbatch stays spread over every data-parallel device."""

    def split(x):
        if x.shape[0] % count:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by grad_accum_steps={count}")
        x = x.reshape((x.shape[0] // count, count) + x.shape[1:]).swapaxes(0, 1)
        return sharding.constrain(x, (None, "act_batch") + (None,) * (x.ndim - 2))

    return jax.tree.map(split, batch)


def make_train_step(task: Task, tx: optax.GradientTransformation, schedule: optax.Schedule, *, grad_accum_steps: int = 1):
    """(state, batch) -> (state, metrics); metrics add grad_norm and learning_rate."""
    grad_fn = jax.value_and_grad(functools.partial(task.loss, train=True), has_aux=True)

    def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, Metrics]:
        rng, step_rng = jax.random.split(jax.random.wrap_key_data(state.rng))
        if grad_accum_steps == 1:
            (_, (metrics, carry)), grads = grad_fn(state.params, state.frozen, state.carry, batch, step_rng)
        else:
            micro = split_microbatches(batch, grad_accum_steps)
            first = jax.tree.map(lambda x: x[0], micro)
            (_, (metrics_shape, _)), grads_shape = jax.eval_shape(grad_fn, state.params, state.frozen, state.carry, first, step_rng)
            zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731

            def accumulate(acc, xs):
                grads_sum, metrics_sum, carry = acc
                micro_batch, index = xs
                (_, (m, carry)), g = grad_fn(state.params, state.frozen, carry, micro_batch, jax.random.fold_in(step_rng, index))
                return (_add(grads_sum, g), _add(metrics_sum, m), carry), None

            init = (zeros(grads_shape), zeros(metrics_shape), state.carry)
            (grads, metrics, carry), _ = jax.lax.scan(accumulate, init, (micro, jnp.arange(grad_accum_steps)))
            grads = jax.tree.map(lambda g: g / grad_accum_steps, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        one = jnp.ones((), jnp.float32)
        metrics = dict(metrics, grad_norm=(optax.global_norm(grads), one), learning_rate=(schedule(state.step), one))
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, rng=jax.random.key_data(rng), carry=carry
        )
        return new_state, metrics

    return train_step


def make_eval_step(task: Task):
    """(state, batch) -> metrics, deterministic (dropout off, fixed rng)."""

    def eval_step(state: TrainState, batch: dict[str, jax.Array]) -> Metrics:
        _, (metrics, _) = task.loss(state.params, state.frozen, state.carry, batch, jax.random.key(0), train=False)
        return metrics

    return eval_step


@dataclasses.dataclass
class CompiledTask:
    """A task's train state and steps, jitted over a mesh with shardings from the logical-axis rules.

    init(rng) -> TrainState; train_step(state, batch) -> (state, metrics) donates the old state;
    eval_step(state, batch) -> metrics. Call them inside `context()`.
    """

    mesh: jax.sharding.Mesh
    rules: tuple
    abstract_state: TrainState  # ShapeDtypeStructs carrying the shardings (orbax restore targets)
    state_shardings: TrainState
    batch_sharding: jax.sharding.NamedSharding
    init: Callable[[jax.Array], TrainState]
    train_step: Callable
    eval_step: Callable

    @contextlib.contextmanager
    def context(self):
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            yield


def compile_task(
    task: Task,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    sample_batch: dict[str, np.ndarray],
    *,
    mesh: jax.sharding.Mesh,
    rules: tuple,
    seed: int,
    grad_accum_steps: int = 1,
) -> CompiledTask:
    """Shardings for the state (from the params' logical axes; optimizer state follows its params)
    and the batch (batch axis over data and fsdp), and the jitted init/train/eval functions.

    sample_batch: arrays of the global batch shape (values unused).
    """

    def init_state(rng):
        params_rng, state_rng = jax.random.split(rng)
        params, frozen, carry = task.init(params_rng, sample_batch)
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
            rng=jax.random.key_data(state_rng), frozen=frozen, carry=carry,
        )  # fmt: skip

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(init_state, jax.random.key(seed))
        state_shardings = sharding.logical_to_sharding(boxed, mesh, rules)
    # Unboxed outside the mesh context: inside it, unboxing would attach sharding constraints.
    abstract_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), state_shardings
    )
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        batch_sharding = sharding.batch_sharding(mesh, rules)
        replicated = sharding.replicated(mesh)
        return CompiledTask(
            mesh=mesh, rules=rules, abstract_state=abstract_state, state_shardings=state_shardings,
            batch_sharding=batch_sharding,
            init=jax.jit(lambda rng: nn.unbox(init_state(rng)), out_shardings=state_shardings),
            train_step=jax.jit(
                make_train_step(task, tx, schedule, grad_accum_steps=grad_accum_steps),
                in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, replicated), donate_argnums=0,
            ),
            eval_step=jax.jit(make_eval_step(task), in_shardings=(state_shardings, batch_sharding), out_shardings=replicated),
        )  # fmt: skip
