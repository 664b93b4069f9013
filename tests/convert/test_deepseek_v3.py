"""DeepSeek-V3 (`lmzoo.models.deepseek`, `lmzoo.layers.latent_attention`, `lmzoo.convert.deepseek`) against HF's
DeepseekV3ForCausalLM, on random models of unusual shapes: 3 heads on hidden 24 with 5 unrotated + 4 rotated query/key
dimensions and values of 6 (or 9: wider than the keys), latents of 12 and 14 (or no query latent, DeepSeek-V2-Lite's
form), vocabulary 61, left padding, the interleaved and the rotate-half rotation, YaRN's frequencies and softmax scale,
dense layers then mixtures of 8 experts routed by sigmoid scores with a random correction bias among 2 of 4 groups (or
no groups), routed scaling, 1 or 2 shared experts, tied and untied heads. Also the decode cache (equal to the full
forward, smaller than a multi-head cache by its byte count), the generation engine, the config refusals, the
released shape and a training step."""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import config as config_lib
from lmzoo import decoding, kernels
from lmzoo.convert import deepseek, export, hf, safetensors_reader, tables
from lmzoo.layers import mlp
from lmzoo.models import build_model, make_config
from lmzoo.objectives import tasks
from lmzoo.serving import engine, slots

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -r requirements-test.txt)"
)

TOL, VOCAB = 1e-4, 61
CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=24,
    intermediate_size=40,
    moe_intermediate_size=10,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=3,
    kv_lora_rank=12,
    q_lora_rank=14,
    qk_nope_head_dim=5,
    qk_rope_head_dim=4,
    v_head_dim=6,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    max_position_embeddings=32,
    rms_norm_eps=1e-5,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10_000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
}
CASES = {
    # DeepSeek-V3's layout: query latent, interleaved rotation, YaRN, 4 groups of 2 experts (top-3 in the best 2).
    "v3_yarn": dict(rope_parameters=YARN),
    # DeepSeek-V2-Lite's attention (no query latent), rotate-half, values wider than the keys (9 > 3 + 4), 2 dense
    # layers, no groups, top-2 weights as they are, 2 shared experts, the head tied to the embeddings.
    "lite_halves_tied": dict(
        q_lora_rank=None,
        rope_interleave=False,
        qk_nope_head_dim=3,
        v_head_dim=9,
        first_k_dense_replace=2,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        n_shared_experts=2,
        routed_scaling_factor=1.0,
        tie_word_embeddings=True,
    ),
}


