"""HF DeepSeek-V3 (DeepseekV3ForCausalLM, model_type deepseek_v3) <-> lmzoo "deepseek": config translation and tensor
tables.

HF's nn.Linear weights are [out, in] and are transposed. Attention (`layers.latent_attention`): q_a_proj [Q, D] ->
query_latent (D, Q), q_a_layernorm -> query_latent_norm, q_b_proj [N*H, Q] -> query (Q, N, H) (q_proj [N*H, D] ->
query (D, N, H) without a query latent), kv_a_proj_with_mqa [A+P, D] -> kv_latent (D, A+P), kv_a_layernorm ->
kv_latent_norm, kv_b_proj [N*(Hn+G), A] -> kv_up (A, N, Hn+G), o_proj [D, N*G] -> out (N, G, D). HF layer i is
dense_blocks/layer_i below first_k_dense_replace (its mlp.{gate,up,down}_proj -> wi_0, wi_1, wo), else
moe_blocks/layer_(i - first_k_dense_replace): mlp.gate [E, D] -> router (D, E), mlp.gate.e_score_correction_bias [E]
-> correction_bias, mlp.experts.e.{gate,up,down}_proj -> slice e of wi_0, wi_1 [E, D, F] and wo [E, F, D] (one
tensor per expert, as save_pretrained writes them), mlp.shared_experts -> shared.

Read from config.json as HF reads it: rope_parameters (or rope_theta + rope_scaling) of type default or yarn, the
interleaved rotation (rope_interleave, true where absent). Refused, naming the key: attention_bias, another
activation, num_key_value_heads other than num_attention_heads, no shared expert, the remote code's other routings
(scoring_func, topk_method) or layer frequencies (moe_layer_freq), a quantization_config other than fine-grained FP8.
The multi-token-prediction modules (num_nextn_predict_layers: layers past the last) are not read, as HF does not; nor
are the remote code's training settings (aux_loss_alpha, seq_aux) and ep_size.

The released checkpoints are fine-grained FP8 (quantization_config quant_method "fp8", fmt "e4m3", weight_block_size
[128, 128]): each quantized linear weight [out, in] float8_e4m3fn has its weight_scale_inv [ceil(out / 128),
ceil(in / 128)] beside it, which `quantized.Fp8Blocks` applies as the weight is read, a range of rows at a time (the
router, embeddings, norms and lm_head are stored unquantized). Exports are dense float32 without quantization_config.
"""

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from lmzoo.convert import mapping, quantized, tables
from lmzoo.convert.tables import Entry, Params
from lmzoo.models.deepseek import DeepseekConfig

MODEL_TYPE, ARCHITECTURE = "deepseek_v3", "DeepseekV3ForCausalLM"
MODEL_TYPES = (MODEL_TYPE,)  # the config.json model_types this converter reads (`convert.hf.family_of`)
# DeepseekV3Config's defaults for the keys a config.json may leave out.
_DEFAULTS = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "rope_interleave": True,
    "max_position_embeddings": 4096,
}
# Keys whose other values lmzoo's deepseek does not implement, with the one it does (the remote code's keys included:
# HF's class ignores them, but another value there is another model).
_FIXED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
}
_EXPERT_KERNELS = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))


