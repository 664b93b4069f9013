"""The trainer protocol admits unusual training regimes without branches in the loop: each toy objective
below registers itself like a real one and runs through `train_and_evaluate`, checkpoints and resume.

- counting: a "fit" with no gradients (unigram counts);
- inner updates: several optimizer updates per outer step over a buffer built inside the step (PPO's
  shape), with an optimizer per parameter subtree (policy and value at different learning rates);
- annealed: a loss that receives the optimizer step;
- a recurrent carry that is sharded with its rows, kept row by row under gradient accumulation and
  threaded through evaluation.
"""

import dataclasses
import functools
import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct

from lmzoo import config as config_lib
from lmzoo import objectives, sharding, testing
from lmzoo.objectives import causal_lm, losses, tasks
from lmzoo.train import loop
from lmzoo.train import run as run_lib
from lmzoo.trainers import base as trainer_lib
from lmzoo.trainers import optim, supervised
from lmzoo.trainers.state import Task

VOCAB = 258


@struct.dataclass
class CountState:
    step: jax.Array
    params: jax.Array  # [V] float32: the token counts are the model
    frozen: dict


@dataclasses.dataclass(frozen=True)
class CountingTrainer:
    """Unigram LM fitted by counting the training tokens: no params, no optimizer, no gradients."""

    vocab_size: int

    def init(self, rng):
        return CountState(step=jnp.zeros((), jnp.int32), params=jnp.zeros((self.vocab_size,), jnp.float32), frozen={})

    def step(self, state, batch):
        counts = state.params + jnp.zeros_like(state.params).at[batch["targets"]].add(batch["weights"])
        tokens = jnp.sum(batch["weights"])
        return state.replace(step=state.step + 1, params=counts), {
            "loss": (jnp.zeros(()), tokens),
            "tokens_seen": (tokens, 1.0),
        }

    def initial_carry(self, batch_size):
        return {}

    def eval_step(self, state, batch, carry):
        log_probs = jnp.log((state.params + 1.0) / (jnp.sum(state.params) + self.vocab_size))  # add-one smoothing
        weights = batch["weights"]
        return {"loss": (-jnp.sum(log_probs[batch["targets"]] * weights), jnp.sum(weights))}, carry

    def with_params(self, state, params):
        return state.replace(params=params)


class Counting(causal_lm.CausalLM):
    name = "test_counting"

    def trainer(self, model):
        return CountingTrainer(self.config.model.vocab_size)


def _two_head_task(model) -> Task:
    """A decoder ("policy") plus a linear value head on its hidden states ("value")."""

    def init(rng, batch):
        policy = model.init(rng, batch["inputs"])["params"]
        value = {"kernel": jnp.zeros((model.config.emb_dim, 1))}
        return {"policy": policy, "value": value}, {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        logits, hidden = model.apply({"params": params["policy"]}, batch["inputs"], return_hidden=True)
        value, metrics = losses.token_loss(logits, batch)
        values = (hidden @ params["value"]["kernel"])[..., 0]
        value_loss = jnp.mean((values - batch["returns"]) ** 2)
        return value + value_loss, ({**metrics, "value_loss": (value_loss, 1.0)}, carry)

    return Task(init=init, loss=loss)


@dataclasses.dataclass(frozen=True)
class InnerUpdatesTrainer(supervised.SupervisedTrainer):
    """PPO's shape: a buffer built inside the step from the current params (here: returns from the
    policy's own predictions), then `epochs` passes of `minibatches` optimizer updates over it."""

    model: nn.Module = None
    epochs: int = 2
    minibatches: int = 2

    def step(self, state, batch):
        logits = self.model.apply({"params": state.params["policy"]}, batch["inputs"])
        buffer = {**batch, "returns": jax.lax.stop_gradient(jnp.max(jax.nn.log_softmax(logits), axis=-1))}
        grad_fn = jax.value_and_grad(functools.partial(self.task.loss, step=state.step, train=True), has_aux=True)

        def update(carry, minibatch):
            params, opt_state = carry
            (_, (metrics, _)), grads = grad_fn(params, state.frozen, {}, minibatch, jax.random.key(0))
            updates, opt_state = self.tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), metrics

        minibatches = trainer_lib.split_microbatches(buffer, self.minibatches)
        epochs = jax.tree.map(lambda x: jnp.concatenate([x] * self.epochs), minibatches)
        (params, opt_state), metrics = jax.lax.scan(update, (state.params, state.opt_state), epochs)
        metrics = jax.tree.map(lambda x: jnp.sum(x, axis=0), metrics)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    def eval_step(self, state, batch, carry):
        logits = self.model.apply({"params": state.params["policy"]}, batch["inputs"])
        return losses.token_loss(logits, batch)[1], carry