def random_hf_model(case: str, seed: int = 0):
    """A float32 DeepseekV3ForCausalLM of `case` in eval mode with every weight random, the routers wide (a top-k is
    rarely a near tie) and the correction biases random (they change which experts are chosen)."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**SHAPE | CASES[case])
    model = transformers.DeepseekV3ForCausalLM._from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    )
    model = model.float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


def target_params(cfg):
    model = build_model("deepseek", cfg)
    return nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]))


def padded_batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens [3, 12], left-padding mask (row 1: 3 pads, row 2: 7) and positions counted from the first real token."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, (3, 12), dtype=np.int64)
    mask = np.ones_like(tokens)
    mask[1, :3] = mask[2, :7] = 0
    return tokens, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def hf_logits(model, tokens, mask, positions) -> np.ndarray:
    with torch.no_grad():
        return model(
            torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask), position_ids=torch.from_numpy(positions)
        ).logits.numpy()


def lmzoo_logits(cfg, params, tokens, mask, positions) -> np.ndarray:
    model = build_model("deepseek", cfg)
    return np.asarray(
        model.apply({"params": params}, jnp.asarray(tokens), positions=jnp.asarray(positions), segment_ids=mask)
    )


def max_diff(ours, theirs, mask) -> float:
    """Max |ours - theirs| over the real (unpadded) positions."""
    return float(np.max(np.abs(ours - theirs)[mask.astype(bool)]))


def saved(tmp_path, case, **kwargs):
    """(HF model, its folder as save_pretrained writes it, lmzoo config of that folder)."""
    model = random_hf_model(case)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True, **kwargs)
    config_json, _ = safetensors_reader.read_safetensors_dir(tmp_path / "hf")
    return model, tmp_path / "hf", deepseek.config_from_hf(config_json)


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_logits_generation_and_export_match_hf(tmp_path, case):
    """hf:FOLDER (sharded and read into scanned layers for v3_yarn) -> the same logits as HF's on left-padded rows, the
    same tensors back, the same greedy tokens as HF's generate, and an export HF loads with those logits."""
    scanned = case == "v3_yarn"
    model, folder, fields = saved(tmp_path, case, **({"max_shard_size": "20KB"} if scanned else {}))
    cfg = make_config("deepseek", fields | {"scan_layers": scanned})
    params, report = hf.convert_pretrained(f"hf:{folder}", "deepseek", cfg, target_params(cfg))
    assert not report.initialised and not report.dropped and not report.config_differences
    tokens, mask, positions = padded_batch()
    ref = hf_logits(model, tokens, mask, positions)
    diff = max_diff(lmzoo_logits(cfg, params, tokens, mask, positions), ref, mask)
    print(f"{case}: max |lmzoo - HF| logits {diff:.2e} (logit std {ref.std():.2f})")
    assert diff <= TOL, f"max |lmzoo - HF| logits = {diff:.3e} ({case}, logit std {ref.std():.2f})"

    _, state_dict = safetensors_reader.read_safetensors_dir(folder)
    back = deepseek.to_hf(params, cfg)
    if cfg.tie_embeddings:  # save_pretrained leaves the tied copy out
        np.testing.assert_array_equal(back.pop("lm_head.weight"), back["model.embed_tokens.weight"])
    assert sorted(back) == sorted(state_dict)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], np.asarray(value), err_msg=key)

    prompts, prompt_mask = tokens[:, 4:10], mask[:, 4:10]  # 0, 0 and 3 left pads
    ours = decoding.generate(
        build_model("deepseek", cfg),
        params,
        prompts,
        prompt_mask=prompt_mask,
        rng=jax.random.key(0),
        max_new_tokens=6,
        temperature=0.0,
    )
    with torch.no_grad():
        theirs = model.generate(
            torch.from_numpy(prompts), attention_mask=torch.from_numpy(prompt_mask), max_new_tokens=6, do_sample=False
        )
    np.testing.assert_array_equal(np.asarray(ours), theirs[:, prompts.shape[1] :].numpy(), err_msg=case)

    summary = export.export_hf("deepseek", cfg, params, str(tmp_path / "export"))
    assert summary["model_type"] == "deepseek_v3"
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "export"), attn_implementation="eager", experts_implementation="eager"
    ).eval()
    assert type(exported) is type(model)
    diff = max_diff(hf_logits(exported, tokens, mask, positions), ref, mask)
    assert diff <= TOL, f"exported {case}: max |from_pretrained - HF| logits = {diff:.3e}"


@pytest.mark.parity
def test_moe_layer_routes_as_hf():
    """One MoE layer on 64 tokens: HF's DeepseekV3MoE and lmzoo's MoeBlock give the same output, and the correction
    bias decides the choice (without it the experts and the output differ)."""
    model = random_hf_model("v3_yarn")
    cfg = make_config("deepseek", deepseek.config_from_hf(model.config.to_dict()))
    layer = model.model.layers[1].mlp
    params = deepseek.from_hf({k: v.numpy() for k, v in _saved_state_dict(model).items()}, cfg)
    moe_params = params["moe_blocks"]["layer_0"]["mlp"]
    x = np.random.default_rng(1).normal(0.0, 1.0, (2, 32, 24)).astype(np.float32)
    with torch.no_grad():
        theirs = layer(torch.from_numpy(x)).numpy()
        _, weights, chosen = layer.gate(torch.from_numpy(x))
    block = mlp.MoeBlock(cfg.moe)
    ours = np.asarray(block.apply({"params": moe_params}, jnp.asarray(x), deterministic=True))
    assert np.max(np.abs(ours - theirs)) <= 1e-5
    assert np.allclose(weights.sum(-1).numpy(), 2.5, atol=1e-5)  # renormalised, times routed_scaling_factor
    unbiased = moe_params | {"correction_bias": np.zeros_like(moe_params["correction_bias"])}
    assert (
        np.max(np.abs(np.asarray(block.apply({"params": unbiased}, jnp.asarray(x), deterministic=True)) - ours)) > 1e-2
    )
    groups = chosen.numpy().reshape(-1, 3) // 2  # 4 groups of 2 experts: every token's top-3 lies in 2 groups
    assert max(len(set(row)) for row in groups) <= 2


