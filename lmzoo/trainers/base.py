"""The trainer protocol and its compilation over a device mesh.

A trainer is two pure functions and a carry: `init(rng) -> state`, `step(state, batch) -> (state,
metrics)`, and for evaluation `initial_carry(batch_size)` and `eval_step(state, batch, carry) ->
(metrics, carry)`. The loop (`lmzoo.train.loop`), checkpoints, preemption, metrics and evaluation
are written once around it, so a trainer may do anything inside `step`: one gradient update
(`lmzoo.trainers.supervised`), a rollout followed by epochs of minibatch updates (PPO), or counting with no
gradients at all; `with_params(state, params)` puts other (pretrained) params into a fresh state.
A trainer whose step has parts worth timing names them in `phases` and runs one with
`run_phase(name, state, batch, carry) -> carry` (the first gets carry None, the last returns
(state, metrics)); its `step` is `run_phases`, and the loop runs the jitted phases one after another,
logging each one's wall time as `time/<phase>_ms`.
A trainer with work to do once, on a fresh state before its first step, has `prepare(state, batch) -> (state,
scalars)` (PPO: the reward normalisation from the SFT policy's samples); the state it returns is checkpointed, so a
resumed run does not prepare again.
The state is a pytree with a `params` field (what evaluation and generation use: weights, or the
counts of a count-based model) and a `frozen` field (parameters read from elsewhere, never
checkpointed); its leaves may be boxed with logical axes (`nn.LogicallyPartitioned`), from
which `compile_trainer` derives every sharding.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import flax.linen as nn
import jax

from lmzoo import sharding
from lmzoo.trainers.state import Metrics

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


@dataclasses.dataclass
class CompiledTrainer:
    """A trainer's functions jitted over a mesh with shardings from the logical-axis rules.

    init(rng) -> state; step(state, batch) -> (state, metrics) donates the old state; steps(state, batches) does
    the same for batches stacked on a leading axis [k, batch, ...] in one call (`lax.scan`), metrics summed over
    the k steps; initial_carry(batch_size) -> carry; eval_step(state, batch, carry) -> (metrics, carry);
    eval_steps(state, batches, valid, carry, total) -> (total, carry) runs eval_step over batches stacked
    [k, batch, ...] in one call, adding each metric to `total` in order and skipping the batches whose valid [k] is
    False (those padding a last group to k);
    phases: {name: phase(state, batch, carry) -> carry} of a trainer with phases (the last donates the state),
    else empty; prepare(state, batch) -> (state, scalars) of a trainer with a `prepare`, else None (donates the
    state). Call them inside `context()`.
    """

    trainer: Any
    mesh: jax.sharding.Mesh
    rules: tuple
    abstract_state: Any  # ShapeDtypeStructs carrying the shardings (orbax restore targets)
    state_shardings: Any
    batch_sharding: jax.sharding.NamedSharding
    stacked_batch_sharding: jax.sharding.NamedSharding  # of steps' [k, batch, ...] arrays
    init: Callable
    step: Callable
    steps: Callable
    eval_step: Callable
    eval_steps: Callable
    with_params: Callable
    phases: dict[str, Callable] = dataclasses.field(default_factory=dict)
    prepare: Callable | None = None
    _init_program: Any = dataclasses.field(default=None, repr=False)

    @contextlib.contextmanager
    def context(self):
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            yield

    def init_program(self, rng: jax.Array) -> Any:
        """`init` compiled for keys like `rng` (kept): its program, to run apart from its tracing and compiling."""
        if self._init_program is None:
            self._init_program = self.init.lower(rng).compile()
        return self._init_program

    def initial_carry(self, batch_size: int) -> Any:
        """The trainer's zero carry for `batch_size` rows, sharded with its logical axes."""
        with self.context():
            boxed = jax.eval_shape(functools.partial(self.trainer.initial_carry, batch_size))
            shardings = sharding.logical_to_sharding(boxed, self.mesh, self.rules)
            return jax.jit(lambda: nn.unbox(self.trainer.initial_carry(batch_size)), out_shardings=shardings)()

    def host_params(self, state: Any) -> Any:
        """The params the model runs on (`state.params`, or the trainer's `model_params(state)`: LoRA adapters merged
        into their frozen base) as host numpy arrays; every process must call this (it gathers across hosts)."""
        model_params = getattr(self.trainer, "model_params", lambda state: state.params)
        with self.context():
            gathered = jax.jit(model_params, out_shardings=sharding.replicated(self.mesh))(state)
        return jax.device_get(gathered)


def _with_shardings(boxed: Any, shardings: Any) -> Any:
    # Unboxed outside the mesh context: inside it, unboxing would attach sharding constraints.
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), shardings)


def _jit_prepare(trainer: Any, state_shardings: Any, replicated: Any) -> Callable | None:
    if not hasattr(trainer, "prepare"):
        return None
    # The batch is the objective's own (not the training batch): its rows need not split over the data axes.
    return jax.jit(
        trainer.prepare,
        in_shardings=(state_shardings, replicated),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )


def _jit_phases(trainer: Any, state_shardings: Any, batch_sharding: Any, replicated: Any) -> dict[str, Callable]:
    names = tuple(getattr(trainer, "phases", ()))
    jitted = {}
    for name in names:
        last = name == names[-1]
        jitted[name] = jax.jit(
            functools.partial(trainer.run_phase, name),
            in_shardings=(state_shardings, batch_sharding, None),
            out_shardings=(state_shardings, replicated) if last else None,
            donate_argnums=0 if last else (),
        )
    return jitted


