"""DPO / IPO: the loss on hand-made log-probs, reply masking, the comparison arrays, parity of loss and gradients with
an independent PyTorch implementation of trl's formulas, and SFT -> DPO through the training loop with exact resume."""

import functools
import gzip
import itertools
import json
import logging
import math
import pathlib
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import config as config_lib
from lmzoo import metrics as metrics_lib
from lmzoo import models, sharding, testing, tokenizers
from lmzoo.data import comparisons
from lmzoo.objectives import dpo
from lmzoo.rl import preference
from lmzoo.train import loop
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
REAL_FILE = ROOT.parent / "shared" / "data" / "hh_rlhf" / "harmless-base_test.jsonl.gz"
PAD = 31


class DPOLossTest(chex.TestCase):
    # Log-probs of (chosen, rejected) for 3 comparisons; the third is a padding row.
    POLICY = jnp.array([[-3.0, -5.0], [-4.0, -2.0], [-1.0, -1.0]])
    REFERENCE = jnp.array([[-3.5, -4.5], [-4.0, -3.0], [-7.0, -2.0]])
    WEIGHTS = jnp.array([1.0, 1.0, 0.0])

    @chex.variants(with_jit=True, without_jit=True)
    def test_sigmoid_and_conservative_loss_equal_the_closed_form(self):
        # h = (π_w − π_l) − (ref_w − ref_l): 2 − 1 = 1 and −2 − (−1) = −1.
        def closed_form(h, smoothing):
            sigmoid = 1 / (1 + math.exp(-0.5 * h))
            return -(1 - smoothing) * math.log(sigmoid) - smoothing * math.log(1 - sigmoid)

        for smoothing in (0.0, 0.2):
            loss = self.variant(functools.partial(preference.dpo_loss, beta=0.5, label_smoothing=smoothing))
            value, metrics = loss(self.POLICY, self.REFERENCE, self.WEIGHTS)
            expected = closed_form(1.0, smoothing) + closed_form(-1.0, smoothing)
            np.testing.assert_allclose(value, expected / 2, rtol=1e-6)
            np.testing.assert_allclose(metrics["loss"], (expected, 2.0), rtol=1e-6)
        # Implicit rewards β(π − ref): chosen 0.25, 0; rejected −0.25, 0.5; margins 0.5 (right), −0.5 (wrong).
        np.testing.assert_allclose(metrics["rewards/chosen"], (0.25, 2.0))
        np.testing.assert_allclose(metrics["rewards/rejected"], (0.25, 2.0))
        np.testing.assert_allclose(metrics["rewards/margin"], (0.0, 2.0), atol=1e-7)
        np.testing.assert_allclose(metrics["rewards/accuracy"], (1.0, 2.0))

    @chex.variants(with_jit=True, without_jit=True)
    def test_ipo_loss_is_the_squared_distance_to_one_over_two_beta(self):
        loss = self.variant(functools.partial(preference.dpo_loss, beta=0.25, loss_type="ipo"))
        value, _ = loss(self.POLICY, self.REFERENCE, self.WEIGHTS)
        np.testing.assert_allclose(value, ((1.0 - 2.0) ** 2 + (-1.0 - 2.0) ** 2) / 2, rtol=1e-6)

    def test_policy_equal_to_reference_gives_log_two_and_no_margin(self):
        value, metrics = preference.dpo_loss(self.POLICY, self.POLICY, jnp.ones(3), beta=0.1)
        np.testing.assert_allclose(value, math.log(2.0), rtol=1e-6)
        assert metrics["rewards/accuracy"][0] == 0.0 and metrics["rewards/margin"][0] == 0.0  # ties count as wrong


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match=r"beta=0.0: must be > 0"):
        dpo.DPOConfig(beta=0.0)
    with pytest.raises(ValueError, match=r"label_smoothing=0.5: must lie in \[0, 0.5\)"):
        dpo.DPOConfig(label_smoothing=0.5)
    with pytest.raises(ValueError, match="loss_type='hinge'"):
        dpo.DPOConfig(loss_type="hinge")
    with pytest.raises(ValueError, match="the ipo loss has none"):
        dpo.DPOConfig(loss_type="ipo", label_smoothing=0.1)


