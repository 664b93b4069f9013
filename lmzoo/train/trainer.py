"""The trainer protocol, the supervised trainer, and their compilation over a device mesh.

A trainer is two pure functions and a carry: `init(rng) -> state`, `step(state, batch) -> (state,
metrics)`, and for evaluation `initial_carry(batch_size)` and `eval_step(state, batch, carry) ->
(metrics, carry)`. The loop (`lmzoo.train.loop`), checkpoints, preemption, metrics and evaluation
are written once around it, so a trainer may do anything inside `step`: one gradient update
(`SupervisedTrainer`), a rollout followed by epochs of minibatch updates (PPO), or counting with no
gradients at all; `with_params(state, params)` puts other (pretrained) params into a fresh state.
A trainer whose step has parts worth timing names them in `phases` and runs one with
`run_phase(name, state, batch, carry) -> carry` (the first gets carry None, the last returns
(state, metrics)); its `step` is `run_phases`, and the loop runs the jitted phases one after another,
logging each one's wall time as `time/<phase>_ms`.
The state is a pytree with a `params` field (what evaluation and generation use: weights, or the
counts of a count-based model) and a `frozen` field (parameters read from elsewhere, never
checkpointed); its leaves may be boxed with logical axes (`nn.LogicallyPartitioned`), from
which `compile_trainer` derives every sharding.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from lmzoo import sharding
from lmzoo.train.state import Metrics, Task, TrainState

Batch = dict[str, jax.Array]


class Trainer(Protocol):
    def init(self, rng: jax.Array) -> Any: ...

    def step(self, state: Any, batch: Batch) -> tuple[Any, Metrics]: ...

    def initial_carry(self, batch_size: int) -> Any: ...

    def eval_step(self, state: Any, batch: Batch, carry: Any) -> tuple[Metrics, Any]: ...

    def with_params(self, state: Any, params: Any) -> Any: ...


def run_phases(trainer: Any, state: Any, batch: Batch) -> tuple[Any, Metrics]:
    """The step of a trainer with `phases`: each phase of `state` and `batch` in order, threading the carry."""
    carry = None
    for name in trainer.phases:
        carry = trainer.run_phase(name, state, batch, carry)
    return carry


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


def split_microbatches(tree: Any, count: int) -> Any:
    """[B, ...] -> [count, B / count, ...]; microbatch i takes rows i, i + count, ... so that each
    microbatch stays spread over every data-parallel device."""

    def split(x):
        if x.shape[0] % count:
            raise ValueError(f"batch size {x.shape[0]} is not divisible by grad_accum_steps={count}")
        x = x.reshape((x.shape[0] // count, count) + x.shape[1:]).swapaxes(0, 1)
        return sharding.constrain(x, (None, "act_batch") + (None,) * (x.ndim - 2))

    return jax.tree.map(split, tree)


def merge_microbatches(tree: Any) -> Any:
    """Inverse of `split_microbatches`: [count, B / count, ...] -> [B, ...] with row i back in place."""
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), tree)


@dataclasses.dataclass(frozen=True)
class SupervisedTrainer:
    """One optimizer update per step from the gradient of `task.loss` on one batch.

    Gradient accumulation scans over strided microbatches (each microbatch's scalar loss is averaged;
    metrics are exact (sum, count) pairs); a recurrent carry is split and merged with the same rows,
    so every row keeps its own state. Metrics add grad_norm and learning_rate.

    Attributes:
        task: the model and objective.
        tx: optimizer (`lmzoo.train.optim.make_optimizer`).
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
            step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
            rng=jax.random.key_data(state_rng), frozen=frozen, carry=self.task.initial_carry(self.batch_size),
        )  # fmt: skip

    def initial_carry(self, batch_size: int) -> Any:
        return self.task.initial_carry(batch_size)

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
            (_, (metrics_shape, _)), grads_shape = jax.eval_shape(grad_fn, state.params, state.frozen, first[1], first[0], step_rng)
            zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731

            def accumulate(acc, xs):
                grads_sum, metrics_sum = acc
                micro_batch, carry, index = xs
                (_, (m, carry)), g = grad_fn(state.params, state.frozen, carry, micro_batch, jax.random.fold_in(step_rng, index))
                return (_add(grads_sum, g), _add(metrics_sum, m)), carry

            init = (zeros(grads_shape), zeros(metrics_shape))
            (grads, metrics), carries = jax.lax.scan(accumulate, init, (micro, micro_carry, jnp.arange(count)))
            grads = jax.tree.map(lambda g: g / count, grads)
            carry = merge_microbatches(carries)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        one = jnp.ones((), jnp.float32)
        metrics = dict(metrics, grad_norm=(optax.global_norm(grads), one), learning_rate=(self.schedule(state.step), one))
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