def _saved_state_dict(model):
    """The state dict as save_pretrained writes it: one tensor per expert (transformers 5 fuses them in memory)."""
    state = {}
    for key, value in model.state_dict().items():
        if key.endswith("experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                state[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e]
                state[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e]
        elif key.endswith("experts.down_proj"):
            for e in range(value.shape[0]):
                state[key.replace("down_proj", f"{e}.down_proj.weight")] = value[e]
        else:
            state[key] = value
    return state


TINY = dict(
    vocab_size=VOCAB,
    max_len=40,
    emb_dim=24,
    num_heads=3,
    num_layers=3,
    mlp_dim=40,
    q_lora_rank=14,
    kv_lora_rank=12,
    qk_nope_head_dim=5,
    qk_rope_head_dim=4,
    v_head_dim=6,
    rope_scaling_factor=4.0,
    rope_original_max_len=8,
    rope_mscale=1.0,
    rope_mscale_all_dim=0.7,
    first_dense_layers=1,
    num_experts=8,
    experts_per_token=3,
    expert_mlp_dim=10,
    expert_groups=4,
    groups_per_token=2,
)


def random_model(**fields):
    """A lmzoo deepseek with every leaf random: weights normal(0, 0.5), norm scales 1 + normal(0, 0.2), correction
    biases normal(0, 0.1)."""
    model = build_model("deepseek", TINY | fields)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    stds = {"scale": 0.2, "correction_bias": 0.1}

    def draw(path, leaf, key):
        noise = stds.get(path[-1].key, 0.5) * jax.random.normal(key, leaf.shape, leaf.dtype)
        return 1.0 + noise if path[-1].key == "scale" else noise

    return model, jax.tree_util.tree_unflatten(treedef, [draw(p, x, k) for (p, x), k in zip(leaves, keys, strict=True)])


@pytest.mark.parametrize("scan", [False, True])
def test_decode_cache_equals_the_full_forward(scan):
    """A left-padded prompt prefilled into the latent cache, then one token a step: each step's logits are the full
    forward's at that position; greedy `generate` (the cache) equals the argmax of the full forward (no cache)."""
    model, params = random_model(scan_layers=scan)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (3, 14)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[1, :3] = mask[2, :6] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    full = np.asarray(model.apply({"params": params}, tokens, positions=positions, segment_ids=mask))
    prompt = 8
    cache = slots.init_cache(model, 3, 40)
    logits, variables = model.apply(
        {"params": params, "cache": cache},
        tokens[:, :prompt],
        positions=positions[:, :prompt],
        segment_ids=mask[:, :prompt],
        decode=True,
        mutable=["cache"],
    )
    steps = [np.asarray(logits)]
    for i in range(prompt, tokens.shape[1]):
        logits, variables = model.apply(
            {"params": params, "cache": variables["cache"]},
            tokens[:, i : i + 1],
            positions=positions[:, i : i + 1],
            segment_ids=mask[:, i : i + 1],
            decode=True,
            mutable=["cache"],
        )
        steps.append(np.asarray(logits))
    diff = max_diff(np.concatenate(steps, axis=1), full, mask)
    print(f"scan={scan}: max |decode - full forward| logits {diff:.2e} (logit std {full.std():.2f})")
    assert diff <= 1e-4

    def greedy(use_cache):
        return decoding.generate(
            model,
            params,
            tokens[:, :prompt],
            prompt_mask=mask[:, :prompt],
            rng=jax.random.key(0),
            max_new_tokens=10,
            temperature=0.0,
            use_cache=use_cache,
        )

    np.testing.assert_array_equal(np.asarray(greedy(True)), np.asarray(greedy(False)))


def test_engine_greedy_equals_generate():
    """Five prompts through 2 slots, 3 steps a chunk: slots refilled while others decode, every reply `generate`'s."""
    model, params = random_model()
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(0, VOCAB, n)) for n in (5, 3, 9, 1, 7)]
    requests = [engine.Request(p, max_tokens=3 + 2 * i, temperature=0.0) for i, p in enumerate(prompts)]
    tickets = engine.Engine(model, params, slots=2, chunk=3, length=40).generate(requests)
    width = max(map(len, prompts))
    tokens, mask = np.zeros((len(prompts), width), np.int32), np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    replies = decoding.generate(
        model, params, tokens, prompt_mask=mask, rng=jax.random.key(0), max_new_tokens=11, temperature=0.0
    )
    expected = [[int(t) for t in reply[: r.max_tokens]] for reply, r in zip(np.asarray(replies), requests, strict=True)]
    assert [t.outputs[0].tokens for t in tickets] == expected


