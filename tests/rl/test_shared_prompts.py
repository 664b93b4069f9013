"""Each prompt run once for its group of replies (`slots.shared_prompt_logits`; GRPO's updates and the reference's
scoring through `PPOTrainer.shares_prompts`): the logits and their gradients are those of the rows run whole, for
every decoder family, left-padded prompts and replies of different lengths; a GRPO step moves the params as the rows
run whole do, and its compiled update does fewer flops."""

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import kernels
from lmzoo.config import load_config_file
from lmzoo.data.loaders import Shard
from lmzoo.objectives import base
from lmzoo.serving import slots
from lmzoo.train import run as run_lib
from tests.serving.test_engine import FAMILIES, build

REPO = pathlib.Path(__file__).resolve().parents[2]
PROMPT_LENGTHS = (7, 3, 5)  # real tokens of each [3, 7] prompt, left-padded
REPLY_LENGTHS = (6, 2, 4, 1, 6, 3)  # real tokens of each [3·2, 6] continuation, then padding


def grouped_rows(vocab: int, group: int = 2, prompt_len: int = 7, reply_len: int = 6):
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, vocab, (len(PROMPT_LENGTHS), prompt_len)).astype(np.int32)
    prompt_mask = (np.arange(prompt_len)[None] >= prompt_len - np.array(PROMPT_LENGTHS)[:, None]).astype(np.int32)
    replies = rng.integers(0, vocab, (len(PROMPT_LENGTHS) * group, reply_len)).astype(np.int32)
    reply_mask = (np.arange(reply_len)[None] < np.array(REPLY_LENGTHS)[:, None]).astype(np.int32)
    return prompts * prompt_mask, prompt_mask, replies * reply_mask, reply_mask


def whole_rows_logits(model, params, prompts, prompt_mask, replies, reply_mask):
    """The rows prompt ⊕ reply run whole, as RL's forwards ran them: logits of the positions predicting the replies."""
    group = replies.shape[0] // prompts.shape[0]
    valid = np.concatenate([np.repeat(prompt_mask, group, 0), reply_mask], axis=1)
    sequences = np.concatenate([np.repeat(prompts, group, 0), replies], axis=1)
    start = prompts.shape[1] - 1
    logits, _ = model.apply(
        {"params": params},
        sequences,
        (start, start + replies.shape[1]),
        positions=np.maximum(np.cumsum(valid, axis=1) - 1, 0),
        segment_ids=valid,
        method="window_logits",
    )
    return logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_gradients_are_those_of_the_rows_run_whole(family):
    name, fields = FAMILIES[family]
    model, params = build(name, **fields)
    prompts, prompt_mask, replies, reply_mask = grouped_rows(model.config.vocab_size)
    weights = reply_mask * np.random.default_rng(1).normal(size=reply_mask.shape)  # a loss over the real tokens

    def loss(forward, params):
        logits = forward(model, params, prompts, prompt_mask, replies, reply_mask)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), replies[..., None], axis=-1)[..., 0]
        return jnp.sum(picked * weights), logits

    (shared_loss, shared), shared_grads = jax.jit(
        jax.value_and_grad(lambda p: loss(slots.shared_prompt_logits, p), has_aux=True)
    )(params)
    (whole_loss, whole), whole_grads = jax.jit(jax.value_and_grad(lambda p: loss(whole_rows_logits, p), has_aux=True))(
        params
    )
    real = reply_mask.astype(bool)
    np.testing.assert_allclose(np.asarray(shared)[real], np.asarray(whole)[real], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(float(shared_loss), float(whole_loss), rtol=1e-5)
    chex.assert_trees_all_close(shared_grads, whole_grads, atol=2e-5, rtol=1e-4)


def test_continuations_not_in_groups_of_the_prompts_are_refused():
    name, fields = FAMILIES["gpt2"]
    model, params = build(name, **fields)
    prompts, prompt_mask, replies, reply_mask = grouped_rows(model.config.vocab_size)
    with pytest.raises(ValueError, match="5 continuations are not G of each of 3 prompts"):
        slots.shared_prompt_logits(model, params, prompts, prompt_mask, replies[:5], reply_mask[:5])


def grpo_run(request, shared_prompts: str):
    config = load_config_file(REPO / "configs" / "gsm8k.py", "tiny")
    config.objective.update(shared_prompts=shared_prompts, kl_loss="k3", kl_coef=0.1, prompt_len=16, response_len=4)
    built = run_lib.validated_objective(config)
    request.addfinalizer(built.close)  # its reward workers
    trainer = built.trainer(built.model())
    loader = built.train_loader(base.fixed_tokenizer(built.config), built.read()["train"], Shard(0, 1))
    return trainer, {k: jnp.asarray(v) for k, v in loader.batch(0).items()}


def test_a_grpo_step_runs_each_prompt_once_and_moves_the_params_as_whole_rows_do(request):
    (shared, batch), (whole, _) = grpo_run(request, "on"), grpo_run(request, "off")
    assert shared.shares_prompts and not whole.shares_prompts
    state = shared.init(jax.random.key(0))
    samples = jax.jit(lambda b: shared.run_phase("rollout", state, b, None))(batch)
    # Rewards that differ within each group, so every group has advantages to learn from.
    rows = samples["mask"].shape[0]
    group = shared.settings.samples_per_prompt
    scored = {**samples, "scores": jnp.arange(rows, dtype=jnp.float32) % 3, "raw_scores": jnp.zeros((rows,))}

    def step(trainer):
        targets = jax.jit(
            lambda s: trainer.score(
                state.params, trainer.scoring_models(state), state.kl_coef, s, samples_per_prompt=group
            )
        )(scored)
        update = jax.jit(lambda t: trainer.run_phase("update", state, batch, t))
        return targets, update(targets), update.lower(targets).compile().cost_analysis()["flops"]

    (shared_targets, _), (shared_state, shared_metrics), shared_flops = step(shared)
    (whole_targets, _), (whole_state, whole_metrics), whole_flops = step(whole)
    np.testing.assert_allclose(shared_targets["ref_logprobs"], whole_targets["ref_logprobs"], atol=1e-5)
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), state.params, whole_state.params)
    assert max(jax.tree.leaves(moved)) > 0, "the update moved nothing: the comparison would be empty"
    chex.assert_trees_all_close(shared_state.params, whole_state.params, atol=1e-6, rtol=1e-5)
    for key in ("loss/total", "objective/kl", "policy/ratio"):
        np.testing.assert_allclose(np.divide(*shared_metrics[key]), np.divide(*whole_metrics[key]), rtol=1e-5)
    # The prompts (16 tokens) go through the model once for their 4 replies (4 tokens each): the update reads
    # 4·16 + 16·4 tokens where the whole rows are 16·20.
    assert shared_flops < 0.6 * whole_flops, f"the shared update does {shared_flops / whole_flops:.2f}x the flops"


def test_shared_prompts_auto_is_on_on_the_cpu_and_off_on_accelerators(request):
    trainer, _ = grpo_run(request, "auto")
    assert trainer.shares_prompts
    with kernels.use_platform("gpu"):
        assert not trainer.shares_prompts
    with pytest.raises(ValueError, match="shared_prompts='yes': choose one of"):
        grpo_run(request, "yes")
