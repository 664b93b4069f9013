"""The supervised trainer: one optimizer update per step from the gradient of a `Task`'s loss."""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lmzoo.trainers.base import Batch, merge_microbatches, split_microbatches
from lmzoo.trainers.state import Metrics, Task, TrainState


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


@dataclasses.dataclass(frozen=True)
class SupervisedTrainer:
    """One optimizer update per step from the gradient of `task.loss` on one batch.

    Gradient accumulation scans over strided microbatches (each microbatch's scalar loss is averaged;
    metrics are exact (sum, count) pairs); a recurrent carry is split and merged with the same rows,
    so every row keeps its own state. Metrics add grad_norm and learning_rate.

    Attributes:
        task: the model and objective.
        tx: optimizer (`lmzoo.trainers.optim.make_optimizer`).
        schedule: its learning-rate schedule (logged).
        input_shapes: global-batch arrays `task.init` reads (values unused).
    """

    task: Task
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    input_shapes: dict[str, jax.ShapeDtypeStruct]
    grad_accum_steps: int = 1

    @property
    def batch_size(self) -> int:
        return next(iter(self.input_shapes.values())).shape[0]

    def init(self, rng: jax.Array) -> TrainState:
        params_rng, state_rng = jax.random.split(rng)
        batch = {k: jnp.zeros(s.shape, s.dtype) for k, s in self.input_shapes.items()}
        params, frozen = self.task.init(params_rng, batch)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.tx.init(params),
            rng=jax.random.key_data(state_rng),
            frozen=frozen,
            carry=self.task.initial_carry(self.batch_size),
        )

    def initial_carry(self, batch_size: int) -> Any:
        return self.task.initial_carry(batch_size)

    def model_params(self, state: TrainState) -> Any:
        """The params the model runs on (evaluation, generation, export): `task.model_params`."""
        return self.task.model_params(state.params, state.frozen)

    def with_params(self, state: TrainState, params: Any) -> TrainState:
        """`state` with other (e.g. pretrained) params and a fresh optimizer state for them."""
        return state.replace(params=params, opt_state=self.tx.init(params))

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        grad_fn = jax.value_and_grad(functools.partial(self.task.loss, step=state.step, train=True), has_aux=True)
        rng, step_rng = jax.random.split(jax.random.wrap_key_data(state.rng))
        count = self.grad_accum_steps
        if count == 1:
            (_, (metrics, carry)), grads = grad_fn(state.params, state.frozen, state.carry, batch, step_rng)
        else:
            micro, micro_carry = split_microbatches(batch, count), split_microbatches(state.carry, count)
            first = jax.tree.map(lambda x: x[0], (micro, micro_carry))
            (_, (metrics_shape, _)), grads_shape = jax.eval_shape(
                grad_fn, state.params, state.frozen, first[1], first[0], step_rng
            )
            zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731

            def accumulate(acc, xs):
                grads_sum, metrics_sum = acc
                micro_batch, carry, index = xs
                (_, (m, carry)), g = grad_fn(
                    state.params, state.frozen, carry, micro_batch, jax.random.fold_in(step_rng, index)
                )
                return (_add(grads_sum, g), _add(metrics_sum, m)), carry

            init = (zeros(grads_shape), zeros(metrics_shape))
            (grads, metrics), carries = jax.lax.scan(accumulate, init, (micro, micro_carry, jnp.arange(count)))
            grads = jax.tree.map(lambda g: g / count, grads)
            carry = merge_microbatches(carries)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        one = jnp.ones((), jnp.float32)
        metrics = dict(
            metrics, grad_norm=(optax.global_norm(grads), one), learning_rate=(self.schedule(state.step), one)
        )
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, rng=jax.random.key_data(rng), carry=carry
        )
        return new_state, metrics

    def eval_step(self, state: TrainState, batch: Batch, carry: Any) -> tuple[Metrics, Any]:
        """Deterministic loss metrics (dropout off, fixed rng) and the evaluation carry after `batch`."""
        _, (metrics, carry) = self.task.loss(
            state.params, state.frozen, carry, batch, jax.random.key(0), step=state.step, train=False
        )
        return metrics, carry
