"""ELMo: the backward direction reads each sentence reversed within its length, padding changes nothing, the
embedding and softmax are shared, the scalar mix, frozen features under a classifier, and biLM pretraining
through the real loop."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lmzoo import testing
from lmzoo.data import loaders
from lmzoo.models import elmo
from lmzoo.objectives import bilm, elmo_classify
from lmzoo.train import loop
from lmzoo.train import run as run_lib

CONFIG = elmo.ELMoConfig(vocab_size=11, emb_dim=8, num_layers=2, dropout_rate=0.0, init_scale=0.4)


def _sentences():
    tokens = np.random.default_rng(0).integers(0, 11, size=(3, 7)).astype(np.int32)
    weights = (np.arange(7) < np.array([[7], [4], [2]])).astype(np.float32)
    return np.where(weights > 0, tokens, 0), weights


def test_backward_stack_reads_each_sentence_reversed_and_ignores_padding():
    model = elmo.BiLM(CONFIG)
    tokens, weights = _sentences()
    params = nn.unbox(model.init(jax.random.key(0), tokens, weights)["params"])
    assert set(params) == {
        "embedding",
        "out",
        "forward_layers_0",
        "forward_layers_1",
        "backward_layers_0",
        "backward_layers_1",
    }
    # With the backward layers set to the forward ones, the backward logits of a sentence are the forward logits
    # of the sentence reversed (reversed back into place).
    mirrored = {**params, **{f"backward_layers_{i}": params[f"forward_layers_{i}"] for i in range(2)}}
    lengths = weights.sum(1).astype(np.int32)
    reversed_tokens = np.asarray(
        elmo.reverse_within_length(jnp.asarray(tokens)[..., None], jnp.asarray(lengths))[..., 0]
    )
    _, backward, layers = model.apply({"params": mirrored}, tokens, weights)
    forward_of_reversed, _, _ = model.apply({"params": mirrored}, reversed_tokens, weights)
    expected = elmo.reverse_within_length(forward_of_reversed, jnp.asarray(lengths))
    real = weights > 0
    np.testing.assert_allclose(np.asarray(backward)[real], np.asarray(expected)[real], atol=1e-5)
    assert layers.shape == (3, 3, 7, 16)
    # Padding after a sentence changes none of its real positions, in either direction.
    longer = np.pad(tokens, ((0, 0), (0, 3)), constant_values=5)
    f2, b2, l2 = model.apply({"params": params}, longer, np.pad(weights, ((0, 0), (0, 3))))
    f1, b1, l1 = model.apply({"params": params}, tokens, weights)
    for short, long in ((f1, f2), (b1, b2)):
        np.testing.assert_allclose(np.asarray(short)[real], np.asarray(long)[:, :7][real], atol=1e-5)
    np.testing.assert_allclose(np.asarray(l1)[:, real], np.asarray(l2)[:, :, :7][:, real], atol=1e-5)


def test_scalar_mix_and_a_classifier_on_frozen_features():
    layers = jax.random.normal(jax.random.key(0), (3, 2, 5, 4))
    mix = elmo.ScalarMix()
    mix_params = mix.init(jax.random.key(1), layers)
    np.testing.assert_allclose(mix.apply(mix_params, layers), layers.mean(axis=0), atol=1e-6)
    scores = {"params": {"scores": jnp.array([0.0, 0.0, 50.0]), "gamma": jnp.array(2.0)}}
    np.testing.assert_allclose(mix.apply(scores, layers), 2.0 * layers[2], atol=1e-5)

    bilm_model, head = elmo.BiLM(CONFIG), elmo.ELMoClassifier(num_classes=2)
    tokens, weights = _sentences()
    bilm_params = nn.unbox(bilm_model.init(jax.random.key(0), tokens, weights)["params"])
    features = jax.lax.stop_gradient(bilm_model.apply({"params": bilm_params}, tokens, weights)[2])
    head_params = head.init(jax.random.key(2), features, weights)["params"]
    labels = jnp.array([0, 1, 1])

    def loss(p):
        logits = head.apply({"params": p}, features, weights)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    tx = optax.adam(0.05)

    @jax.jit
    def train(p):
        def update(carry, _):
            p, opt_state = carry
            grads = jax.grad(loss)(p)
            updates, opt_state = tx.update(grads, opt_state)
            return (optax.apply_updates(p, updates), opt_state), None

        return jax.lax.scan(update, (p, tx.init(p)), None, length=30)[0][0]

    trained = train(head_params)
    assert loss(trained) < 0.5 * loss(head_params)
    assert np.abs(np.asarray(trained["ScalarMix_0"]["scores"])).sum() > 0  # the mix weights are learnt


def test_bilm_pretrains_through_the_loop(tmp_path):
    config, _ = testing.tiny_word_corpus_config(tmp_path, "ptb_elmo")
    final = loop.train_and_evaluate(config, str(tmp_path / "run"))
    assert abs(final["loss"] - (final["forward_loss"] + final["backward_loss"]) / 2) < 1e-5
    assert final["perplexity"] < 16
    _classify_on_frozen_features(tmp_path, config)
    batch = bilm.framed({"targets": np.array([[3, 4, 15, 0]]), "weights": np.array([[1, 1, 1, 0]], np.float32)}, 15)
    np.testing.assert_array_equal(batch["tokens"], [[15, 3, 4, 15, 0]])
    np.testing.assert_array_equal(batch["weights"], [[1, 1, 1, 1, 0]])


def test_bilm_batches_are_cut_to_their_longest_sentence():
    ids, weights = loaders.sentence_rows(np.array([3, 4, 15, 5, 15, 6, 7, 8, 9, 15]), 15, max_len=12)
    loader = loaders.SentenceLoader(ids, weights, 2, length_multiple=4)
    first, second = (bilm.framed(b, 15) for b in (loader.batch(0), loader.batch(1)))
    assert first["tokens"].shape == (2, 5)  # longest sentence 3 tokens -> 4 columns, and the leading <eos>
    np.testing.assert_array_equal(first["tokens"], [[15, 3, 4, 15, 0], [15, 5, 15, 0, 0]])
    assert second["tokens"].shape == (2, 9)  # 5 tokens -> 8 columns; the missing row weighs 0
    np.testing.assert_array_equal(second["weights"].sum(1), [6, 0])
    assert bilm.framed(loaders.SentenceLoader(ids, weights, 2).batch(0), 15)["tokens"].shape == (2, 13)


def _classify_on_frozen_features(tmp_path, bilm_config):
    """elmo_classify on the biLM run above: the head trains, the frozen biLM stays exactly the checkpoint's."""
    from configs import sst2_elmo

    rng = np.random.default_rng(1)
    for name, rows in (("train", 48), ("dev", 16)):
        lines = ["sentence\tlabel"] + [
            f"{' '.join(rng.choice(['w1', 'w2', 'w3', 'w4'], size=4))}\t{rng.integers(0, 2)}" for _ in range(rows)
        ]
        (tmp_path / f"{name}.tsv").write_text("\n".join(lines) + "\n")
    pretrained = run_lib.load(str(tmp_path / "run")).params
    bilm_words = run_lib.load(str(tmp_path / "run")).tokenizer.words
    for features, mixed_layers in (("elmo", 3), ("static", 1), ("scratch", 1)):
        config = sst2_elmo.get_config("tiny")
        config.model.vocab_size = 16
        config.data.train_path, config.data.validation_path = str(tmp_path / "train.tsv"), str(tmp_path / "dev.tsv")
        config.objective.bilm, config.objective.features = f"ckpt:{tmp_path / 'run'}", features
        with pytest.raises(ValueError, match="the biLM's word ids"):
            elmo_classify.ELMoClassify(config).check()
        config.data.tokenizer.path = str(tmp_path / "run" / "tokenizer" / "words.txt")
        if features == "scratch":
            with pytest.raises(ValueError, match="reads no biLM"):
                elmo_classify.ELMoClassify(config).check()
            config.objective.bilm = ""
        workdir = tmp_path / f"sst2_{features}"
        final = loop.train_and_evaluate(config, str(workdir))
        assert 0.0 <= final["accuracy"] <= 1.0 and final["examples" if "examples" in final else "tokens"] == 16
        run = run_lib.open_run(str(workdir))
        assert run.tokenizer.words == bilm_words  # the biLM's ids, not a vocabulary rebuilt from the TSV
        _, state = run_lib.restore_step(run)
        assert state.params["head"]["ScalarMix_0"]["scores"].shape == (mixed_layers,)
        if features == "scratch":  # no biLM: the embedding table trains from its random initialisation
            assert set(state.params) == {"head", "embedding"} and not jax.tree.leaves(state.frozen)
            initial = run.compiled.init(jax.random.key(config.train.seed)).params["embedding"]
            assert not np.allclose(np.asarray(state.params["embedding"]), np.asarray(initial))
        else:
            assert set(state.params) == {"head"}
            frozen = run_lib.load_frozen(run)["bilm"]
            jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), frozen, pretrained)
        run.close()
