"""Decoding: the decoder KV cache against full recomputation, left padding, EOS, sampling filters and input
checks on a tiny GPT-2; encoder-decoder beam search with scanned layers and input checks."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import decoding, models, testing

NEW_TOKENS = 8


def randomized(params, seed: int, std: float = 0.5):
    """Every leaf of `params` redrawn: normal(0, std), norm scales 1 + normal(0, 0.2). Tiny random models then
    emit varied tokens with top-1/top-2 logit margins (~1e-2) far above float noise."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def draw(path, leaf, key):
        noise = jax.random.normal(key, leaf.shape, leaf.dtype)
        return 1.0 + 0.2 * noise if path[-1].key == "scale" else std * noise

    return jax.tree_util.tree_unflatten(treedef, [draw(p, x, k) for (p, x), k in zip(leaves, keys, strict=True)])


@pytest.fixture(scope="module")
def gpt2():
    model, params = testing.tiny_gpt2()
    return model, randomized(params, seed=2)


@pytest.fixture(scope="module")
def prompts():
    """Left-padded prompts of lengths 5 and 3: (tokens [2, 5], mask [2, 5], [each unpadded prompt])."""
    tokens = testing.random_tokens((2, 5), seed=1)
    mask = np.ones_like(tokens)
    mask[1, :2] = 0
    tokens[1, :2] = 0
    return tokens, mask, [tokens[:1], tokens[1:, 2:]]


def greedy(model, params, tokens, mask=None, **kwargs):
    return np.asarray(
        decoding.generate(
            model,
            params,
            tokens,
            prompt_mask=mask,
            rng=jax.random.key(0),
            max_new_tokens=NEW_TOKENS,
            temperature=0.0,
            **kwargs,
        )
    )


def test_cache_matches_recompute(gpt2, prompts):
    tokens, mask, _ = prompts
    cached = greedy(*gpt2, tokens, mask)
    np.testing.assert_array_equal(cached, greedy(*gpt2, tokens, mask, use_cache=False))
    assert len(set(cached[0])) > 3, f"degenerate continuation {cached[0]}"


def test_left_padding_matches_unpadded_prompts(gpt2, prompts):
    tokens, mask, singles = prompts
    batched = greedy(*gpt2, tokens, mask)
    for row, single in enumerate(singles):
        np.testing.assert_array_equal(batched[row], greedy(*gpt2, single)[0], err_msg=f"row {row}")


def test_eos_stops_rows_and_pads_after(gpt2, prompts):
    tokens, mask, _ = prompts
    reference = greedy(*gpt2, tokens, mask)
    row = reference[0].tolist()
    stop = next(i for i in range(1, NEW_TOKENS) if row[i] not in row[:i])  # first new token after step 0
    eos_id, pad_id = row[stop], 3
    out = greedy(*gpt2, tokens, mask, eos_id=eos_id, pad_id=pad_id)
    for ref, got in zip(reference, out, strict=True):
        end = ref.tolist().index(eos_id) + 1 if eos_id in ref else NEW_TOKENS
        np.testing.assert_array_equal(got[:end], ref[:end])
        assert np.all(got[end:] == pad_id), got
    assert out[0, stop] == eos_id and stop < NEW_TOKENS - 1


def test_top_k_1_is_greedy(gpt2, prompts):
    tokens, mask, _ = prompts
    sampled = decoding.generate(
        *gpt2, tokens, prompt_mask=mask, rng=jax.random.key(7), max_new_tokens=NEW_TOKENS, temperature=1.3, top_k=1
    )
    np.testing.assert_array_equal(np.asarray(sampled), greedy(*gpt2, tokens, mask))


class TopPTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_top_p_keeps_the_smallest_prefix_reaching_p(self):
        probs = np.array([0.15, 0.5, 0.1, 0.25])  # sorted: 0.5 (id 1), 0.25 (3), 0.15 (0), 0.1 (2)
        logits = jnp.tile(jnp.log(probs), (4000, 1))
        for top_p, kept in ((0.3, {1}), (0.7, {1, 3}), (0.8, {0, 1, 3}), (0.95, {0, 1, 2, 3})):
            sample = self.variant(functools.partial(decoding.sample_logits, temperature=1.0, top_k=0, top_p=top_p))
            ids = np.asarray(sample(jax.random.key(0), logits))
            assert set(np.unique(ids)) == kept, (top_p, np.unique(ids))
            mass = probs[sorted(kept)].sum()
            for token in kept:  # renormalised over the kept tokens
                assert abs(np.mean(ids == token) - probs[token] / mass) < 0.03, (top_p, token)


def test_generation_past_max_len_slides_the_window(gpt2):
    """Past the 16 positions, greedy decoding equals the model's own sliding-window decode: each token the argmax
    after one forward pass over the last 16 tokens (nanoGPT's crop), for a prompt shorter and one longer than 16."""
    model, params = gpt2
    forward = jax.jit(lambda w: model.apply({"params": params}, w, positions=jnp.arange(w.shape[1])[None]))
    for prompt in (np.array([[3, 1, 4, 1, 5]]), np.arange(20).reshape(1, 20) % 32):
        got = np.asarray(
            decoding.generate(model, params, prompt, rng=jax.random.key(0), max_new_tokens=30, temperature=0)
        )
        tokens = list(prompt[0])
        for _ in range(30):
            tokens.append(int(np.argmax(forward(np.array([tokens[-16:]]))[0, -1])))
        assert got.shape == (1, 30) and got[0].tolist() == tokens[len(prompt[0]) :]
    with pytest.raises(ValueError, match="prompt length 10 \\+ max_new_tokens 8 exceeds the model's max_len 16"):
        decoding.sample(
            *gpt2, np.zeros((1, 10), np.int32), np.ones((1, 10), np.int32), jax.random.key(0), max_new_tokens=8
        )


def test_sampling_past_max_len_draws_each_token_from_its_window_and_stops_at_eos(gpt2):
    """Sampled past the 16 positions (a prompt of 20: every token from a window), token i is drawn with the i-th key
    split off the seed from the logits of one forward pass over the last 16 tokens; given an EOS, the row stops at
    its first draw and is padded after it (the device loop ends there)."""
    model, params = gpt2
    forward = jax.jit(lambda w: model.apply({"params": params}, w, positions=jnp.arange(w.shape[1])[None]))
    prompt = np.arange(20).reshape(1, 20) % 32
    rng, tokens = jax.random.key(7), list(prompt[0])
    for _ in range(12):
        rng, key = jax.random.split(rng)
        logits = forward(np.array([tokens[-16:]]))[:, -1]
        tokens.append(int(decoding.sample_logits(key, logits, temperature=1.0, top_k=0, top_p=1.0)[0]))
    drawn = tokens[20:]

    def generate(**kwargs):
        new = decoding.generate(model, params, prompt, rng=jax.random.key(7), max_new_tokens=12, **kwargs)
        return np.asarray(new)[0].tolist()

    assert generate() == drawn
    eos = drawn[5]
    stop = drawn.index(eos)
    assert generate(eos_id=eos, pad_id=31) == drawn[: stop + 1] + [31] * (11 - stop)


@pytest.mark.parametrize("bad_id", [32, -1])
def test_out_of_range_prompt_ids_raise(gpt2, bad_id):
    with pytest.raises(ValueError, match=r"prompt contains token ids outside \[0, 32\)"):
        decoding.generate(*gpt2, np.array([[1, bad_id, 2]]), rng=jax.random.key(0), max_new_tokens=2)


TINY_T5 = dict(
    vocab_size=32,
    emb_dim=16,
    num_heads=2,
    head_dim=8,
    num_encoder_layers=2,
    num_decoder_layers=2,
    mlp_dim=32,
    dropout_rate=0.0,
    relative_buckets=8,
    relative_max_distance=16,
)