@dataclasses.dataclass
class CompiledTrainer:
    """A trainer's functions jitted over a mesh with shardings from the logical-axis rules.

    init(rng) -> state; step(state, batch) -> (state, metrics) donates the old state;
    initial_carry(batch_size) -> carry; eval_step(state, batch, carry) -> (metrics, carry);
    phases: {name: phase(state, batch, carry) -> carry} of a trainer with phases (the last donates the state),
    else empty. Call them inside `context()`.
    """

    trainer: Any
    mesh: jax.sharding.Mesh
    rules: tuple
    abstract_state: Any  # ShapeDtypeStructs carrying the shardings (orbax restore targets)
    state_shardings: Any
    batch_sharding: jax.sharding.NamedSharding
    init: Callable
    step: Callable
    eval_step: Callable
    with_params: Callable
    phases: dict[str, Callable] = dataclasses.field(default_factory=dict)

    @contextlib.contextmanager
    def context(self):
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            yield

    def initial_carry(self, batch_size: int) -> Any:
        """The trainer's zero carry for `batch_size` rows, sharded with its logical axes."""
        with self.context():
            boxed = jax.eval_shape(functools.partial(self.trainer.initial_carry, batch_size))
            shardings = sharding.logical_to_sharding(boxed, self.mesh, self.rules)
            return jax.jit(lambda: nn.unbox(self.trainer.initial_carry(batch_size)), out_shardings=shardings)()


def _with_shardings(boxed: Any, shardings: Any) -> Any:
    # Unboxed outside the mesh context: inside it, unboxing would attach sharding constraints.
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), shardings)


def _jit_phases(trainer: Any, state_shardings: Any, batch_sharding: Any, replicated: Any) -> dict[str, Callable]:
    names = tuple(getattr(trainer, "phases", ()))
    jitted = {}
    for name in names:
        last = name == names[-1]
        jitted[name] = jax.jit(
            functools.partial(trainer.run_phase, name), in_shardings=(state_shardings, batch_sharding, None),
            out_shardings=(state_shardings, replicated) if last else None, donate_argnums=0 if last else (),
        )  # fmt: skip
    return jitted


def _init_compiler_options(mesh: jax.sharding.Mesh) -> dict | None:
    """XLA options of the one-time init program. On CPU, LLVM at O1 compiles it (one threefry expansion per
    parameter) ~40% faster than the default and gives bit-identical parameters."""
    return {"xla_backend_optimization_level": 1} if mesh.devices.flat[0].platform == "cpu" else None


def compile_trainer(trainer: Any, *, mesh: jax.sharding.Mesh, rules: tuple, seed: int) -> CompiledTrainer:
    """Shardings of the state (from the logical axes of its boxed leaves; optimizer state follows its
    params) and of batches (batch axis over data and fsdp), and the jitted trainer functions."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(trainer.init, jax.random.key(seed))
        state_shardings = sharding.logical_to_sharding(boxed, mesh, rules)
    abstract_state = _with_shardings(boxed, state_shardings)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        batch_sharding = sharding.batch_sharding(mesh, rules)
        replicated = sharding.replicated(mesh)
        return CompiledTrainer(
            trainer=trainer, mesh=mesh, rules=rules, abstract_state=abstract_state, state_shardings=state_shardings,
            batch_sharding=batch_sharding,
            init=jax.jit(lambda rng: nn.unbox(trainer.init(rng)), out_shardings=state_shardings,
                         compiler_options=_init_compiler_options(mesh)),
            step=jax.jit(
                lambda state, batch: trainer.step(state, batch),
                in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, replicated), donate_argnums=0,
            ),
            eval_step=jax.jit(lambda state, batch, carry: trainer.eval_step(state, batch, carry),
                              in_shardings=(state_shardings, batch_sharding, None), out_shardings=(replicated, None)),
            with_params=jax.jit(lambda state, params: trainer.with_params(state, params), out_shardings=state_shardings),
            phases=_jit_phases(trainer, state_shardings, batch_sharding, replicated),
        )  # fmt: skip