class InnerUpdates(causal_lm.CausalLM):
    name = "test_inner_updates"

    def trainer(self, model):
        tx, schedule = optim.make_optimizer(self.config.optim)
        return InnerUpdatesTrainer(
            _two_head_task(model), tx, schedule, self.input_shapes(self.config.train.batch_size), model=model
        )


def _annealed_task(model) -> Task:
    base = tasks.causal_lm_task(model)

    def loss(params, frozen, carry, batch, rng, *, step, train):
        value, (metrics, carry) = base.loss(params, frozen, carry, batch, rng, step=step, train=train)
        weight = jnp.minimum(1.0, step.astype(jnp.float32) / 4.0)
        return weight * value, ({**metrics, "anneal_weight": (weight, 1.0)}, carry)

    return dataclasses.replace(base, loss=loss)


class Annealed(causal_lm.CausalLM):
    name = "test_annealed"

    def task(self, model):
        return _annealed_task(model)


for _objective in (Counting, InnerUpdates, Annealed):
    objectives.register(_objective)


def _config(objective: str = "causal_lm", **train):
    return testing.tiny_config(objective, sample_tokens=0, **train)


def _train_rows(workdir) -> list[dict]:
    return [
        r
        for r in map(json.loads, (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines())
        if r["split"] == "train"
    ]


def test_registry_lists_every_objective_with_its_fields():
    listing = objectives.describe()
    for name in (
        "causal_lm",
        "mlm",
        "mlm_nsp",
        "mlm_sop",
        "distill",
        "classify",
        "span_corruption",
        "denoising",
        "text_to_text",
    ):
        assert name in objectives.REGISTRY and name in listing
    assert "mask_rate=0.15" in listing and "noise_density=0.15" in listing and "teacher=''" in listing
    with pytest.raises(ValueError, match="unknown config.objective.name 'nope'"):
        objectives.get("nope")


def test_objective_section_holds_only_its_own_fields():
    section = objectives.objective_section("mlm_nsp", static_masking=True)
    assert set(section) == {
        "name",
        "mask_rate",
        "whole_word_masking",
        "static_masking",
        "num_pair_examples",
        "num_eval_pairs",
        "sentence_loss_weight",
    }
    with pytest.raises(ValueError, match="unknown field.*'temperature'.*of objective 'mlm'"):
        objectives.objective_section("mlm", temperature=2.0)
    config = _config()
    config.objective = objectives.objective_section("mlm", mask_rate=1.5)
    with pytest.raises(ValueError, match=r"config.objective.mask_rate=1.5 must lie in \(0, 1\)"):
        run_lib.validate(config)


def test_counting_trainer_fits_without_gradients_and_resumes(tmp_path):
    final = loop.train_and_evaluate(_config("test_counting"), str(tmp_path / "straight"))
    loop.train_and_evaluate(_config("test_counting", steps=2), str(tmp_path / "resumed"))
    loop.train_and_evaluate(_config("test_counting"), str(tmp_path / "resumed"))
    run = run_lib.open_run(str(tmp_path / "straight"))
    loader = run.train_loader()
    expected = sum(
        np.bincount(b["targets"].ravel(), weights=b["weights"].ravel(), minlength=VOCAB)
        for b in map(loader.batch, range(4))
    )
    _, state = run_lib.restore_step(run)
    np.testing.assert_allclose(state.params, expected)
    log_probs = np.log((expected + 1.0) / (expected.sum() + VOCAB))
    batches = list(run.eval_batches("validation"))[:2]
    direct = -sum(np.sum(log_probs[b["targets"]] * b["weights"]) for b in batches) / sum(
        b["weights"].sum() for b in batches
    )
    assert final["loss"] == pytest.approx(direct, rel=1e-5)
    run.close()
    _, resumed = run_lib.restore_step(run_lib.open_run(str(tmp_path / "resumed")))
    np.testing.assert_array_equal(resumed.params, state.params)


def test_inner_updates_with_an_optimizer_per_subtree(tmp_path):
    config = _config("test_inner_updates", steps=2)
    config.optim.warmup_steps, config.optim.weight_decay = 0, 0.0
    config.optim.groups = (("value", {"learning_rate": 0.0}),)
    loop.train_and_evaluate(config, str(tmp_path))
    _, state = run_lib.restore_step(run_lib.open_run(str(tmp_path)))
    # 2 outer steps x 2 epochs x 2 minibatches: 8 optimizer updates, counted by the default group's Adam.
    counts = [x for x in jax.tree.leaves(state.opt_state) if x.dtype == np.int32 and x.shape == ()]
    assert 8 in [int(c) for c in counts]
    np.testing.assert_array_equal(state.params["value"]["kernel"], 0.0)  # learning rate 0 for the value group
    rows = _train_rows(tmp_path)
    assert rows[-1]["value_loss"] > 0


def test_an_optimizer_group_that_names_no_params_is_an_error(tmp_path):
    config = _config("test_inner_updates", steps=2)
    config.optim.groups = (("valeu", {"learning_rate": 0.0}),)
    with pytest.raises(ValueError, match=r"config.optim.groups names \['valeu'\].*top level: \[.*'value'"):
        loop.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_loss_receives_the_optimizer_step(tmp_path):
    loop.train_and_evaluate(_config("test_annealed"), str(tmp_path))
    rows = _train_rows(tmp_path)  # log_every 2: the mean of the weights of steps (0, 1) and (2, 3)
    assert [r["anneal_weight"] for r in rows] == pytest.approx([(0.0 + 0.25) / 2, (0.5 + 0.75) / 2])


class ToyRNN(nn.Module):
    """h_t = tanh(h_{t-1} W + E[x_t]); logits_t = h_t U. tokens [B, T], carry [B, H] -> logits [B, T, V], carry."""

    vocab_size: int = 11
    hidden: int = 8

    @nn.compact
    def __call__(self, tokens, carry):
        embed = self.param("embed", nn.initializers.normal(0.5), (self.vocab_size, self.hidden))
        recur = self.param("recur", nn.initializers.normal(0.5), (self.hidden, self.hidden))
        out = self.param("out", nn.initializers.normal(0.5), (self.hidden, self.vocab_size))

        def cell(h, x):
            h = jnp.tanh(h @ recur + embed[x])
            return h, h

        carry, hidden = jax.lax.scan(cell, carry, tokens.T)
        return jnp.swapaxes(hidden, 0, 1) @ out, carry


def _rnn_task(model: ToyRNN) -> Task:
    def init(rng, batch):
        return model.init(rng, batch["inputs"], jnp.zeros((batch["inputs"].shape[0], model.hidden)))["params"], {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        logits, carry = model.apply({"params": params}, batch["inputs"], carry)
        value, metrics = losses.token_loss(logits, batch)
        return value, (metrics, carry)

    def initial_carry(batch_size):
        return nn.LogicallyPartitioned(jnp.zeros((batch_size, model.hidden)), ("act_batch", None))

    return Task(init=init, loss=loss, initial_carry=initial_carry)


def _rnn_compiled(batch_size: int, window: int, grad_accum_steps: int = 1):
    config = config_lib.base_config().optim
    config.warmup_steps = 0
    tx, schedule = optim.make_optimizer(config)
    shapes = {"inputs": jax.ShapeDtypeStruct((batch_size, window), np.int32)}
    trainer = supervised.SupervisedTrainer(_rnn_task(ToyRNN()), tx, schedule, shapes, grad_accum_steps=grad_accum_steps)
    return trainer_lib.compile_trainer(trainer, mesh=sharding.make_mesh(), rules=sharding.axis_rules(), seed=0)


def _windows(stream: np.ndarray, window: int) -> list[dict]:
    """Consecutive windows of every row's stream [B, N + 1]: inputs and next-token targets."""
    return [
        {
            "inputs": stream[:, i : i + window],
            "targets": stream[:, i + 1 : i + window + 1],
            "weights": np.ones((stream.shape[0], window), np.float32),
        }
        for i in range(0, stream.shape[1] - 1, window)
    ]


def test_carry_over_consecutive_windows_equals_one_pass():
    stream = np.random.default_rng(0).integers(0, 11, size=(4, 4 * 5 + 1)).astype(np.int32)
    compiled = _rnn_compiled(4, 5)
    with compiled.context():
        state = compiled.init(jax.random.key(0))
        carry, total = compiled.initial_carry(4), np.zeros(2)
        for batch in _windows(stream, 5):
            metrics, carry = compiled.eval_step(state, sharding.put_batch(batch, compiled.batch_sharding), carry)
            total += np.asarray(jax.device_get(metrics["loss"]))
    whole = compiled.trainer.task.loss(
        state.params, {}, jnp.zeros((4, 8)), _windows(stream, 20)[0], None, step=0, train=False
    )
    np.testing.assert_allclose(total[0], float(whole[1][0]["loss"][0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(carry), np.asarray(whole[1][1]), atol=1e-6)


def test_carry_is_sharded_by_row_and_kept_row_by_row_under_accumulation():
    compiled, accumulated = _rnn_compiled(4, 5), _rnn_compiled(4, 5, grad_accum_steps=2)
    assert compiled.state_shardings.carry.spec[0] == compiled.batch_sharding.spec[0]
    stream = np.random.default_rng(1).integers(0, 11, size=(4, 11)).astype(np.int32)
    states = []
    for c in (compiled, accumulated):
        with c.context():
            state = c.init(jax.random.key(0))
            for batch in _windows(stream, 5):
                state, _ = c.step(state, sharding.put_batch(batch, c.batch_sharding))
        states.append(jax.device_get(state))
    np.testing.assert_allclose(states[0].carry, states[1].carry, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), states[0].params, states[1].params)
