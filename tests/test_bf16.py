"""bfloat16 through every path: compute in bf16 (`model.dtype`) and params in bf16 (`model.param_dtype`).

A bf16 train.py run trains, evaluates, writes its end-of-run sample, generates as `eval.py --generate` does,
scores few-shot tasks and exports to transformers; every family trains finite steps; the samplers, beam
search, per-example scoring, the LSTM and VAE-LM generators and a PPO iteration run in bf16, with log-probs,
scores and losses in float32 and close to the float32 model's.

Most functions under test run inside an outer `jax.jit` compiled at XLA's backend optimization level 0
(`fast_jit`): the same programs, compiled ~3x faster on a CPU.
"""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lmzoo import decoding, models, testing
from lmzoo.cli import export as cli_export
from lmzoo.evaluation import fewshot, scoring
from lmzoo.evaluation.generation import sample_text
from lmzoo.models import heads, lstm, vae_lm
from lmzoo.objectives import bilm, classify, recurrent_lm, tasks
from lmzoo.objectives import vae_lm as vae_lm_objective
from lmzoo.rl import reward
from lmzoo.train import loop
from lmzoo.train import run as run_lib
from lmzoo.trainers import rl, supervised

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)
PRECISIONS = {"bf16_compute": dict(dtype="bfloat16"), "bf16_params": dict(dtype="bfloat16", param_dtype="bfloat16")}
TINY_T5 = dict(vocab_size=32, emb_dim=16, num_heads=2, head_dim=8, num_encoder_layers=1, num_decoder_layers=1)
TINY_T5 |= dict(mlp_dim=32, dropout_rate=0.0, relative_buckets=8, relative_max_distance=16)
TINY_BART = TINY_T5 | dict(positions="learned", position_offset=2, max_len=24, pre_norm=False, norm="layer")
TINY_BART |= dict(use_bias=True, embedding_norm=True, activations=("gelu",), final_logits_bias=True)
TINY_BART |= dict(attention_scale=0.0, scale_tied_logits=False, embedding_init_std=0.02, init_scheme="normal")
TINY_BERT = dict(vocab_size=32, max_len=16, emb_dim=16, num_heads=2, num_layers=1, mlp_dim=32, dropout_rate=0.0)
TINY_LSTM = dict(vocab_size=32, emb_dim=16, num_layers=1, init_scale=0.3)
TINY_ELMO = dict(vocab_size=32, emb_dim=16, num_layers=1, dropout_rate=0.0, init_scale=0.3)
TINY_VAE = dict(vocab_size=32, emb_dim=16, latent_dim=4, init_scale=0.3)

fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _dtypes(tree) -> set:
    return {np.dtype(x.dtype) for x in jax.tree.leaves(tree)}


def _cast(params, precision: dict):
    """params in the precision's param_dtype."""
    return jax.tree.map(lambda x: x.astype(precision.get("param_dtype", "float32")), params)


def _valid_ids(tokens, vocab_size: int = 32) -> bool:
    tokens = np.asarray(tokens)
    return bool(((tokens >= 0) & (tokens < vocab_size)).all())


# --- a bf16 train.py run: in-loop evaluation, the end-of-run sample, eval.py --generate, few-shot, export ---


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """configs/default.py:tiny with --config.model.dtype=bfloat16 --config.model.param_dtype=bfloat16, 2 steps:
    (workdir, final validation metrics). Its checkpoints hold bf16 params."""
    workdir = tmp_path_factory.mktemp("bf16_run")
    config = testing.tiny_config(steps=2, eval_every=2, checkpoint_every=2, sample_tokens=6)
    config.model.dtype = config.model.param_dtype = "bfloat16"
    return workdir, loop.train_and_evaluate(config, str(workdir))


@pytest.fixture(scope="module")
def bf16_loaded(bf16_run):
    """(the run's `lmzoo.load`, a float32 copy of its model and params)."""
    loaded = run_lib.load(str(bf16_run[0]))
    fields = {**loaded.config.model.to_dict(), "dtype": "float32", "param_dtype": "float32"}
    return loaded, (models.build_model("gpt2", fields), _cast(loaded.params, {}))


def test_bf16_run_trains_evaluates_and_writes_its_end_of_run_sample(bf16_run):
    """Issue 24's crash: the sampler's while_loop got bfloat16 logits back for its float32 carry."""
    workdir, final = bf16_run
    assert np.isfinite(final["loss"]) and final["tokens"] > 0
    assert json.loads((workdir / "config.json").read_text())["model"]["dtype"] == "bfloat16"
    sample = (workdir / "sample.txt").read_text()
    assert sample.startswith("def ") and len(sample) > len("def ")


