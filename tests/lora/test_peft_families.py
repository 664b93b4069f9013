"""PEFT LoRA adapters <-> lmzoo (`lmzoo.lora.peft`) for the families past Llama: Qwen3 and Gemma 3 (llama family
options), gpt-oss's attention, DeepSeek-V3 (MLA projections; its dense MLP and shared experts read from a folder
written by hand), Qwen3.5 (gated attention, Gated DeltaNet projections, MLPs; its fused q_proj and in_proj_qkv) and
Qwen3.5-MoE (and its shared expert), on random HF models of odd shapes, both ways: a PEFT adapter read by lmzoo (into
per-layer and scanned params) gives PEFT's logits, an lmzoo adapter written by `save_peft` loads in
`peft.PeftModel.from_pretrained` and gives lmzoo's. Also the refusals: experts and routers (no nn.Linear in HF), MLP
linears PEFT would retarget to the experts, a shared expert's gate, PEFT's target_parameters, and a fused linear whose
lmzoo kernels carry an A each."""

import dataclasses
import functools
import json
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import lora
from lmzoo.convert import deepseek, llama, mapping, qwen3_5, safetensors_reader
from lmzoo.lora import peft
from lmzoo.models import build_model, make_config

torch = pytest.importorskip("torch", reason="PEFT parity needs torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip("transformers", reason="PEFT parity needs transformers")
hf_peft = pytest.importorskip("peft", reason="PEFT parity needs peft (pip install -r requirements-test.txt)")

TOL = 1e-5  # as tests/lora/test_peft.py
VOCAB = 61
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
COMMON = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
ATTENTION, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
SLIDING, FULL = "sliding_attention", "full_attention"


class Family(NamedTuple):
    model_name: str  # lmzoo's
    converter: Any
    hf_class: str  # transformers' *ForCausalLM
    hf_config: Any  # () -> its transformers config
    hf_targets: list[str]  # PEFT's target_modules for the adapter PEFT makes
    targets: str  # lmzoo's LoraConfig.targets for the adapter lmzoo writes
    rank: int
    fields: dict = {}  # config.model overrides


QWEN3_5 = dict(
    COMMON,
    hidden_size=24,
    num_hidden_layers=2,
    layer_types=["linear_attention", FULL],
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=6,
    linear_value_head_dim=5,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
)
FAMILIES = {
    # 3 query heads of head_dim 10 (set apart from hidden 24) sharing 1 kv head, q/k norms, an MLP of 36, 2 layers.
    "qwen3": Family(
        "llama",
        llama,
        "Qwen3ForCausalLM",
        lambda: transformers.Qwen3Config(
            **COMMON,
            hidden_size=24,
            num_attention_heads=3,
            head_dim=10,
            num_key_value_heads=1,
            intermediate_size=36,
            num_hidden_layers=2,
            max_position_embeddings=32,
        ),
        ATTENTION + MLP,
        "query|key|value|out|wi_0|wi_1|wo",
        4,
    ),
    # 5 query heads of 6 on hidden 20 in 1 kv head, a sliding layer (window 3) then a global one, GELU-tanh MLP of 28.
    "gemma3": Family(
        "llama",
        llama,
        "Gemma3ForCausalLM",
        lambda: transformers.Gemma3TextConfig(
            **COMMON,
            hidden_size=20,
            num_attention_heads=5,
            head_dim=6,
            num_key_value_heads=1,
            intermediate_size=28,
            num_hidden_layers=2,
            max_position_embeddings=32,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=12,
            sliding_window=3,
            layer_types=[SLIDING, FULL],
            rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 1e4}, FULL: {"rope_type": "default"}},
        ),
        ATTENTION + MLP,
        "query|key|value|out|wi_0|wi_1|wo",
        4,
    ),
    # 3 query heads of 8 on hidden 24 in 1 kv head with q/k/v/o biases and sinks, 5 experts of F 14 top-2, sliding (4)
    # then full; only the attention is nn.Linear.
    "gpt_oss": Family(
        "llama",
        llama,
        "GptOssForCausalLM",
        lambda: transformers.GptOssConfig(
            **COMMON,
            hidden_size=24,
            num_attention_heads=3,
            head_dim=8,
            num_key_value_heads=1,
            intermediate_size=14,
            num_hidden_layers=2,
            num_local_experts=5,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            sliding_window=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        ),
        ATTENTION,
        "query|key|value|out",
        4,
    ),
    # MLA with a query latent of 14, a kv latent of 12, heads of 5 + 4 (rope) for keys and 6 for values; one dense
    # layer (MLP of 40), then 8 experts of F 10 (top-3 in 2 of 4 groups) beside a shared expert.
    "deepseek_v3": Family(
        "deepseek",
        deepseek,
        "DeepseekV3ForCausalLM",
        lambda: transformers.DeepseekV3Config(
            **COMMON,
            hidden_size=24,
            intermediate_size=40,
            moe_intermediate_size=10,
            num_hidden_layers=2,
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
            first_k_dense_replace=1,
            max_position_embeddings=32,
        ),
        # PEFT (on transformers 5) retargets gate_proj, up_proj and down_proj of deepseek_v3 to the experts' fused
        # tensors: the MLPs' adapters are read from a folder written by hand (transformers 4's) and refused on writing.
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
        "query_latent|query|kv_latent|kv_up|out",
        4,
    ),
    # A Gated DeltaNet layer (2 key heads of 6, 4 value heads of 5) then gated full attention (3 query heads of 8, 1 kv
    # head), an MLP of 36; chunks of 4 positions.
    "qwen3_5": Family(
        "qwen3_5",
        qwen3_5,
        "Qwen3_5ForCausalLM",
        lambda: transformers.Qwen3_5TextConfig(**QWEN3_5, intermediate_size=36),
        [*ATTENTION, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", *MLP],
        "attn/(query|key|value|out)|linear_attn/(query|key|value|gate|beta|decay|out)|wi_0|wi_1|wo",
        3,
        {"chunk_size": 4},
    ),
}
QWEN3_5_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=10, shared_expert_intermediate_size=12)
# Qwen3.5-MoE's shapes: 4 experts of F 10 top-2 beside a shared expert of 12 and its gate (an nn.Linear to one output,
# lmzoo's [D] vector, which lmzoo's LoRA does not adapt); PEFT's MLP names adapt the shared expert.
FAMILIES["qwen3_5_moe"] = FAMILIES["qwen3_5"]._replace(
    hf_class="Qwen3_5MoeForCausalLM",
    hf_config=lambda: transformers.Qwen3_5MoeTextConfig(**QWEN3_5, **QWEN3_5_MOE),
    targets="attn/(query|key|value|out)|linear_attn/(query|key|value|gate|beta|decay|out)|shared/(wi_0|wi_1|wo)",
)