def test_reply_logprobs_sum_reply_tokens_only_and_ignore_padding():
    model, params = testing.tiny_gpt2()
    rows = testing.random_tokens((2, 2, 9), vocab_size=30, seed=2)
    tokens = np.full((2, 2, 12), PAD, np.int32)
    tokens[0, 0, :9], tokens[0, 1, :7], tokens[1, 0, :5], tokens[1, 1, :9] = (
        rows[0, 0],
        rows[0, 1, :7],
        rows[1, 0, :5],
        rows[1, 1],
    )
    prompt_lengths = np.array([3, 4], np.int32)
    summed, counts = preference.reply_logprobs(
        model, params, jnp.asarray(tokens), jnp.asarray(prompt_lengths), pad_id=PAD
    )
    for b, k in itertools.product(range(2), range(2)):
        row = tokens[b, k][tokens[b, k] != PAD]
        log_probs = jax.nn.log_softmax(jax.jit(model.apply)({"params": params}, row[None])[0])
        p = prompt_lengths[b]
        expected = sum(float(log_probs[t - 1, row[t]]) for t in range(p, len(row)))  # the row alone, no padding
        np.testing.assert_allclose(summed[b, k], expected, rtol=1e-5)
        assert counts[b, k] == len(row) - p


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_shared_reply_logprobs_and_gradients_are_those_of_the_rows_run_whole(family):
    """Each prompt run once for its two replies: the log-probs, token counts and gradients of `reply_logprobs` over
    rows cut with a prompt budget of 5 (prompts of 5, 2, 1 and no tokens; replies of 1-7 tokens with their EOS)."""
    if family == "gpt2":
        model, params = testing.tiny_gpt2()
    else:
        fields = dict(vocab_size=32, max_len=16, emb_dim=24, num_heads=3, num_kv_heads=1, num_layers=2, mlp_dim=40)
        model = models.build_model("llama", fields)
        params = model.init(jax.random.key(0), np.zeros((1, 12), np.int32))["params"]
    budget, length = 5, 12
    rng = np.random.default_rng(4)
    prompt_lengths = np.array([5, 2, 1, 0], np.int32)
    reply_lengths = [(7, 3), (1, 7), (4, 4), (6, 2)]
    tokens = np.full((4, 2, length), PAD, np.int32)
    for b, p in enumerate(prompt_lengths):
        prompt = rng.integers(0, 30, p)
        for k, n in enumerate(reply_lengths[b]):
            tokens[b, k, : p + n] = np.concatenate([prompt, rng.integers(0, 30, n)])

    def summed(logprobs, params):
        values, counts = logprobs(model, params, jnp.asarray(tokens), jnp.asarray(prompt_lengths), pad_id=PAD)
        return jnp.sum(values * jnp.array([1.0, -0.5])), (values, counts)

    shared = functools.partial(preference.shared_reply_logprobs, prompt_budget=budget)
    (_, (values, counts)), grads = jax.jit(jax.value_and_grad(functools.partial(summed, shared), has_aux=True))(params)
    (_, (whole_values, whole_counts)), whole_grads = jax.jit(
        jax.value_and_grad(functools.partial(summed, preference.reply_logprobs), has_aux=True)
    )(params)
    np.testing.assert_array_equal(counts, whole_counts)
    np.testing.assert_array_equal(counts[3], np.array(reply_lengths[3]) - 1)  # no prompt: the first token is unread
    np.testing.assert_allclose(values, whole_values, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(grads, whole_grads, rtol=1e-4, atol=1e-6)


def test_the_dpo_loss_with_a_prompt_budget_runs_each_prompt_once():
    """dpo_task with max_prompt_len: the loss of the rows run whole, at fewer flops (prompts of 8 tokens read once
    for their 2 replies of at most 4)."""
    model, params = testing.tiny_gpt2()
    rng = np.random.default_rng(5)
    tokens = np.full((4, 2, 12), PAD, np.int32)
    tokens[:, :, :8] = rng.integers(0, 30, (4, 1, 8))
    tokens[:, :, 8:11] = rng.integers(0, 30, (4, 2, 3))
    batch = {"tokens": jnp.asarray(tokens), "prompt_lengths": jnp.full((4,), 8, jnp.int32)}
    frozen = {"reference": jax.tree.map(lambda x: x * 0.9, params)}

    def loss_and_flops(budget):
        task = dpo.dpo_task(model, dpo.DPOConfig(max_prompt_len=budget), pad_id=PAD)
        loss = jax.jit(jax.grad(lambda p: task.loss(p, frozen, {}, batch, jax.random.key(0), step=0, train=True)[0]))
        value = jax.jit(lambda p: task.loss(p, frozen, {}, batch, jax.random.key(0), step=0, train=True)[0])(params)
        return float(value), loss.lower(params).compile().cost_analysis()["flops"]

    (shared, shared_flops), (whole, whole_flops) = loss_and_flops(8), loss_and_flops(0)
    np.testing.assert_allclose(shared, whole, rtol=1e-5)
    assert shared_flops < 0.75 * whole_flops, f"{shared_flops / whole_flops:.2f}x the rows' flops"


def test_a_prompt_budget_cuts_prompts_to_their_end_and_replies_to_the_rest():
    tokenizer = tokenizers.build_tokenizer("byte")
    config = config_lib.load_config_file(ROOT / "configs" / "hh_dpo.py", "tiny")
    config.objective.max_prompt_len = 10
    seq_len = config.data.seq_len
    raw = [comparisons.Comparison("a long prompt of many bytes", "x" * (2 * seq_len), "short")]
    arrays = dpo.dpo_examples(raw, tokenizer, config, "train split")
    assert arrays["prompt_lengths"][0] == 10
    np.testing.assert_array_equal(arrays["tokens"][0, 0, :10], tokenizer.encode("a long prompt of many bytes")[-10:])
    np.testing.assert_array_equal(arrays["lengths"][0], [seq_len, 10 + len("short") + 1])  # reply ⊕ EOS <= seq_len - 10
    assert arrays["tokens"][0, 0, seq_len - 1] == tokenizer.eos_id
    config.objective.max_prompt_len = seq_len - 1
    with pytest.raises(ValueError, match=f"max_prompt_len={seq_len - 1} leaves no room for a reply and its EOS"):
        dpo.DPO(config).check()
    with pytest.raises(ValueError, match="max_prompt_len=-1: must be >= 0"):
        dpo.DPOConfig(max_prompt_len=-1)


def test_dpo_examples_measure_the_prompt_and_skip_identical_replies(caplog):
    tokenizer = tokenizers.build_tokenizer("byte")
    config = config_lib.load_config_file(ROOT / "configs" / "hh_dpo.py", "tiny")
    raw = [
        comparisons.Comparison("\n\nHuman: hi\n\nAssistant:", " hello", " go away"),
        comparisons.Comparison("\n\nHuman: same?\n\nAssistant:", " yes", " yes"),
        comparisons.Comparison("\n\nHuman: " + "long " * 40 + "\n\nAssistant:", " " + "reply " * 20, " no"),
    ]
    with caplog.at_level(logging.WARNING):
        arrays = dpo.dpo_examples(raw, tokenizer, config, "train split")
    assert "skipped 1 of 3 comparisons whose chosen and rejected replies are identical" in caplog.text
    assert arrays["tokens"].shape == (2, 2, config.data.seq_len)
    np.testing.assert_array_equal(arrays["prompt_lengths"][0], len(tokenizer.encode(raw[0].prompt)))
    for i, comparison in enumerate((raw[0], raw[2])):
        p = arrays["prompt_lengths"][i]
        prompt = tokenizer.encode(comparison.prompt)[-p:]
        for k, reply in enumerate((comparison.chosen, comparison.rejected)):
            row = arrays["tokens"][i, k]
            np.testing.assert_array_equal(row[:p], prompt)  # the prompt as kept: its end
            kept = arrays["lengths"][i, k] - p - 1
            np.testing.assert_array_equal(row[p : p + kept], tokenizer.encode(reply)[:kept])
            assert row[p + kept] == tokenizer.eos_id
    assert arrays["prompt_lengths"][1] < len(tokenizer.encode(raw[2].prompt))  # a long prompt was cut


torch = pytest.importorskip("torch", reason="the parity test needs torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip("transformers", reason="the parity test needs transformers")


def _random_hf_gpt2(seed: int):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_embd=16,
        n_head=2,
        n_layer=2,
        n_positions=16,
        vocab_size=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.GPT2LMHeadModel(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if ".ln_" in name and name.endswith("weight") else 0.0, 0.3)
    return model


def _torch_dpo_loss(policy, reference, tokens, prompt_lengths, *, beta, label_smoothing, loss_type):
    """trl's DPOTrainer formulas: log-probs of the completion tokens (labels shifted by one, prompt and padding
    masked), averaged over them for IPO; logits = π log-ratio − reference log-ratio; sigmoid / IPO losses, mean."""
    batch, _, length = tokens.shape
    flat = torch.from_numpy(tokens.reshape(-1, length)).long()
    attention = (flat != PAD).long()
    position_ids = (attention.cumsum(1) - 1).clamp(min=0)
    starts = torch.from_numpy(np.repeat(prompt_lengths, 2)).long()[:, None]
    loss_mask = (torch.arange(1, length)[None] >= starts) & attention[:, 1:].bool()

    def logps(model):
        logits = model(flat, attention_mask=attention, position_ids=position_ids).logits[:, :-1]
        per_token = torch.gather(logits.log_softmax(-1), 2, flat[:, 1:, None]).squeeze(2)
        total = (per_token * loss_mask).sum(-1)
        if loss_type == "ipo":
            total = total / loss_mask.sum(-1)
        return total.view(batch, 2)

    chosen, rejected = logps(policy).unbind(1)
    with torch.no_grad():
        ref_chosen, ref_rejected = logps(reference).unbind(1)
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    if loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = (
            -torch.nn.functional.logsigmoid(beta * logits) * (1 - label_smoothing)
            - torch.nn.functional.logsigmoid(-beta * logits) * label_smoothing
        )
    return losses.mean()


@pytest.mark.parity
@pytest.mark.parametrize(
    "fields", [dict(beta=0.1), dict(beta=0.5, label_smoothing=0.2), dict(beta=0.3, loss_type="ipo")], ids=str
)
def test_loss_and_gradients_match_a_pytorch_implementation_of_trl_formulas(fields):
    from lmzoo.convert import gpt2 as convert_gpt2
    from lmzoo.models import build_model, make_config

    policy, reference = _random_hf_gpt2(0), _random_hf_gpt2(1)
    cfg = make_config("gpt2", convert_gpt2.config_from_hf(policy.config.to_dict()))
    model = build_model("gpt2", cfg)
    state = lambda m: {k: v.detach().numpy() for k, v in m.state_dict().items()}  # noqa: E731
    params = convert_gpt2.from_hf(state(policy), cfg)
    frozen = {"reference": convert_gpt2.from_hf(state(reference), cfg)}
    lengths = np.array([[12, 9], [7, 16], [10, 11]])
    tokens = np.full((3, 2, 16), PAD, np.int32)
    for (b, k), n in np.ndenumerate(lengths):
        tokens[b, k, :n] = testing.random_tokens((n,), vocab_size=30, seed=10 + 2 * b + k)
    prompt_lengths = np.array([5, 3, 6], np.int32)
    tokens[:, 1, :7] = tokens[:, 0, :7]  # both replies follow the same prompt
    batch = {"tokens": jnp.asarray(tokens), "prompt_lengths": jnp.asarray(prompt_lengths)}

    task = dpo.dpo_task(model, dpo.DPOConfig(**fields), pad_id=PAD)
    loss_fn = lambda p: task.loss(p, frozen, {}, batch, jax.random.key(0), step=0, train=True)[0]  # noqa: E731
    value, grads = jax.value_and_grad(loss_fn)(params)
    expected = _torch_dpo_loss(
        policy, reference, tokens, prompt_lengths, **{**dict(label_smoothing=0.0, loss_type="sigmoid"), **fields}
    )
    expected.backward()
    expected_grads = convert_gpt2.from_hf({k: p.grad.numpy() for k, p in policy.named_parameters()}, cfg)

    assert abs(float(value) - expected.item()) <= 1e-5 * abs(expected.item())
    # Relative to the largest gradient entry: some leaves (the key biases, to which softmax is blind) are exactly 0.
    scale = max(float(np.max(np.abs(e))) for e in jax.tree.leaves(dict(expected_grads)))
    errors = jax.tree.map(lambda g, e: float(np.max(np.abs(g - e))) / scale, grads, dict(expected_grads))
    worst = max(jax.tree.leaves(errors))
    print(
        f"DPO parity {fields}: loss {float(value):.6f} vs {expected.item():.6f}, max relative gradient error {worst:.2e}"
    )
    assert worst <= 1e-5, errors
    assert all(p.grad is None for p in reference.parameters())  # the reference gets no gradient


# ---------------------------------------------------------------------------------------------------------------------
# SFT -> DPO through the training loop on a slice of the real HH-RLHF file.


def _stage(name: str, data: str, **train):
    config = config_lib.load_config_file(ROOT / "configs" / f"{name}.py", "tiny")
    config.data.path = data
    config.train.update(train)
    return config


def _rows(workdir) -> list[dict]:
    return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _state_arrays(state) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path((state.params, state.opt_state, state.rng, state.step))[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A 40-pair slice of the real file (~36 training pairs, so DPO batches come round again) and 2 SFT steps on it."""
    root = tmp_path_factory.mktemp("dpo")
    data = root / "hh.jsonl"
    with gzip.open(REAL_FILE, "rt", encoding="utf-8") as f:
        data.write_text("".join(itertools.islice(f, 40)))
    loop.train_and_evaluate(_stage("hh_sft", str(data), steps=2), str(root / "sft"))
    return {"data": str(data), "sft": str(root / "sft"), "root": root}


def _dpo_config(sft_run, **train):
    config = _stage("hh_dpo", sft_run["data"], **train)
    config.objective.sft = "ckpt:" + sft_run["sft"]
    return config


def test_dpo_raises_the_implicit_reward_margin_of_the_pairs_it_trained_on(sft_run):
    steps = 6
    workdir = str(sft_run["root"] / "dpo_trained")
    loop.train_and_evaluate(_dpo_config(sft_run, steps=steps), workdir)
    run = run_lib.open_run(workdir)
    _, trained = run_lib.restore_step(run)
    start = run_lib.build(_dpo_config(sft_run, steps=steps), workdir + "_start")
    initial, _ = run_lib.restore_or_init(start)

    def summary(state):
        loader = run.train_loader()
        totals = []
        with run.context():
            for step in range(steps):
                batch = sharding.put_batch(loader.batch(step), run.compiled.batch_sharding)
                totals.append(jax.device_get(run.compiled.eval_step(state, batch, {})[0]))
        return metrics_lib.summarize(jax.tree.map(lambda *x: sum(x), *totals), token_nll=False)

    before, after = summary(initial), summary(trained)
    run.close()
    start.close()
    # The policy starts as the reference: every margin 0, the loss log 2.
    assert before["loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert before["rewards/margin"] == 0.0 and before["rewards/accuracy"] == 0.0
    assert after["rewards/margin"] > 0.0 and after["rewards/accuracy"] > 0.6 and after["loss"] < math.log(2.0)
    assert after["rewards/chosen"] > after["rewards/rejected"]
    assert after["logps/chosen"] != before["logps/chosen"]
    first = [r for r in _rows(workdir) if r["split"] == "train"][0]
    assert first["loss"] == pytest.approx(math.log(2.0), abs=1e-6)  # the first step starts at the reference
    assert "rewards/accuracy" in [r for r in _rows(workdir) if r["split"] == "validation"][-1]
    # The reference is never checkpointed: the checkpoint holds no frozen parameters, and a restore reads them again.
    restored = run_lib.open_run(workdir)
    assert jax.tree.leaves(run_lib.restore_step(restored, frozen=False)[1].frozen) == []
    reference = jax.device_get(run_lib.restore_step(restored)[1].frozen["reference"])
    restored.close()
    jax.tree.map(np.testing.assert_array_equal, reference, run_lib.load(sft_run["sft"]).params)


def test_resumed_dpo_continues_exactly(sft_run):
    straight, resumed = (str(sft_run["root"] / name) for name in ("dpo_straight", "dpo_resumed"))
    loop.train_and_evaluate(_dpo_config(sft_run, steps=4), straight)
    loop.train_and_evaluate(_dpo_config(sft_run, steps=2), resumed)
    loop.train_and_evaluate(_dpo_config(sft_run, steps=4), resumed)
    arrays = {}
    for workdir in (straight, resumed):
        run = run_lib.open_run(workdir)
        arrays[workdir] = _state_arrays(run_lib.restore_step(run)[1])
        run.close()
    assert arrays[straight].keys() == arrays[resumed].keys()
    for key, value in arrays[straight].items():
        np.testing.assert_array_equal(arrays[resumed][key], value, err_msg=key)
    last = [[r for r in _rows(w) if r["split"] == "train" and r["step"] == 4][0] for w in (straight, resumed)]
    for key in ("loss", "rewards/margin", "rewards/accuracy", "logps/chosen", "logps/rejected"):
        assert last[0][key] == last[1][key], key


def test_a_reference_of_another_model_or_tokenizer_is_refused_before_training(sft_run, tmp_path):
    config = _dpo_config(sft_run, steps=1)
    config.model.emb_dim = 48
    with pytest.raises(
        ValueError, match=r"is not a config.model decoder: .*attn/key/kernel \(32, 2, 16\) there vs \(48, 2, 24\) here"
    ):
        loop.train_and_evaluate(config, str(tmp_path / "wider"))
    other = tmp_path / "sft_other_tokenizer"
    shutil.copytree(sft_run["sft"], other)
    saved = json.loads((other / "config.json").read_text())
    saved["data"]["tokenizer"] = {"kind": "gpt2", "path": "/gpt2"}
    (other / "config.json").write_text(json.dumps(saved))
    config = _dpo_config(sft_run, steps=1)
    config.objective.sft = f"ckpt:{other}"
    with pytest.raises(ValueError, match=r"differs from this run in \['tokenizer'\]: tokenizer .*'gpt2'"):
        loop.train_and_evaluate(config, str(tmp_path / "other_tokenizer"))