def test_eval_generate_on_a_bf16_run(bf16_run):
    """What `eval.py --workdir=DIR --generate=PROMPT` does: open the run, restore its latest step, sample."""
    run = run_lib.open_run(str(bf16_run[0]))
    try:
        _, state = run_lib.restore_step(run)
        params = run.compiled.host_params(state)
        assert _dtypes(params) == {BF16}
        # The end-of-run sample's settings: its compiled sampler is reused.
        text = sample_text(run, params, "def ", max_new_tokens=6, temperature=0.8, top_k=0, top_p=0.95, seed=0)
        assert isinstance(text, str)
    finally:
        run.close()


def test_fewshot_scores_of_a_bf16_run_are_close_to_float32(bf16_loaded):
    loaded, (f32_model, f32_params) = bf16_loaded
    tokenizer = loaded.tokenizer
    examples = [fewshot.Example("x = ", ("1", "'a'"), 0), fewshot.Example("def f", ("(x):", " = 2"), 0)]
    result, _ = fewshot.evaluate_fewshot(loaded.model, loaded.params, tokenizer, examples, examples, k=0, batch_size=4)
    assert result["examples"] == 2 and 0.0 <= result["accuracy"] <= 1.0
    pairs = [
        ([tokenizer.eos_id, *tokenizer.encode(e.context)], tokenizer.encode(c)) for e in examples for c in e.choices
    ]
    ours, _ = scoring.loglikelihoods(loaded.model, loaded.params, pairs, batch_size=4)
    theirs, _ = scoring.loglikelihoods(f32_model, f32_params, pairs, batch_size=4)
    np.testing.assert_allclose(ours, theirs, rtol=0.02, atol=0.05)


def test_export_of_a_bf16_run_writes_float32_that_transformers_loads(bf16_run, bf16_loaded, tmp_path):
    """bf16 params are exported as float32 safetensors (an exact upcast): HF gives the float32 model's logits."""
    torch = pytest.importorskip("torch", reason="export tests need torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    cli_export.export_workdir(str(bf16_run[0]), str(tmp_path))
    assert _dtypes(load_file(str(tmp_path / "model.safetensors"))) == {F32}
    tokens = testing.random_tokens((2, 9), vocab_size=258)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
    _, (f32_model, f32_params) = bf16_loaded
    ours = fast_jit(lambda p, t: f32_model.apply({"params": p}, t))(f32_params, tokens)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


# --- every family holds its params in param_dtype and trains in bf16 compute and in bf16 params ---


def _rows(seed: int, shape=(2, 8), vocab_size: int = 32) -> jax.Array:
    return jnp.asarray(testing.random_tokens(shape, vocab_size=vocab_size, seed=seed))


def _lm_batch():
    tokens = _rows(0, (2, 9))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": jnp.ones((2, 8), jnp.float32)}


def _family(name: str, precision: dict):
    """(task, batch) of each family's supervised objective, the model in `precision`."""
    if name == "gpt2":
        model = models.build_model("gpt2", testing.TINY_GPT2 | dict(num_layers=1) | precision)
        return tasks.causal_lm_task(model), _lm_batch()
    if name == "bert":
        model = models.build_model("bert", TINY_BERT | precision)
        weights = jnp.zeros((2, 8), jnp.float32).at[:, 2:4].set(1.0)
        batch = {**_lm_batch(), "weights": weights, "sentence_labels": jnp.array([0, 1])}
        return tasks.masked_lm_task(model, mask_rate=0.15), batch
    if name in ("t5", "bart"):
        model = models.build_model("seq2seq", (TINY_T5 if name == "t5" else TINY_BART) | precision)
        targets = _rows(1, (2, 6))
        batch = {"inputs": _rows(2), "encoder_segment_ids": jnp.ones((2, 8), jnp.int32), "weights": jnp.ones((2, 6))}
        batch |= {"targets": targets, "decoder_inputs": jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))}
        return tasks.seq2seq_task(model), batch
    if name == "lstm":
        model = models.build_model("lstm", TINY_LSTM | precision)
        return recurrent_lm.recurrent_lm_task(model, sum_over_time=True), {**_lm_batch(), "reset": jnp.zeros((2,))}
    if name == "elmo":
        model = models.build_model("elmo", TINY_ELMO | precision)
        return bilm.bilm_task(model), {"tokens": _rows(3), "weights": jnp.ones((2, 8), jnp.float32)}
    if name == "vae_lm":
        model = models.build_model("vae_lm", TINY_VAE | precision)
        return vae_lm_objective.vae_task(model, vae_lm_objective.ElboConfig()), _lm_batch()
    if name == "classifier":  # a task head on an encoder; the head computes and keeps its own params in float32
        model = heads.SequenceClassifier(models.build_model("bert", TINY_BERT | precision), 3)
        batch = {"inputs": _rows(4), "labels": jnp.array([0, 2]), "segment_ids": jnp.ones((2, 8), jnp.int32)}
        return classify.classification_task(model), batch
    raise ValueError(name)