def randomize(model) -> None:
    """Every weight of an HF model random, in place: norms around their identity (1, or 0 where HF adds 1), routers
    and sinks wide (a top-k is rarely a near tie), Qwen3.5's decay rates spread, the rest N(0, 0.15)."""
    zero_centred = type(model).__name__.startswith(("Gemma3", "Qwen3_5"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight") or ("norm" in name and not zero_centred):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "norm" in name:
                param.normal_(0.0, 0.2)
            elif name.endswith(("mlp.gate.weight", "router.weight", "sinks")):
                param.normal_(0.0, 0.5 if "sinks" not in name else 1.0)
            elif name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(0.01, 4.0).log())
            else:
                param.normal_(0.0, 0.15)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)


def hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.numpy()


@functools.cache
def logits_fn(model_name, cfg):
    model = build_model(model_name, cfg)
    return jax.jit(lambda params: model.apply({"params": params}, jnp.asarray(TOKENS)))


class Base(NamedTuple):
    family: Family
    base_model: Any  # () -> the seeded random HF model, float32, eval
    cfg: Any
    params: Any  # lmzoo's, from the saved HF folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def base(request, tmp_path_factory) -> Base:
    family = FAMILIES[request.param]

    def base_model():
        torch.manual_seed(0)
        model_class = getattr(transformers, family.hf_class)
        kwargs = {} if family.model_name == "qwen3_5" else {"attn_implementation": "eager"}
        if model_class.__name__ in ("GptOssForCausalLM", "DeepseekV3ForCausalLM", "Qwen3_5MoeForCausalLM"):
            kwargs["experts_implementation"] = "eager"
        model = model_class._from_config(family.hf_config(), **kwargs).float().eval()
        randomize(model)
        return model

    folder = tmp_path_factory.mktemp(f"{request.param}_hf")
    base_model().save_pretrained(str(folder))  # experts one tensor each, as the converters read them
    config_json, state_dict = safetensors_reader.read_safetensors_dir(folder)
    cfg = make_config(family.model_name, family.converter.config_from_hf(config_json) | family.fields)
    return Base(family, base_model, cfg, family.converter.from_hf(state_dict, cfg))