def test_beam_search_with_scanned_layers_matches_per_layer():
    """The scanned decoder cache is [layers, B*K, ...]: beams must be reordered along axis 1."""
    model = models.build_model("seq2seq", TINY_T5)
    tokens = jnp.zeros((1, 4), jnp.int32)
    params = randomized(nn.unbox(model.init(jax.random.key(0), tokens, tokens)["params"]), seed=0)
    scanned_model = models.build_model("seq2seq", TINY_T5 | {"scan_layers": True})
    scanned = dict(params)
    for stack in ("encoder", "decoder"):
        layers = [params[stack][f"layer_{i}"] for i in range(2)]
        scanned[stack] = {"layers": jax.tree.map(lambda *x: jnp.stack(x), *layers)}
    inputs, mask = testing.random_tokens((2, 7), seed=3), np.ones((2, 7), np.int32)
    mask[1, 5:] = 0
    search = functools.partial(
        decoding.beam_search,
        inputs=inputs,
        beam_size=3,
        max_new_tokens=NEW_TOKENS,
        length_penalty=0.6,
        encoder_segment_ids=mask,
    )
    unconstrained, _ = search(model, params, eos_id=-1)
    eos_id = int(unconstrained[1, 2])
    tokens, scores = search(model, params, eos_id=eos_id)
    scanned_tokens, scanned_scores = search(scanned_model, scanned, eos_id=eos_id)
    np.testing.assert_array_equal(scanned_tokens, tokens)
    np.testing.assert_allclose(scanned_scores, scores, rtol=1e-5)
    assert np.any(np.asarray(tokens) == eos_id) and len(set(np.asarray(unconstrained).ravel().tolist())) > 3


def test_seq2seq_input_checks():
    bart_like = models.build_model("seq2seq", TINY_T5 | dict(positions="learned", position_offset=2, max_len=12))
    with pytest.raises(ValueError, match="max_new_tokens 11 exceeds the 10 positions of the model's learned position"):
        decoding.generate_seq2seq(bart_like, {}, np.ones((1, 4), np.int32), rng=jax.random.key(0), max_new_tokens=11)
    with pytest.raises(ValueError, match="input length 11 exceeds the 10 positions"):
        decoding.beam_search(bart_like, {}, np.ones((1, 11), np.int32), beam_size=2, max_new_tokens=4, eos_id=1)
    with pytest.raises(ValueError, match=r"inputs contains token ids outside \[0, 32\)"):
        decoding.generate_seq2seq(bart_like, {}, np.array([[1, 32]]), rng=jax.random.key(0), max_new_tokens=2)
    with pytest.raises(ValueError, match="early_stopping must be True, False or 'never'"):
        decoding.beam_search(
            bart_like,
            {},
            np.ones((1, 3), np.int32),
            beam_size=2,
            max_new_tokens=4,
            eos_id=1,
            early_stopping="sometimes",
        )