FAMILIES = ("gpt2", "bert", "t5", "bart", "lstm", "elmo", "vae_lm", "classifier")


def _init_and_two_steps(trainer, batch):
    """(params at init, params after two steps on `batch`, the metrics of both steps)."""
    state = nn.unbox(trainer.init(jax.random.key(0)))
    last, metrics = jax.lax.scan(lambda s, _: trainer.step(s, batch), state, length=2)
    return state.params, last.params, metrics


@pytest.mark.parametrize("family", FAMILIES)
def test_training_steps_are_finite_in_bf16_compute_and_trace_in_bf16_params(family):
    """Two AdamW steps of the supervised trainer in bf16 compute: float32 finite losses, params changed, each keeping
    its dtype. In bf16 params the same steps are traced (float32 losses, bf16 params kept); they run for GPT-2 in the
    bf16 train.py run and in the PPO test."""
    runs = {}
    for name, fields in PRECISIONS.items():
        task, batch = _family(family, fields)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
        trainer = supervised.SupervisedTrainer(task, optax.adamw(1e-2), optax.constant_schedule(1e-2), shapes)
        runs[name] = functools.partial(_init_and_two_steps, trainer), batch
    run, batch = runs["bf16_params"]
    before, after, metrics = jax.eval_shape(run, batch)
    assert metrics["loss"][0].dtype == F32 and _dtypes(after) == _dtypes(before)
    assert _dtypes(before["backbone"] if family == "classifier" else before) == {BF16}

    run, batch = runs["bf16_compute"]
    before, after, metrics = fast_jit(run)(batch)
    loss_sums, counts = metrics["loss"]
    assert loss_sums.dtype == F32 and np.isfinite(loss_sums).all() and (counts > 0).all()
    assert np.isfinite(metrics["grad_norm"][0]).all()
    assert _dtypes(after) == _dtypes(before)  # the optimizer keeps every param's dtype
    assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


# --- sampling, beam search and scoring in bf16 ---