def lmzoo_adapters(b: Base, config: lora.LoraConfig, seed: int = 1) -> Any:
    abstract = jax.eval_shape(build_model(b.family.model_name, b.cfg).init, jax.random.key(0), jnp.asarray(TOKENS))
    adapters = nn.unbox(lora.init_adapters(jax.random.key(0), abstract["params"], config))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: rng.normal(0.0, 0.05, x.shape).astype(np.float32), adapters)


@pytest.mark.parity
def test_peft_adapter_in_lmzoo_matches_peft(base, tmp_path):
    family = base.family
    torch.manual_seed(1)
    model = hf_peft.get_peft_model(
        base.base_model(),
        hf_peft.LoraConfig(r=family.rank, lora_alpha=8, lora_dropout=0.05, target_modules=family.hf_targets),
    ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(str(tmp_path))
    with model.disable_adapter():
        unadapted = hf_logits(model)
    if family.model_name == "deepseek":
        add_mlp_adapters(model, tmp_path, scale=8 / family.rank)
    theirs = hf_logits(model)
    adapters, config = peft.load_peft(str(tmp_path), base.params, family.model_name, base.cfg)
    assert (config.rank, config.alpha, config.dropout) == (family.rank, 8.0, 0.05)
    run = logits_fn(family.model_name, base.cfg)
    ours, before = np.asarray(run(lora.merge(base.params, adapters, config))), np.asarray(run(base.params))
    diff, base_diff = float(np.max(np.abs(ours - theirs))), float(np.max(np.abs(before - unadapted)))
    moved = float(np.max(np.abs(theirs - unadapted)))
    print(
        f"PEFT -> lmzoo, {family.hf_class}: max |lmzoo - PEFT| logits {diff:.2e} (without the adapter {base_diff:.2e};"
        f" the adapter moves them by {moved:.2f})"
    )
    assert diff <= TOL and moved > 0.1

    # into a model that scans its layers: the adapters stacked as the params are
    scanned = dataclasses.replace(base.cfg, scan_layers=True)
    abstract = jax.eval_shape(build_model(family.model_name, scanned).init, jax.random.key(0), jnp.asarray(TOKENS))
    params = mapping.materialize(mapping.to_layout(base.params, nn.unbox(abstract)["params"]))
    adapters, config = peft.load_peft(str(tmp_path), params, family.model_name, scanned)
    ours = np.asarray(logits_fn(family.model_name, scanned)(lora.merge(params, adapters, config)))
    assert float(np.max(np.abs(ours - theirs))) <= TOL


def add_mlp_adapters(model, folder, scale: float) -> None:
    """Adds LoRA weights of DeepSeek-V3's dense MLP and shared experts to a PEFT folder (as transformers 4's PEFT
    wrote them: PEFT on transformers 5 retargets these names to the routed experts) and merges them into `model`'s
    weights as PEFT computes them, W + scale * B A."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / peft.WEIGHTS_FILE)
    generator = torch.Generator().manual_seed(2)
    for name, module in model.named_modules():
        if name.endswith(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")) or ".shared_experts." in name:
            if not isinstance(module, torch.nn.Linear):
                continue
            a = 0.1 * torch.randn(model.peft_config["default"].r, module.in_features, generator=generator)
            b = 0.1 * torch.randn(module.out_features, a.shape[0], generator=generator)
            with torch.no_grad():
                module.weight += scale * b @ a
            key = name.removeprefix("base_model.model.")
            tensors |= {f"{peft.PREFIX}{key}.lora_A.weight": a.numpy(), f"{peft.PREFIX}{key}.lora_B.weight": b.numpy()}
    assert len(tensors) == 2 * (5 * 2 + 3 + 3)  # MLA in 2 layers, the dense MLP, the shared experts
    save_file(tensors, folder / peft.WEIGHTS_FILE, metadata={"format": "pt"})


@pytest.mark.parity
def test_lmzoo_adapter_in_peft_matches_lmzoo(base, tmp_path):
    family = base.family
    config = lora.LoraConfig(family.targets, rank=family.rank, alpha=6.0, rslora=True)
    adapters = lmzoo_adapters(base, config)
    if family.model_name == "deepseek":  # the MLPs' adapters: PEFT would retarget them, or they are experts
        mlp = lora.LoraConfig("wi_0|wo", rank=family.rank, alpha=6.0)
        with pytest.raises(ValueError) as error:
            peft.save_peft(str(tmp_path), lmzoo_adapters(base, mlp), mlp, family.model_name, base.cfg)
        message = str(error.value)
        assert (
            "dense_blocks/layer_0/mlp/wo: PEFT (0.21, on transformers 5) retargets down_proj of a deepseek_v3 model "
            "to its experts' fused tensors, so PeftModel.from_pretrained would not load this adapter of "
            "model.layers.0.mlp.down_proj: merge the adapters (lmzoo.lora.merge) and export the merged model"
        ) in message
        assert "moe_blocks/layer_0/mlp/shared/wi_0: PEFT" in message
        assert "moe_blocks/layer_0/mlp/wi_0: HF's model.layers.1.mlp.experts (experts are fused" in message
    if family.model_name == "qwen3_5":
        # HF's in_proj_qkv is one nn.Linear: one A for lmzoo's query, key and value; q_proj (query and gate) with only
        # the query adapted; kernels of one linear with an A each are refused.
        attn, mixer = (
            adapters["blocks"]["layer_0"]["block_1"]["attn"],
            adapters["blocks"]["layer_0"]["block_0"]["linear_attn"],
        )
        for name in ("key", "value"):
            mixer[name]["lora_a"] = mixer["query"]["lora_a"]
        attn["gate"] = {"lora_a": 0.5 * attn["query"]["lora_a"], "lora_b": attn["query"]["lora_b"]}  # an A of its own
        with pytest.raises(ValueError) as error:
            peft.save_peft(str(tmp_path), adapters, config, family.model_name, base.cfg)
        assert str(error.value) == (
            "cannot write these adapters as PEFT's for qwen3_5: blocks/layer_0/block_1/attn/gate and "
            "blocks/layer_0/block_1/attn/query: HF's model.layers.1.self_attn.q_proj is one nn.Linear, which PEFT adapts "
            "with one lora_A, and these adapters have an A each: adapt one of them only, or merge the adapters "
            "(lmzoo.lora.merge) and export the merged model"
        )
        del attn["gate"]
    summary = peft.save_peft(str(tmp_path), adapters, config, family.model_name, base.cfg)
    assert summary["target_modules"] == sorted(family.hf_targets)
    run = logits_fn(family.model_name, base.cfg)
    ours = np.asarray(run(lora.merge(base.params, adapters, config)))
    loaded = hf_peft.PeftModel.from_pretrained(base.base_model(), str(tmp_path)).eval()
    theirs = hf_logits(loaded)
    with loaded.disable_adapter():
        unadapted = hf_logits(loaded)
    diff, base_diff = (
        float(np.max(np.abs(ours - theirs))),
        float(np.max(np.abs(np.asarray(run(base.params)) - unadapted))),
    )
    moved = float(np.max(np.abs(theirs - unadapted)))
    print(
        f"lmzoo -> PEFT, {family.hf_class}: max |PEFT - lmzoo| logits {diff:.2e} (without the adapter {base_diff:.2e};"
        f" the adapter moves them by {moved:.2f})"
    )
    assert diff <= TOL and moved > 0.1
    back, back_config = peft.load_peft(str(tmp_path), base.params, family.model_name, base.cfg)
    again = np.asarray(run(lora.merge(base.params, back, back_config)))
    assert float(np.max(np.abs(again - ours))) <= TOL  # read back: the same model


def test_experts_and_routers_are_refused(tmp_path):
    """gpt-oss's experts (fused parameter tensors) and router (a TopKRouter's weight) are no nn.Linear: lmzoo's
    adapters of them are refused naming each module, as is a PEFT folder holding LoRA weights of them."""
    fields = llama.config_from_hf(FAMILIES["gpt_oss"].hf_config().to_dict())
    cfg = make_config("llama", fields)
    config = lora.LoraConfig("query|wi_0|router", rank=2, alpha=4.0)
    b = Base(FAMILIES["gpt_oss"], None, cfg, None)
    adapters = lmzoo_adapters(b, config)
    with pytest.raises(ValueError) as error:
        peft.save_peft(str(tmp_path), adapters, config, "llama", cfg)
    message = str(error.value)
    assert (
        "blocks/layer_1/mlp/wi_0: HF's model.layers.1.mlp.experts (experts are fused parameter tensors, not an "
        "nn.Linear, and cannot be adapted by PEFT): merge the adapters (lmzoo.lora.merge) and export the merged model "
        "instead" in message
    )
    assert (
        "blocks/layer_0/mlp/router: HF's model.layers.0.mlp.router (a TopKRouter's weight, not an nn.Linear" in message
    )
    assert "attn/query" not in message and "\n" not in message

    del adapters["blocks"]["layer_0"]["mlp"], adapters["blocks"]["layer_1"]["mlp"]
    peft.save_peft(str(tmp_path), adapters, config, "llama", cfg)  # the attention alone is written
    from safetensors.numpy import load_file, save_file

    tensors = load_file(tmp_path / peft.WEIGHTS_FILE)
    expert = f"{peft.PREFIX}model.layers.0.mlp.experts.gate_up_proj.lora_A.weight"
    save_file(tensors | {expert: np.zeros((2, 24), np.float32)}, tmp_path / peft.WEIGHTS_FILE)
    abstract = jax.eval_shape(build_model("llama", cfg).init, jax.random.key(0), jnp.asarray(TOKENS))["params"]
    with pytest.raises(ValueError, match=rf"{expert}: HF's model.layers.0.mlp.experts \(experts are fused"):
        peft.load_peft(str(tmp_path), nn.unbox(abstract), "llama", cfg)

    written = json.loads((tmp_path / peft.CONFIG_FILE).read_text())
    (tmp_path / peft.CONFIG_FILE).write_text(json.dumps(written | {"target_parameters": ["mlp.experts.gate_up_proj"]}))
    with pytest.raises(ValueError, match=r"target_parameters=\['mlp.experts.gate_up_proj'\]; lmzoo reads plain LoRA"):
        peft.load_peft(str(tmp_path), nn.unbox(abstract), "llama", cfg)


def test_a_shared_expert_gate_is_refused(tmp_path):
    """Qwen3.5-MoE's shared_expert_gate is an nn.Linear to one output, a vector [D] in lmzoo, which lmzoo's LoRA does
    not adapt: a PEFT folder with LoRA weights of it is refused naming it."""
    family = FAMILIES["qwen3_5_moe"]
    cfg = make_config("qwen3_5", qwen3_5.config_from_hf(family.hf_config().to_dict()))
    config = lora.LoraConfig("attn/out", rank=2, alpha=4.0)
    peft.save_peft(str(tmp_path), lmzoo_adapters(Base(family, None, cfg, None), config), config, "qwen3_5", cfg)
    from safetensors.numpy import load_file, save_file

    gate = f"{peft.PREFIX}model.layers.0.mlp.shared_expert_gate.lora_B.weight"
    save_file(
        load_file(tmp_path / peft.WEIGHTS_FILE) | {gate: np.zeros((1, 2), np.float32)}, tmp_path / peft.WEIGHTS_FILE
    )
    abstract = jax.eval_shape(build_model("qwen3_5", cfg).init, jax.random.key(0), jnp.asarray(TOKENS))["params"]
    with pytest.raises(ValueError, match=rf"{gate}: HF's model.layers.0.mlp.shared_expert_gate \(an nn.Linear to one"):
        peft.load_peft(str(tmp_path), nn.unbox(abstract), "qwen3_5", cfg)