def reference_sample(model, params, tokens, mask, rng, *, new_tokens, eos_id=None, stop=(), pad_id=0, **settings):
    """A plain host loop: full forward pass per step, the random stream of `decoding.sample` (row b's token t drawn
    with fold_in(split(rng, B)[b], t)). -> (tokens [B, N], log-probs of the temperature-scaled logits [B, N], mask
    [B, N])."""
    batch = tokens.shape[0]
    sequence, segments = np.asarray(tokens), np.asarray(mask)
    done = np.zeros(batch, bool)
    out, log_probs, out_mask = [], [], []
    row_keys = jax.random.split(rng, batch)
    for step in range(new_tokens):
        positions = np.maximum(np.cumsum(segments, axis=1) - 1, 0)
        logits = model.apply({"params": params}, sequence, positions=positions, segment_ids=segments)[:, -1]
        drawn = [
            decoding.sample_logits(jax.random.fold_in(row_keys[b], step), logits[b : b + 1], **settings)[0]
            for b in range(batch)
        ]
        token = np.where(done, pad_id, np.asarray(drawn))
        temperature = settings["temperature"] or 1.0
        log_prob = np.asarray(jax.nn.log_softmax(logits / temperature))[np.arange(batch), token]
        out.append(token), log_probs.append(np.where(done, 0.0, log_prob)), out_mask.append(~done)
        sequence = np.concatenate([sequence, token[:, None]], axis=1)
        segments = np.concatenate([segments, np.ones((batch, 1), segments.dtype)], axis=1)
        generated = np.stack(out, axis=1)
        done = (
            done
            | (token == eos_id)
            | np.array([any(row[-len(s) :].tolist() == list(s) for s in stop) for row in generated])
        )
        if done.all():
            break
    pad = new_tokens - len(out)
    tokens = np.pad(np.stack(out, axis=1), ((0, 0), (0, pad)), constant_values=pad_id)
    return (
        tokens,
        np.pad(np.stack(log_probs, axis=1), ((0, 0), (0, pad))),
        np.pad(np.stack(out_mask, axis=1), ((0, 0), (0, pad))),
    )


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.0, top_k=0, top_p=1.0),
        dict(temperature=1.3, top_k=5, top_p=1.0),
        dict(temperature=0.8, top_k=0, top_p=0.7),
    ],
)
def test_sample_under_an_outer_jit_equals_a_host_loop(gpt2, prompts, settings):
    tokens, mask, _ = prompts
    rng = jax.random.key(11)

    @jax.jit
    def run(params, tokens, mask, rng):
        return decoding.sample(gpt2[0], params, tokens, mask, rng, max_new_tokens=NEW_TOKENS, **settings)

    samples = run(gpt2[1], tokens, mask, rng)
    expected_tokens, expected_log_probs, expected_mask = reference_sample(
        *gpt2, tokens, mask, rng, new_tokens=NEW_TOKENS, **settings
    )
    np.testing.assert_array_equal(samples.tokens, expected_tokens)
    np.testing.assert_allclose(samples.log_probs, expected_log_probs, atol=1e-5)
    np.testing.assert_array_equal(samples.mask, expected_mask)
    np.testing.assert_array_equal(
        samples.tokens,
        np.asarray(decoding.generate(*gpt2, tokens, prompt_mask=mask, rng=rng, max_new_tokens=NEW_TOKENS, **settings)),
    )


def test_rows_stop_at_eos_or_a_stop_sequence(gpt2, prompts):
    tokens, mask, _ = prompts
    free = greedy(*gpt2, tokens, mask)
    stop_sequence = tuple(free[1, 2:4].tolist())  # row 1 stops after its 4th token
    eos_id = int(free[0, 1])  # row 0 stops after its 2nd token (unless stop_sequence comes first)
    settings = dict(temperature=0.0, top_k=0, top_p=1.0)
    samples = decoding.sample(
        *gpt2,
        tokens,
        mask,
        jax.random.key(0),
        max_new_tokens=NEW_TOKENS,
        eos_id=eos_id,
        stop_sequences=(stop_sequence,),
        pad_id=3,
        **settings,
    )
    expected = reference_sample(
        *gpt2,
        tokens,
        mask,
        jax.random.key(0),
        new_tokens=NEW_TOKENS,
        eos_id=eos_id,
        stop=(stop_sequence,),
        pad_id=3,
        **settings,
    )
    np.testing.assert_array_equal(samples.tokens, expected[0])
    np.testing.assert_array_equal(samples.mask, expected[2])
    lengths = np.asarray(samples.mask).sum(axis=1)
    assert lengths[0] <= 2 and lengths[1] <= 4 and lengths.max() < NEW_TOKENS, lengths
    for row, length in enumerate(lengths):
        assert np.all(np.asarray(samples.tokens)[row, length:] == 3) and np.all(
            np.asarray(samples.log_probs)[row, length:] == 0
        )