@functools.partial(fast_jit, static_argnames=("model", "seed"))
def _random_params(model, *inputs, seed: int):
    """`model.init` params redrawn with large values (norm scales 1 + noise), so that tiny models emit varied tokens
    with clear top-1 margins."""
    params = nn.unbox(model.init(jax.random.key(0), *inputs)["params"])
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def draw(path, leaf, key):
        noise = jax.random.normal(key, leaf.shape, leaf.dtype)
        return 1.0 + 0.2 * noise if path[-1].key == "scale" else 0.5 * noise

    return jax.tree_util.tree_unflatten(treedef, [draw(p, x, k) for (p, x), k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def decoders():
    """A tiny GPT-2 with large random weights: {"float32" | precision: (model, params)}, the same weights."""
    fields = testing.TINY_GPT2 | dict(num_layers=1)
    model = models.build_model("gpt2", fields)
    params = _random_params(model, jnp.zeros((2, 8), jnp.int32), seed=2)
    out = {"float32": (model, params)}
    for name, precision in PRECISIONS.items():
        out[name] = (models.build_model("gpt2", fields | precision), _cast(params, precision))
    return out


PROMPTS = (
    np.array([[0, 0, 5, 9, 3], [7, 1, 4, 2, 8]], np.int32),
    np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int32),
)


@functools.partial(fast_jit, static_argnames=("model", "settings"))
def _sample_prompts(model, params, settings: tuple) -> decoding.Samples:
    return decoding.sample(model, params, *PROMPTS, jax.random.key(1), max_new_tokens=6, **dict(settings))


def _sample(model, params, **settings) -> decoding.Samples:
    return _sample_prompts(model, params, tuple(sorted(settings.items())))


@functools.partial(fast_jit, static_argnames="model")
def _log_probs_of(model, params, tokens, mask):
    """The log-probs [B, N] of sampled tokens [B, N] after PROMPTS, from one forward pass of `model`."""
    inputs = rl.rollout_inputs(*PROMPTS, tokens, mask)
    logits = model.apply(
        {"params": params}, inputs["sequences"], segment_ids=inputs["segment_ids"], positions=inputs["positions"]
    )
    log_probs = jax.nn.log_softmax(logits[:, PROMPTS[0].shape[1] - 1 : -1].astype(jnp.float32))
    return jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_greedy_bf16_decoding_follows_the_float32_model(decoders, precision):
    """The first greedy tokens are the float32 model's, and the sampler's float32 log-probs of its tokens are the
    float32 model's within bf16 precision."""
    (model, params), (f32_model, f32_params) = decoders[precision], decoders["float32"]
    ours, reference = _sample(model, params, temperature=0.0), _sample(f32_model, f32_params, temperature=0.0)
    assert ours.log_probs.dtype == F32
    np.testing.assert_array_equal(np.asarray(ours.tokens)[:, :2], np.asarray(reference.tokens)[:, :2])
    rescored = _log_probs_of(f32_model, f32_params, ours.tokens, ours.mask)
    np.testing.assert_allclose(ours.log_probs, rescored, atol=0.1)


SETTINGS = {
    "bf16_compute": dict(temperature=1.3, top_k=4),
    "bf16_params": dict(temperature=0.8, top_p=0.7, use_cache=False),
}


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_decoder_sampling_with_filters_in_bf16_gives_valid_ids(decoders, precision):
    """Temperature and top-k with the KV cache, top-p with full recomputation (greedy is tested above)."""
    samples = _sample(*decoders[precision], eos_id=31, pad_id=0, **SETTINGS[precision])
    log_probs = np.asarray(samples.log_probs)
    assert samples.tokens.shape == (2, 6) and _valid_ids(samples.tokens) and np.asarray(samples.mask)[:, 0].all()
    assert log_probs.dtype == F32 and np.isfinite(log_probs).all() and (log_probs <= 0).all()


SEQ2SEQ_INPUTS = testing.random_tokens((2, 7), seed=3)


def _seq2seq(variant: str, precision: str):
    """((model, params), (float32 model, params)): the same large random weights, cast to the precision's."""
    fields = TINY_T5 if variant == "t5" else TINY_BART
    f32_model = models.build_model("seq2seq", fields)
    f32_params = _random_params(f32_model, SEQ2SEQ_INPUTS, SEQ2SEQ_INPUTS, seed=1)
    model = models.build_model("seq2seq", fields | PRECISIONS[precision])
    return (model, _cast(f32_params, PRECISIONS[precision])), (f32_model, f32_params)


@pytest.mark.parametrize("variant, precision", [("t5", "bf16_compute"), ("bart", "bf16_params")])
def test_seq2seq_greedy_decoding_in_bf16_follows_float32(variant, precision):
    (model, params), (f32_model, f32_params) = _seq2seq(variant, precision)

    @fast_jit
    def greedy(model_params, reference_params):
        settings = dict(encoder_segment_ids=None, rng=jax.random.key(2), max_new_tokens=5, temperature=0.0)
        run = functools.partial(decoding.sample_seq2seq, inputs=SEQ2SEQ_INPUTS, **settings)
        return run(model, model_params), run(f32_model, reference_params)

    ours, reference = greedy(params, f32_params)
    assert ours.log_probs.dtype == F32 and np.isfinite(ours.log_probs).all()
    np.testing.assert_array_equal(np.asarray(ours.tokens)[:, :2], np.asarray(reference.tokens)[:, :2])


def test_beam_search_and_seq2seq_scores_in_bf16_match_float32_scoring():
    """BART in bf16 compute and params: the beam's score is its tokens' mean log-prob under the float32 model, and
    the bf16 model's per-example scores (float32) are close to the float32 model's."""
    (model, params), (f32_model, f32_params) = _seq2seq("bart", "bf16_params")
    tokens, scores = decoding.beam_search(model, params, SEQ2SEQ_INPUTS, beam_size=3, max_new_tokens=5, eos_id=1)
    assert _valid_ids(tokens) and scores.dtype == F32 and np.isfinite(scores).all()
    # Score = summed log-prob / length (length_penalty 1), the length counting the tokens up to the first EOS.
    weights = (np.cumsum(np.asarray(tokens) == 1, axis=1) - (np.asarray(tokens) == 1) == 0).astype(np.int32)
    rows = (SEQ2SEQ_INPUTS, np.ones_like(SEQ2SEQ_INPUTS), tokens, weights)
    ours, _ = fast_jit(functools.partial(scoring.seq2seq_loglikelihood, model))(params, *rows)
    reference, _ = fast_jit(functools.partial(scoring.seq2seq_loglikelihood, f32_model))(f32_params, *rows)
    np.testing.assert_allclose(scores, reference / weights.sum(axis=1), atol=0.05)
    assert ours.dtype == F32
    np.testing.assert_allclose(ours, reference, rtol=0.02, atol=0.2)


@functools.partial(fast_jit, static_argnames="model")
def _decoder_scores(model, params, rows: dict):
    return scoring.decoder_loglikelihood(model, params, rows["inputs"], rows["targets"], rows["weights"])


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_per_example_scores_are_float32_and_close_to_float32(decoders, precision):
    rows = scoring.decoder_rows([([3, 4, 5], [6, 7]), ([9], [1, 2, 3, 4])], max_len=16, length_multiple=8)
    ours, _ = _decoder_scores(*decoders[precision], rows)
    reference, _ = _decoder_scores(*decoders["float32"], rows)
    assert ours.dtype == F32
    np.testing.assert_allclose(ours, reference, rtol=0.02, atol=0.2)


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_recurrent_and_latent_generation_and_bounds_in_bf16(precision):
    """What the LSTM's and the VAE-LM's evaluators run: sampling, the importance-weighted bound, decoding from z."""
    fields = PRECISIONS[precision]
    lstm_model = models.build_model("lstm", TINY_LSTM | fields)
    vae_model = models.build_model("vae_lm", TINY_VAE | fields)
    prompt, batch = _rows(5, (2, 3)), _lm_batch()

    @fast_jit
    def run(rng):
        params = nn.unbox(lstm_model.init(rng, prompt, lstm_model.initial_carry(2))["params"])
        drawn = lstm.generate(lstm_model, params, prompt, rng, max_new_tokens=5, temperature=1.0)
        params = nn.unbox(vae_model.init(rng, batch["targets"], batch["inputs"], batch["weights"], rng=rng)["params"])
        bounds = vae_lm_objective.importance_weighted_bound(vae_model, params, batch, rng, num_samples=3)
        return drawn, bounds, vae_lm.generate_from_latent(vae_model, params, bounds[2], rng, bos_id=1, max_len=5)

    drawn, (iw, bound, mu, kl), decoded = run(jax.random.key(0))
    assert drawn.shape == decoded.shape == (2, 5) and _valid_ids(drawn) and _valid_ids(decoded)
    assert _dtypes((iw, bound, mu, kl)) == {F32} and np.isfinite(np.asarray([iw, bound, kl])).all()


# --- PPO: rollout (the KV-cache sampler), scoring and update in bf16, phase by phase as the loop runs them ---


def test_ppo_iteration_in_bf16():
    """Policy, reference and reward model in bf16 compute and bf16 params (heads keep float32)."""
    fields = testing.TINY_GPT2 | dict(num_layers=1) | PRECISIONS["bf16_params"]
    policy = heads.LMWithValueHead(models.build_model("gpt2", fields))
    reward_model = reward.reward_model(models.build_model("gpt2", fields), fields["emb_dim"])
    settings = rl.RLSettings(prompt_len=6, response_len=4, epochs=1, minibatches=1, missing_eos_penalty=0.0)
    optimizer = dict(tx=optax.adam(1e-3), schedule=optax.constant_schedule(1e-3))
    trainer = rl.PPOTrainer(
        policy=policy, reward_model=reward_model, settings=settings, batch_size=2, eos_id=30, pad_id=31, **optimizer
    )
    prompts = _rows(1, (2, 6), vocab_size=30)

    @fast_jit
    def iteration(batch):
        state = nn.unbox(trainer.init(jax.random.key(0)))
        samples = trainer.run_phase("rollout", state, batch, None)
        scored = trainer.run_phase("scoring", state, batch, samples)
        return state.params, samples, scored, trainer.run_phase("update", state, batch, scored)

    batch = {"prompts": prompts, "prompt_mask": jnp.ones_like(prompts)}
    before, samples, (rollout, _), (state, metrics) = iteration(batch)
    assert _valid_ids(samples["responses"])
    for key in ("old_logprobs", "advantages", "returns", "scores"):
        assert rollout[key].dtype == F32 and np.isfinite(rollout[key]).all(), key
    assert np.isfinite(metrics["loss/total"][0]) and np.isfinite(metrics["objective/kl"][0])
    assert _dtypes(state.params["decoder"]) == {BF16}
    assert _dtypes(state.params) == _dtypes(before)