def scan_steps(trainer: Any, state: Any, batches: Batch) -> tuple[Any, Metrics]:
    """`trainer.step` over batches stacked on a leading axis [k, batch, ...], in order: (state, metrics summed
    over the k steps as (sum, count) pairs, as the loop accumulates single steps)."""

    def body(state, batch):
        return trainer.step(state, batch)

    state, metrics = jax.lax.scan(body, state, batches)
    return state, jax.tree.map(lambda m: m.sum(axis=0), metrics)


def scan_eval_steps(trainer: Any, state: Any, batches: Batch, valid: jax.Array, carry: Any, total: Any) -> tuple:
    """`trainer.eval_step` over batches stacked [k, batch, ...], in order: (total + each valid batch's metrics, added
    one after another as the host would, and the carry after the last valid batch). A batch whose valid [k] is False
    is skipped, not computed (`lax.cond`), so a group padded to k costs only its real batches."""

    def body(acc, inputs):
        batch, is_valid = inputs

        def step(acc):
            total, carry = acc
            metrics, carry = trainer.eval_step(state, batch, carry)
            return jax.tree.map(lambda a, b: a + b, total, metrics), carry

        return jax.lax.cond(is_valid, step, lambda acc: acc, acc), None

    return jax.lax.scan(body, (total, carry), (batches, valid))[0]


def _init_compiler_options(mesh: jax.sharding.Mesh) -> dict | None:
    """XLA options of the one-time init program. On CPU, LLVM at O1 compiles it (one threefry expansion per
    parameter) ~40% faster than the default and gives bit-identical parameters."""
    return {"xla_backend_optimization_level": 1} if mesh.devices.flat[0].platform == "cpu" else None


def traced_state(trainer: Any, *, rules: tuple, seed: int, sizes: Sequence[int] | None = None) -> Any:
    """The trainer's state from shapes alone, boxed with its logical axes under `rules`: traced on the abstract mesh
    of `sizes` (data, fsdp, expert, tensor), where the model makes its own checks of the mesh (an expert axis that does
    not divide its experts), or outside any mesh (None). Nothing is allocated."""
    on_mesh = (
        contextlib.nullcontext() if sizes is None else jax.sharding.use_abstract_mesh(sharding.abstract_mesh(sizes))
    )
    with on_mesh, nn.logical_axis_rules(rules):
        return jax.eval_shape(trainer.init, jax.random.key(seed))


def compile_trainer(
    trainer: Any, *, mesh: jax.sharding.Mesh, rules: tuple, seed: int, traced: Any = None
) -> CompiledTrainer:
    """Shardings of the state (from the logical axes of its boxed leaves; optimizer state follows its
    params) and of batches (batch axis over data and fsdp), and the jitted trainer functions. traced: the state
    `jax.eval_shape(trainer.init, ...)` gives under these rules on this mesh's shape (boxed: its logical axes), where
    the caller has it already (the run traced it to check the layout: `traced_state`), so the model is not traced
    once more."""
    boxed = (
        traced_state(trainer, rules=rules, seed=seed, sizes=tuple(mesh.shape.values())) if traced is None else traced
    )
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        state_shardings = sharding.logical_to_sharding(boxed, mesh, rules)
    abstract_state = _with_shardings(boxed, state_shardings)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        batch_sharding = sharding.batch_sharding(mesh, rules)
        stacked_batch_sharding = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(None, *batch_sharding.spec)
        )
        replicated = sharding.replicated(mesh)
        return CompiledTrainer(
            trainer=trainer,
            mesh=mesh,
            rules=rules,
            abstract_state=abstract_state,
            state_shardings=state_shardings,
            batch_sharding=batch_sharding,
            stacked_batch_sharding=stacked_batch_sharding,
            init=jax.jit(
                lambda rng: nn.unbox(trainer.init(rng)),
                out_shardings=state_shardings,
                compiler_options=_init_compiler_options(mesh),
            ),
            step=jax.jit(
                lambda state, batch: trainer.step(state, batch),
                in_shardings=(state_shardings, batch_sharding),
                out_shardings=(state_shardings, replicated),
                donate_argnums=0,
            ),
            steps=jax.jit(
                functools.partial(scan_steps, trainer),
                in_shardings=(state_shardings, stacked_batch_sharding),
                out_shardings=(state_shardings, replicated),
                donate_argnums=0,
            ),
            eval_step=jax.jit(
                lambda state, batch, carry: trainer.eval_step(state, batch, carry),
                in_shardings=(state_shardings, batch_sharding, None),
                out_shardings=(replicated, None),
            ),
            eval_steps=jax.jit(
                functools.partial(scan_eval_steps, trainer),
                in_shardings=(state_shardings, stacked_batch_sharding, replicated, None, replicated),
                out_shardings=(replicated, None),
            ),
            with_params=jax.jit(
                lambda state, params: trainer.with_params(state, params), out_shardings=state_shardings
            ),
            phases=_jit_phases(trainer, state_shardings, batch_sharding, replicated),
            prepare=_jit_prepare(trainer, state_shardings, replicated),
        )