@pytest.mark.parametrize("scan", [False, True])
def test_compressed_cache_is_the_latents_and_rotary_keys(scan):
    """The decode cache holds A + P = 12 + 4 numbers a position and layer (`kv_cache_bytes`), where multi-head
    attention's keys and values would hold N (Hn + P + G) = 3 x 15 = 45."""
    model, _ = random_model(scan_layers=scan)
    cfg = model.config
    batch, length = 2, 40
    cache = slots.init_cache(model, batch, length)
    flat = {"/".join(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]}
    stored = sum(leaf.nbytes for name, leaf in flat.items() if name.endswith(("cached_latent", "cached_rope_key")))
    assert stored == cfg.kv_cache_bytes(batch, length) == 3 * batch * length * (12 + 4) * 4
    multi_head = cfg.num_layers * batch * length * cfg.num_heads * (5 + 4 + 6) * 4
    assert stored * 45 == multi_head * 16
    total = sum(leaf.nbytes for leaf in flat.values())  # with the validity flags and write indices
    assert total < multi_head / 2


def test_config_round_trip_and_refusals():
    for case in CASES:
        fields = deepseek.config_from_hf(transformers.DeepseekV3Config(**SHAPE | CASES[case]).to_dict())
        assert deepseek.config_from_hf(deepseek.config_to_hf(make_config("deepseek", fields))) == fields, case
    v3 = deepseek.config_from_hf(transformers.DeepseekV3Config(**SHAPE | CASES["v3_yarn"]).to_dict())
    assert (v3["q_lora_rank"], v3["rope_scaling_factor"], v3["rope_mscale_all_dim"], v3["rope_interleave"]) == (
        14,
        4.0,
        0.7,
        True,
    )
    assert (v3["first_dense_layers"], v3["expert_groups"], v3["groups_per_token"], v3["routed_scaling"]) == (
        1,
        4,
        2,
        2.5,
    )
    lite = deepseek.config_from_hf(transformers.DeepseekV3Config(**SHAPE | CASES["lite_halves_tied"]).to_dict())
    assert (lite["q_lora_rank"], lite["rope_interleave"], lite["tie_embeddings"], lite["num_shared_experts"]) == (
        0,
        False,
        True,
        2,
    )
    base = {"model_type": "deepseek_v3", **{k: v for k, v in SHAPE.items() if v is not None}}
    refused = {
        r"attention_bias=True": {"attention_bias": True},
        r"hidden_act='gelu'": {"hidden_act": "gelu"},
        r"scoring_func='softmax'": {"scoring_func": "softmax"},
        r"topk_method='greedy'": {"topk_method": "greedy"},
        r"moe_layer_freq=2": {"moe_layer_freq": 2},
        r"num_key_value_heads=1": {"num_key_value_heads": 1},
        r"n_shared_experts=0": {"n_shared_experts": 0},
        r"rope_type 'llama3'": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        r"DeepseekV3ForTokenClassification": {"architectures": ["DeepseekV3ForTokenClassification"]},
        r"n_group=None": {"n_group": None},
    }
    for message, extra in refused.items():
        with pytest.raises(tables.ConfigError, match=message):
            deepseek.config_from_hf(base | extra)


def test_multi_token_prediction_layers_are_skipped():
    """A checkpoint's MTP module (num_nextn_predict_layers: layers past the last) is not read, as HF does not."""
    model = random_hf_model("lite_halves_tied")
    state = {k: v.numpy() for k, v in _saved_state_dict(model).items()}
    cfg = make_config("deepseek", deepseek.config_from_hf(model.config.to_dict()))
    extra = state | {"model.layers.3.eh_proj.weight": np.zeros((24, 48), np.float32)}
    params = deepseek.from_hf(extra, cfg, num_mtp_layers=1)
    assert set(params) == {"embed", "dense_blocks", "moe_blocks", "norm"}
    with pytest.raises(ValueError, match=r"unexpected keys \['layers.3.eh_proj.weight'\]"):
        deepseek.from_hf(extra, cfg)