def _rope(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The rope fields of rope_parameters (transformers 5) or rope_theta + rope_scaling (earlier files): default or
    yarn."""
    where = "rope_parameters" if hf_config.get("rope_parameters") else "rope_scaling"
    rope = dict(hf_config.get(where) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise tables.ConfigError(
            f"HF deepseek_v3 config has {where} rope_type {rope_type!r}; lmzoo's deepseek implements 'default' and "
            "'yarn'"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise tables.ConfigError(
            f"HF deepseek_v3 config has {where}.partial_rotary_factor={rope['partial_rotary_factor']!r}; the rotary "
            "key is rotated whole (1.0)"
        )
    fields = {"rope_theta": float(rope.get("rope_theta", hf_config.get("rope_theta", 10_000.0)))}
    fields |= {"rope_scaling_factor": 0.0, "rope_mscale": 0.0, "rope_mscale_all_dim": 0.0, "rope_attention_factor": 0.0}
    if rope_type == "default":
        return fields
    if not rope.get("factor"):
        raise tables.ConfigError(f"HF deepseek_v3 config has a yarn {where} without its factor")
    return fields | {
        "rope_scaling_factor": float(rope["factor"]),
        "rope_original_max_len": int(
            rope.get("original_max_position_embeddings") or hf_config.get("max_position_embeddings", 4096)
        ),
        "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope_mscale": float(rope.get("mscale") or 0.0),
        "rope_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
        "rope_attention_factor": float(rope.get("attention_factor") or 0.0),
        "rope_truncate": bool(rope.get("truncate", True)),
    }


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.model fields of the "deepseek" family from an HF DeepSeek-V3 config.json dict."""
    model_type = hf_config.get("model_type")
    if model_type != MODEL_TYPE:
        raise tables.ConfigError(
            f"HF config has model_type={model_type!r}; the deepseek converter reads {ARCHITECTURE} (model_type "
            f"{MODEL_TYPE!r})"
        )
    unsupported = [a for a in hf_config.get("architectures") or () if a != ARCHITECTURE]
    if unsupported:
        raise tables.ConfigError(
            f"HF architecture {unsupported} is not supported; the deepseek converter reads {ARCHITECTURE}"
        )
    missing = [
        k
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        if k not in hf_config
    ]
    if missing:
        raise tables.ConfigError(f"HF deepseek_v3 config lacks {missing}")
    quantized.check_quantization(hf_config, MODEL_TYPE)
    for key, supported in _FIXED.items():
        if hf_config.get(key, supported) != supported:
            raise tables.ConfigError(
                f"HF deepseek_v3 config has {key}={hf_config[key]!r}; lmzoo's deepseek supports only {supported!r}"
            )
    get = lambda key: hf_config[key] if hf_config.get(key) is not None else _DEFAULTS[key]  # noqa: E731
    num_heads = int(hf_config["num_attention_heads"])
    kv_heads = hf_config.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != num_heads:
        raise tables.ConfigError(
            f"HF deepseek_v3 config has num_key_value_heads={kv_heads} with num_attention_heads={num_heads}; latent "
            "attention expands every head's key and value (supported: num_key_value_heads = num_attention_heads)"
        )
    for key in ("n_group", "topk_group"):
        if key in hf_config and hf_config[key] is None:
            raise tables.ConfigError(f"HF deepseek_v3 config has {key}=None; give the expert groups (1: none)")
    if int(get("n_shared_experts")) < 1:
        raise tables.ConfigError(
            f"HF deepseek_v3 config has n_shared_experts={hf_config['n_shared_experts']!r}; lmzoo's deepseek needs at "
            "least one shared expert"
        )
    num_layers = int(hf_config["num_hidden_layers"])
    return {
        "vocab_size": int(hf_config["vocab_size"]),
        "max_len": int(get("max_position_embeddings")),
        "emb_dim": int(hf_config["hidden_size"]),
        "num_heads": num_heads,
        "num_layers": num_layers,
        "mlp_dim": int(hf_config["intermediate_size"]),
        "q_lora_rank": int(hf_config["q_lora_rank"] or 0) if "q_lora_rank" in hf_config else _DEFAULTS["q_lora_rank"],
        "kv_lora_rank": int(get("kv_lora_rank")),
        "qk_nope_head_dim": int(get("qk_nope_head_dim")),
        "qk_rope_head_dim": int(get("qk_rope_head_dim")),
        "v_head_dim": int(get("v_head_dim")),
        **_rope(hf_config),
        "rope_interleave": bool(get("rope_interleave")),
        "first_dense_layers": min(int(get("first_k_dense_replace")), num_layers),
        "num_experts": int(get("n_routed_experts")),
        "experts_per_token": int(get("num_experts_per_tok")),
        "expert_mlp_dim": int(get("moe_intermediate_size")),
        "num_shared_experts": int(get("n_shared_experts")),
        "expert_groups": int(get("n_group")),
        "groups_per_token": int(get("topk_group")),
        "routed_scaling": float(get("routed_scaling_factor")),
        "renormalize_expert_weights": bool(get("norm_topk_prob")),
        "tie_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
        "norm_epsilon": float(hf_config.get("rms_norm_eps", 1e-6)),
        "init_std": float(hf_config.get("initializer_range", 0.02)),
        "dropout_rate": 0.0,
        "attention_dropout_rate": float(hf_config.get("attention_dropout") or 0.0),
    }


def config_to_hf(cfg: DeepseekConfig) -> dict[str, Any]:
    """An HF DeepseekV3Config config.json dict (transformers 5's rope_parameters) for a "deepseek" config."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_factor:
        rope |= {
            "rope_type": "yarn",
            "factor": cfg.rope_scaling_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
            "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow,
            "truncate": cfg.rope_truncate,
        }
        optional = {"mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim}
        rope |= {key: value for key, value in optional.items() if value}
        if cfg.rope_attention_factor:
            rope["attention_factor"] = cfg.rope_attention_factor
    return {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_len,
        "hidden_size": cfg.emb_dim,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "intermediate_size": cfg.mlp_dim,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_parameters": rope,
        "rope_interleave": cfg.rope_interleave,
        "first_k_dense_replace": cfg.first_dense_layers,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.expert_mlp_dim,
        "n_shared_experts": cfg.num_shared_experts,
        "n_group": cfg.expert_groups,
        "topk_group": cfg.groups_per_token,
        "routed_scaling_factor": cfg.routed_scaling,
        "norm_topk_prob": cfg.renormalize_expert_weights,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": cfg.norm_epsilon,
        "initializer_range": cfg.init_std,
        "attention_dropout": cfg.attention_dropout_rate,
        "tie_word_embeddings": cfg.tie_embeddings,
        # DeepseekV3Config's defaults are 0 and 1, which `generate` would stop at; export_hf sets the tokenizer's.
        "bos_token_id": None,
        "eos_token_id": None,
    }


def _layer_path(cfg: DeepseekConfig, i: int) -> tuple[str, str]:
    """The lmzoo (stack, layer) of HF layer i: the dense layers first, then the mixtures of experts."""
    if i < cfg.first_dense_layers:
        return ("dense_blocks", f"layer_{i}")
    return ("moe_blocks", f"layer_{i - cfg.first_dense_layers}")


def _swiglu(module: str, path: tuple[str, ...], d: int, f: int) -> list[Entry]:
    return [
        *tables.linear(f"{module}.gate_proj", (*path, "wi_0"), d, f, bias=False),
        *tables.linear(f"{module}.up_proj", (*path, "wi_1"), d, f, bias=False),
        *tables.linear(f"{module}.down_proj", (*path, "wo"), f, d, bias=False),
    ]


def _attention(prefix: str, path: tuple[str, ...], cfg: DeepseekConfig) -> list[Entry]:
    d, n, h = cfg.emb_dim, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    a, p, g, q = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    norm = lambda module, leaf, size: tables.norm(prefix + module, (*path, leaf), size, bias=False)  # noqa: E731
    if q:
        table = tables.linear(prefix + "q_a_proj", (*path, "query_latent"), d, q, bias=False)
        table += norm("q_a_layernorm", "query_latent_norm", q)
        table += tables.linear(prefix + "q_b_proj", (*path, "query"), q, n * h, out_shape=(n, h), bias=False)
    else:
        table = tables.linear(prefix + "q_proj", (*path, "query"), d, n * h, out_shape=(n, h), bias=False)
    table += tables.linear(prefix + "kv_a_proj_with_mqa", (*path, "kv_latent"), d, a + p, bias=False)
    table += norm("kv_a_layernorm", "kv_latent_norm", a)
    table += tables.linear(
        prefix + "kv_b_proj",
        (*path, "kv_up"),
        a,
        n * (cfg.qk_nope_head_dim + g),
        out_shape=(n, cfg.qk_nope_head_dim + g),
        bias=False,
    )
    table += tables.linear(prefix + "o_proj", (*path, "out"), n * g, d, in_shape=(n, g), bias=False)
    return table


def _experts(module: str, path: tuple[str, ...], cfg: DeepseekConfig) -> list[Entry]:
    """The router, its correction bias, the experts (one HF tensor per expert: leaf path (..., "wi_0", "e"), which
    `_stack_experts` gathers) and the shared experts of one MoE layer."""
    d, f, e = cfg.emb_dim, cfg.expert_mlp_dim, cfg.num_experts
    table = tables.linear(f"{module}.gate", (*path, "router"), d, e, bias=False)
    table.append(Entry(f"{module}.gate.e_score_correction_bias", (*path, "correction_bias"), (e,), (e,)))
    for kernel, name in _EXPERT_KERNELS:
        n_in, n_out = (f, d) if kernel == "wo" else (d, f)
        for expert in range(e):
            hf_name = f"{module}.experts.{expert}.{name}.weight"
            table.append(Entry(hf_name, (*path, kernel, str(expert)), (n_out, n_in), (n_in, n_out), transpose=True))
    return table + _swiglu(f"{module}.shared_experts", (*path, "shared"), d, cfg.num_shared_experts * f)


def entries(cfg: DeepseekConfig) -> list[Entry]:
    """Every tensor of HF DeepseekV3ForCausalLM for `cfg` (without "model."), tied copy excluded; each expert's
    kernels as leaves of their own (`_stack_experts`)."""
    d = cfg.emb_dim
    table = tables.table("embed_tokens", ("embed",), cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        prefix, path = f"layers.{i}.", _layer_path(cfg, i)
        table += _attention(prefix + "self_attn.", (*path, "attn"), cfg)
        if i < cfg.first_dense_layers:
            table += _swiglu(prefix + "mlp", (*path, "mlp"), d, cfg.mlp_dim)
        else:
            table += _experts(prefix + "mlp", (*path, "mlp"), cfg)
        table += tables.norm(prefix + "input_layernorm", (*path, "ln_attn"), d, bias=False)
        table += tables.norm(prefix + "post_attention_layernorm", (*path, "ln_mlp"), d, bias=False)
    table += tables.norm("norm", ("norm",), d, bias=False)
    if not cfg.tie_embeddings:
        table += tables.linear("lm_head", ("lm_head",), d, cfg.vocab_size, bias=False)
    return table


def layout(cfg: DeepseekConfig, num_mtp_layers: int = 0) -> tables.Layout:
    """The state dict's naming; the multi-token-prediction layers (HF layers num_layers .. + num_mtp_layers - 1) are
    skipped, as HF skips them."""
    mtp = "|".join(str(cfg.num_layers + k) for k in range(num_mtp_layers))
    return tables.Layout(
        name=f"HF {ARCHITECTURE}",
        family="deepseek",
        prefix="model.",
        heads=frozenset({"lm_head.weight"}),
        tied={"lm_head.weight": "embed_tokens.weight"} if cfg.tie_embeddings else {},
        skip=re.compile(rf"layers\.({mtp})\..*") if mtp else None,
        tie_hint="; set tie_embeddings: False",
        note=" (names shown without the 'model.' prefix; experts one tensor each, as save_pretrained writes them)",
    )


def _stack_experts(params: Params, cfg: DeepseekConfig) -> Params:
    """`params` with each MoE layer's per-expert kernels {"0": [D, F], ...} stacked lazily into one leaf [E, D, F]."""
    for layer in params.get("moe_blocks", {}).values():
        for kernel, _ in _EXPERT_KERNELS:
            layer["mlp"][kernel] = mapping.Stacked([layer["mlp"][kernel][str(e)] for e in range(cfg.num_experts)])
    return params


def _split_experts(params: Params, cfg: DeepseekConfig) -> Params:
    """The reverse of `_stack_experts` for lmzoo params in any layer layout (a leaf that is not [E, ...] is left for
    `tables.to_hf` to report)."""
    params = mapping.unstack_layers(params)  # new dicts down to the leaves: the caller's stay as they are
    for layer in params.get("moe_blocks", {}).values():
        ffn = layer.get("mlp", {}) if isinstance(layer, Mapping) else {}
        for kernel, _ in _EXPERT_KERNELS:
            if kernel in ffn and np.ndim(ffn[kernel]) == 3 and np.shape(ffn[kernel])[0] == cfg.num_experts:
                stacked = np.asarray(ffn[kernel])
                ffn[kernel] = {str(e): stacked[e] for e in range(cfg.num_experts)}
    return params


def _sources(state_dict: Mapping[str, Any], cfg: DeepseekConfig, num_mtp_layers: int = 0) -> Params:
    return _stack_experts(
        tables.to_sources(*tables.read_hf(state_dict, layout(cfg, num_mtp_layers), entries(cfg))), cfg
    )


def from_hf(state_dict: Mapping[str, Any], cfg: DeepseekConfig, *, num_mtp_layers: int = 0) -> Params:
    """HF DeepseekV3ForCausalLM state dict (experts one tensor each, as in safetensors files) -> lmzoo "deepseek"
    params (per-layer, float32 numpy)."""
    return mapping.materialize(_sources(state_dict, cfg, num_mtp_layers))


def to_hf(params: Params, cfg: DeepseekConfig) -> dict[str, np.ndarray]:
    """lmzoo "deepseek" params (per-layer or scanned) -> HF DeepseekV3ForCausalLM state dict of float32 numpy arrays
    (experts one tensor each)."""
    return tables.to_hf(_split_experts(params, cfg), layout(cfg), entries(cfg))


def checkpoint_sources(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params as lazy leaves, read only when placed) of an HF DeepSeek-V3 checkpoint, its FP8
    weights (the released files) dequantized as they are read."""
    fields = config_from_hf(hf_config)
    cfg = tables.checkpoint_config("deepseek", fields)
    fp8_block = quantized.check_quantization(hf_config, MODEL_TYPE)
    if fp8_block:
        state_dict = quantized.read_fp8_blocks(state_dict, fp8_block)
    return fields, _sources(state_dict, cfg, int(hf_config.get("num_nextn_predict_layers") or 0))