# DeepSeek-V3's config.json on the Hub (deepseek-ai/DeepSeek-V3), without its FP8 quantization_config (a bf16 copy).
HUB = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    aux_loss_alpha=0.001,
    ep_size=1,
    first_k_dense_replace=3,
    hidden_act="silu",
    hidden_size=7168,
    initializer_range=0.02,
    intermediate_size=18432,
    kv_lora_rank=512,
    max_position_embeddings=163840,
    moe_intermediate_size=2048,
    moe_layer_freq=1,
    n_group=8,
    n_routed_experts=256,
    n_shared_experts=1,
    norm_topk_prob=True,
    num_attention_heads=128,
    num_experts_per_tok=8,
    num_hidden_layers=61,
    num_key_value_heads=128,
    num_nextn_predict_layers=1,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    rms_norm_eps=1e-06,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    rope_theta=10000,
    routed_scaling_factor=2.5,
    scoring_func="sigmoid",
    seq_aux=True,
    tie_word_embeddings=False,
    topk_group=4,
    topk_method="noaux_tc",
    v_head_dim=128,
    vocab_size=129280,
)


def test_released_shape_is_the_hub_config():
    """configs/deepseek_v3.py:deepseek_v3_671b is what `init_from=hf:` reads from DeepSeek-V3's config.json (no field
    differs), with the parameter count and the cache bytes of its docstring."""
    config = config_lib.load_config_file(CONFIGS / "deepseek_v3.py", "deepseek_v3_671b")
    cfg = make_config("deepseek", config.model.to_dict())
    assert hf.differing_fields(deepseek.config_from_hf(HUB), cfg) == []
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(target_params(cfg)))
    assert count == 671_026_419_200
    assert cfg.kv_cache_bytes(1, 1) == 70_272


def test_a_training_step_lowers_the_loss():
    """The causal LM task on the tiny config: finite gradients, the correction bias's the load imbalance of its
    layer's experts (what `optim.expert_bias_rate` steps against; never a gradient of the loss), no auxiliary loss,
    and a few SGD steps lower the loss."""
    config = config_lib.load_config_file(CONFIGS / "deepseek_v3.py", "tiny")
    model = build_model("deepseek", config.model.to_dict())
    task = tasks.causal_lm_task(model)
    tokens = np.random.default_rng(0).integers(0, 66, (4, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((4, 16), np.float32)}
    params, _ = task.init(jax.random.key(0), batch)
    params = nn.unbox(params)

    def loss(p):
        value, (metrics, _) = task.loss(p, None, None, batch, jax.random.key(1), step=0, train=True)
        return value, metrics

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (first, metrics), grads = grad_fn(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    bias_grads = [g for path, g in jax.tree_util.tree_leaves_with_path(grads) if path[-1].key == mlp.CORRECTION_BIAS]
    load = np.array([float(metrics[f"expert_load/0_{e}"][0]) for e in range(config.model.num_experts)])
    assert len(bias_grads) == 1 and np.ptp(load) > 0  # the tiny config's one layer of experts, unevenly loaded
    np.testing.assert_allclose(np.reshape(bias_grads[0], -1), load - load.mean(), rtol=1e-5, atol=1e-7)
    total, count = metrics["moe/aux_loss"]
    assert float(total) == 0.0 and float(count) == 1
    for _ in range(5):
        (value, _), grads = grad_fn(params)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    assert float(grad_fn(params)[0][0]) < float(first) - 0.05


@pytest.mark.parametrize("v_head_dim", [6, 12])
def test_accelerator_attention_form_matches_the_cpu_form(v_head_dim):
    """`jax.nn.dot_product_attention`'s XLA form (GPUs, TPUs), which wants keys and values of one size, gets them
    padded: values narrower (6) or wider (12) than the 9 of a query/key head give the CPU form's logits, in the full
    forward and in the absorbed decode (keys of 12 + 4, values of 12 against the latent cache)."""
    model, params = random_model(v_head_dim=v_head_dim)
    tokens = np.random.default_rng(4).integers(0, VOCAB, (2, 10)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[1, :4] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)

    def run():
        full = model.apply({"params": params}, tokens, positions=positions, segment_ids=mask)
        step, _ = model.apply(
            {"params": params, "cache": slots.init_cache(model, 2, 40)},
            tokens,
            positions=positions,
            segment_ids=mask,
            decode=True,
            mutable=["cache"],
        )
        return np.asarray(full), np.asarray(step)

    cpu_full, cpu_step = run()
    with kernels.use_platform("gpu"):
        xla_full, xla_step = run()
    assert max_diff(xla_full, cpu_full, mask) <= TOL and max_diff(xla_step, cpu_step, mask) <= TOL
    assert max_diff(cpu_step, cpu_full, mask) <= 1e-4
