"""HF Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 (text) / Mixtral / Qwen2-MoE / Qwen3-MoE / gpt-oss (*ForCausalLM) <->
lmzoo "llama": config translation and tensor tables.

All eight are the same decoder to lmzoo: Mistral adds a sliding window, Qwen2 q/k/v biases, Qwen3 a per-head RMSNorm of
queries and keys (`qk_norm`); Mixtral (a window too), Qwen2-MoE (q/k/v biases, a shared expert) and Qwen3-MoE (Qwen3's
attention, routed experts alone) make every layer's SwiGLU a mixture of experts (`num_experts` > 0,
`layers.mlp.MoeBlock`). HF's nn.Linear weights are [out, in] and are transposed: q_proj [N*H, D] -> query (D, N, H),
k_proj / v_proj [K*H, D] -> (D, K, H), o_proj [D, N*H] -> out (N, H, D); gate_proj, up_proj, down_proj -> wi_0, wi_1,
wo; Qwen3's q_norm / k_norm [H] -> query_norm / key_norm scale [H].

Gemma 3's text model (model_type gemma3_text, Gemma3ForCausalLM) is Qwen3's attention with layer kinds (`layer_types`,
sliding and full, each with its rope base), sandwich norms, scaled embeddings, a tanh-GELU gate and the logit scale
query_pre_attn_scalar ** -0.5: input_layernorm, post_attention_layernorm, pre_feedforward_layernorm and
post_feedforward_layernorm -> ln_attn, ln_attn_out, ln_mlp, ln_mlp_out. Its RMSNorm multiplies by 1 + weight, so every
Gemma norm weight (q_norm and k_norm too) gains 1 on import and loses it on export: lmzoo's scale is the factor itself.
Its multimodal model (model_type gemma3) is refused; its logit soft-capping and bidirectional attention too.

Experts are read and written one HF tensor per expert, as safetensors files hold them (transformers 5 fuses them in
memory into experts.gate_up_proj [E, 2F, D] and experts.down_proj [E, D, F], and splits them again in
save_pretrained): Mixtral's block_sparse_moe.experts.e.{w1, w3, w2} and Qwen2-MoE's and Qwen3-MoE's
mlp.experts.e.{gate_proj, up_proj, down_proj}, each [F, D] or [D, F], become slice e of wi_0, wi_1 [E, D, F] and wo
[E, F, D]; the router (gate [E, D]) becomes router/kernel [D, E]; Qwen2-MoE's shared expert is a SwiGLU "shared"
and its sigmoid gate shared_expert_gate [1, D] the kernel [D] of "shared_gate".

gpt-oss (model_type gpt_oss, GptOssForCausalLM) has o_proj's bias too (`out_bias`), self_attn.sinks [N] -> attn/sinks,
a biased router (mlp.router) and stacked, biased experts whose fused gate_up_proj and MXFP4 tensors `convert.gpt_oss`
reads and writes; its rope dict is YaRN's, for every layer.

Fine-grained FP8 checkpoints of the others (quantization_config quant_method "fp8", fmt "e4m3": Qwen3-*-FP8) store
each quantized linear weight [out, in] as float8_e4m3fn beside its weight_scale_inv [ceil(out / b0), ceil(in / b1)]
(weight_block_size [b0, b1]), dequantized as they are read (`quantized.Fp8Blocks`); any other quant_method is refused.
Exports are dense float32 without quantization_config.
"""

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lmzoo.convert import gpt_oss, mapping, quantized, tables
from lmzoo.convert.tables import Entry, Params
from lmzoo.models.llama import LlamaConfig

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    gpt_oss.MODEL_TYPE: gpt_oss.ARCHITECTURE,
}
MODEL_TYPES = tuple(ARCHITECTURES)  # the config.json model_types this converter reads (`convert.hf.family_of`)
# The model types whose attention RMS-normalises each head's queries and keys before the rotation (`qk_norm`).
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text")
# Switches lmzoo's llama does not implement, with the only supported value. Llama's and Qwen3's attention_bias also
# biases o_proj, which lmzoo's attention has no parameter for; Qwen2's q/k/v biases are implied by its model_type.
# Mixtral's router jitter (training only) multiplies the router's input by noise; lmzoo's router has none.
_FIXED_HF_OPTIONS = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "router_jitter_noise": 0.0}
# The HF config.json keys of each mixture-of-experts layout: (number of experts, experts' F), and the names of the
# experts' tensors of wi_0, wi_1, wo under its feed-forward module. (transformers 5 writes Qwen3-MoE's num_experts as
# num_local_experts, its attribute's name; the released config.json files say num_experts: either is read.)
_MOE_KEYS = {
    "mixtral": ("num_local_experts", "intermediate_size"),
    "qwen2_moe": ("num_experts", "moe_intermediate_size"),
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "gpt_oss": ("num_local_experts", "intermediate_size"),
}
_FEED_FORWARD = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp", "qwen3_moe": "mlp"}
_EXPERT_TENSORS = {
    "mixtral": ("w1", "w3", "w2"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
}
_EXPERT_KERNELS = ("wi_0", "wi_1", "wo")
# Rotary inverse frequencies that checkpoints converted by older transformers versions saved with the weights.
_BUFFER = re.compile(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


_ROPE_TYPES = ("default", "linear", "llama3")
SLIDING, FULL = "sliding_attention", "full_attention"
# The fields only Gemma 3 sets, at lmzoo's defaults: every other model type's values.
_GEMMA_ONLY = {
    "layer_types": (),
    "sliding_rope_theta": 0.0,
    "sandwich_norms": False,
    "embed_scale": False,
    "query_pre_attn_scalar": 0.0,
    "mlp_activation": "silu",
}
# The fields only gpt-oss sets, at lmzoo's defaults: every other model type's values (YaRN's rope_* fields are stated
# with the rope type that has them).
_GPT_OSS_ONLY = {
    "out_bias": False,
    "attention_sinks": False,
    "router_bias": False,
    "expert_bias": False,
    "swiglu_limit": 0.0,
}
# Gemma3TextConfig's defaults for the keys a gemma3_text config.json may leave out.
_GEMMA3_DEFAULTS = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}


def _rope(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta and the scaling fields from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`
    (earlier config.json files)."""
    field = "rope_parameters" if hf_config.get("rope_parameters") else "rope_scaling"
    rope = dict(hf_config.get(field) or {})
    return _rope_fields(rope, rope.get("rope_theta", hf_config.get("rope_theta", 10_000.0)), field)


def _rope_fields(rope: Mapping[str, Any], theta: float, where: str, types: Sequence[str] = _ROPE_TYPES) -> dict:
    """The config.model rope fields of one HF rope dict (`rope_type` among `types`; its factors) with base `theta`;
    `where` names the dict in errors."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise tables.ConfigError(
            f"HF config has {where}.partial_rotary_factor={rope['partial_rotary_factor']!r}; "
            "lmzoo's llama rotates the whole head (1.0)"
        )
    if rope_type not in types:
        raise tables.ConfigError(
            f"HF config has {where} rope_type {rope_type!r}; lmzoo's llama implements {', '.join(map(repr, types))} "
            "there"
        )
    # factor 0 (no scaling) is stated, so a target config that scales differs from an unscaled checkpoint.
    fields: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling_factor": 0.0}
    if rope_type == "default":
        return fields
    fields |= {"rope_scaling_factor": float(rope["factor"]), "rope_scaling_type": rope_type}
    if rope_type == "linear":
        return fields
    if rope_type == "yarn":
        return fields | _yarn_fields(rope, where)
    return fields | {
        "rope_low_freq_factor": float(rope["low_freq_factor"]),
        "rope_high_freq_factor": float(rope["high_freq_factor"]),
        "rope_original_max_len": int(rope["original_max_position_embeddings"]),
    }


def _yarn_fields(rope: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The YaRN fields of an HF "yarn" rope dict; DeepSeek's mscale pair (which lmzoo's llama lacks) is refused."""
    for key in ("mscale", "mscale_all_dim"):
        if rope.get(key):
            raise tables.ConfigError(f"HF config has {where}.{key}={rope[key]!r}; lmzoo's llama's YaRN has none (null)")
    if not rope.get("factor") or not rope.get("original_max_position_embeddings"):
        raise tables.ConfigError(
            f"HF config has a yarn {where} without its factor and original_max_position_embeddings"
        )
    return {
        "rope_original_max_len": int(rope["original_max_position_embeddings"]),
        "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope_truncate": bool(rope.get("truncate", True)),
        "rope_attention_factor": float(rope.get("attention_factor") or 0.0),
    }


def _rope_to_hf(cfg: LlamaConfig, kind: str = FULL) -> dict[str, Any]:
    """The HF rope dict (`rope_type`, its factors, `rope_theta`) of the layers of `kind`."""
    rotary = cfg.rotary(kind)
    if rotary.yarn is not None:
        yarn = rotary.yarn
        scaling = {
            "rope_type": "yarn",
            "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_len,
            "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow,
            "truncate": yarn.truncate,
        } | ({"attention_factor": yarn.attention_factor} if yarn.attention_factor else {})
    elif rotary.scaling is not None:
        factor, low, high, original = rotary.scaling
        scaling = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
    elif rotary.linear_factor != 1.0:
        scaling = {"rope_type": "linear", "factor": rotary.linear_factor}
    else:
        scaling = {"rope_type": "default"}
    return scaling | {"rope_theta": rotary.theta}


def _gemma3_fields(hf_config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """The fields of a gemma3_text config.json that the others lack or read otherwise: the layer kinds (HF's
    layer_types, else every sliding_window_pattern-th layer full), the window and rotation of each kind (transformers
    5's rope_parameters per kind, or rope_theta + rope_scaling for the full layers and rope_local_base_freq for the
    sliding ones), and the Gemma switches. Kinds all alike are no layer_types: every layer that kind. Soft-capping,
    bidirectional attention and activations lmzoo lacks are refused, naming the key."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf_config.get(key) is not None:
            raise tables.ConfigError(
                f"HF gemma3_text config has {key}={hf_config[key]!r}; lmzoo's llama does not soft-cap logits "
                "(supported: null)"
            )
    if hf_config.get("use_bidirectional_attention"):
        raise tables.ConfigError(
            "HF gemma3_text config has use_bidirectional_attention=True; lmzoo's llama is causal (supported: false)"
        )

    def get(key: str) -> Any:
        return hf_config.get(key, _GEMMA3_DEFAULTS[key])

    activation = get("hidden_activation")
    if activation not in tables.ACTIVATION_FROM_HF:
        raise tables.ConfigError(
            f"HF gemma3_text config has hidden_activation={activation!r}; lmzoo's llama implements "
            f"{', '.join(map(repr, tables.ACTIVATION_FROM_HF))}"
        )
    pattern = int(get("sliding_window_pattern"))
    kinds = list(hf_config.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)])
    if len(kinds) != num_layers or not set(kinds) <= {SLIDING, FULL}:
        unknown = sorted(set(kinds) - {SLIDING, FULL})
        raise tables.ConfigError(
            f"HF gemma3_text config has layer_types {unknown[0]!r}; lmzoo's llama implements {SLIDING!r} and {FULL!r}"
            if unknown
            else f"HF gemma3_text config has {len(kinds)} layer_types for num_hidden_layers={num_layers}"
        )
    window = int(get("sliding_window") or 0)
    if SLIDING in kinds and window < 1:
        given = hf_config.get("sliding_window")
        raise tables.ConfigError(f"HF gemma3_text config has sliding_attention layers with sliding_window={given!r}")
    thetas = {FULL: get("rope_theta"), SLIDING: get("rope_local_base_freq")}
    if hf_config.get("rope_parameters"):  # transformers 5: one dict per kind
        ropes = hf_config["rope_parameters"]
        absent = [kind for kind in (FULL, SLIDING) if kind in kinds and not isinstance(ropes.get(kind), Mapping)]
        if absent:
            raise tables.ConfigError(f"HF gemma3_text config has no rope_parameters[{absent[0]!r}] for its layers")
        wheres = {kind: f"rope_parameters[{kind!r}]" for kind in (FULL, SLIDING)}
    else:  # earlier config.json files: rope_scaling is the full layers'
        ropes = {FULL: hf_config.get("rope_scaling") or {}, SLIDING: {}}
        wheres = {FULL: "rope_scaling", SLIDING: "rope_local_base_freq"}

    def rope(kind: str, types: Sequence[str] = _ROPE_TYPES) -> dict[str, Any]:
        return _rope_fields(ropes[kind], ropes[kind].get("rope_theta", thetas[kind]), wheres[kind], types)

    fields: dict[str, Any] = {
        "sandwich_norms": True,
        "embed_scale": True,
        "query_pre_attn_scalar": float(get("query_pre_attn_scalar")),
        "mlp_activation": tables.ACTIVATION_FROM_HF[activation],
    }
    if len(set(kinds)) == 1:
        return fields | rope(kinds[0]) | {"sliding_window": window if kinds[0] == SLIDING else 0}
    # lmzoo scales only the full layers' rotation, as Gemma 3 does
    sliding_theta = rope(SLIDING, types=("default",))["rope_theta"]
    return (
        fields
        | rope(FULL)
        | {"layer_types": tuple(kinds), "sliding_window": window, "sliding_rope_theta": sliding_theta}
    )


def _gpt_oss_fields(hf_config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """The fields of a gpt_oss config.json beyond the mixture of experts: the layer kinds (HF's layer_types, else
    sliding and full in turn), which all rotate with the one rope dict (YaRN's by default), the four attention biases,
    the sinks and the experts' biases and clamped SwiGLU. Kinds all alike are no layer_types."""
    kinds = gpt_oss.layer_kinds(hf_config, num_layers)
    window = int(gpt_oss.get(hf_config, "sliding_window") or 0)
    if SLIDING in kinds and window < 1:
        given = hf_config.get("sliding_window")
        raise tables.ConfigError(f"HF gpt_oss config has sliding_attention layers with sliding_window={given!r}")
    field = "rope_parameters" if hf_config.get("rope_parameters") else "rope_scaling"
    rope = dict(hf_config.get(field) or gpt_oss.DEFAULT_ROPE)
    theta = rope.get("rope_theta", gpt_oss.get(hf_config, "rope_theta"))
    limit = float(gpt_oss.get(hf_config, "swiglu_limit"))
    if limit <= 0:
        raise tables.ConfigError(f"HF gpt_oss config has swiglu_limit={limit!r}; lmzoo's clamped SwiGLU needs > 0")
    bias = bool(gpt_oss.get(hf_config, "attention_bias"))
    fields = _rope_fields(rope, theta, field, ("default", "yarn")) | {
        "qkv_bias": bias,
        "out_bias": bias,
        "attention_sinks": True,
        "router_bias": True,
        "expert_bias": True,
        "swiglu_limit": limit,
        "swiglu_alpha": float(gpt_oss.get(hf_config, "swiglu_alpha")),
    }
    if len(set(kinds)) == 1:
        return fields | {"sliding_window": window if kinds[0] == SLIDING else 0}
    return fields | {"layer_types": tuple(kinds), "sliding_window": window}


def _sliding_window(hf_config: Mapping[str, Any], model_type: str, num_layers: int) -> int:
    """The window every layer uses (0: none); Qwen2 and Qwen3 models whose layers differ are refused."""
    window = hf_config.get("sliding_window")
    if model_type in ("mistral", "mixtral"):
        return int(window or 0)
    if model_type == "llama" or not hf_config.get("use_sliding_window", False) or not window:
        return 0
    if model_type == "qwen3_moe":  # every layer slides (transformers' Qwen3-MoE has no max_window_layers)
        return int(window)
    if model_type == "qwen2_moe":  # transformers' default: layers 0, 2, 4, ... below max_window_layers slide
        limit = int(hf_config.get("max_window_layers", 28))
        default = ["sliding_attention" if i % 2 == 0 and i < limit else "full_attention" for i in range(num_layers)]
        kinds = hf_config.get("layer_types") or default
        if len(set(kinds)) > 1:
            raise tables.ConfigError(
                f"HF qwen2_moe config has use_sliding_window=True with max_window_layers={limit}: only some layers "
                f"slide (layer_types {kinds}); lmzoo's llama applies one sliding_window to every layer or none "
                "(use_sliding_window False)"
            )
        return int(window) if set(kinds) == {"sliding_attention"} else 0
    first_sliding = int(hf_config.get("max_window_layers", num_layers))
    kinds = hf_config.get("layer_types") or [
        "sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)
    ]
    if set(kinds) == {"full_attention"}:
        return 0
    if set(kinds) != {"sliding_attention"}:
        raise tables.ConfigError(
            f"HF {model_type} config has use_sliding_window=True with max_window_layers={first_sliding} < "
            f"num_hidden_layers={num_layers}: only some layers slide (layer_types {kinds}); lmzoo's llama applies "
            "one sliding_window to every layer (max_window_layers 0) or none (use_sliding_window False)"
        )
    return int(window)


def _moe_fields(hf_config: Mapping[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields (`layers.mlp.MoeFields`) an HF Mixtral, Qwen2-MoE or Qwen3-MoE config fixes, read
    from its keys for them (num_experts 0 for the dense models); the others (moe_form, capacity_factor,
    router_z_loss_coef) are the run's choice, as dropout is.

    Every layer must be sparse: Qwen2-MoE's and Qwen3-MoE's dense layers among sparse ones (`decoder_sparse_step` > 1,
    `mlp_only_layers`) have no lmzoo form, and neither has a Qwen2-MoE without a shared expert. Qwen3-MoE has none
    (its class builds no shared expert, whatever the config says)."""
    if model_type not in _MOE_KEYS:
        return {"num_experts": 0}
    count_key, size_key = _MOE_KEYS[model_type]
    if model_type == "qwen3_moe" and count_key not in hf_config and "num_local_experts" in hf_config:
        count_key = "num_local_experts"
    if model_type == "gpt_oss" and count_key not in hf_config and "num_experts" in hf_config:
        count_key = "num_experts"
    size_keys = [size_key, "shared_expert_intermediate_size"] if model_type == "qwen2_moe" else [size_key]
    missing = [key for key in (count_key, "num_experts_per_tok", *size_keys) if key not in hf_config]
    if missing:
        raise tables.ConfigError(f"HF {model_type} config lacks {missing}")
    num_experts, top_k = int(hf_config[count_key]), int(hf_config["num_experts_per_tok"])
    if num_experts < 1:
        raise tables.ConfigError(f"HF {model_type} config has {count_key}={num_experts}; it must be >= 1")
    if not 1 <= top_k <= num_experts:
        raise tables.ConfigError(
            f"HF {model_type} config has num_experts_per_tok={top_k} with {count_key}={num_experts}; the router "
            f"picks each token's top num_experts_per_tok of the experts, so it must be in [1, {num_experts}]"
        )
    sizes = {key: int(hf_config[key]) for key in size_keys}
    bad = {key: size for key, size in sizes.items() if size < 1}
    if bad:
        raise tables.ConfigError(
            f"HF {model_type} config has {bad}; lmzoo's experts need sizes >= 1"
            + (" (lmzoo reads Qwen2-MoE with a shared expert only)" if "shared_expert_intermediate_size" in bad else "")
        )
    fields = {
        "num_experts": num_experts,
        "experts_per_token": top_k,
        # Mixtral's and gpt-oss's experts are intermediate_size wide, which is mlp_dim: expert_mlp_dim 0 says so.
        "expert_mlp_dim": 0 if model_type in ("mixtral", "gpt_oss") else sizes[size_key],
        "shared_expert_mlp_dim": sizes.get("shared_expert_intermediate_size", 0),
        # gpt-oss softmaxes the top-k logits: the top-k probabilities renormalised.
        "renormalize_expert_weights": model_type in ("mixtral", "gpt_oss") or bool(hf_config.get("norm_topk_prob")),
        "load_balance_coef": float(hf_config.get("router_aux_loss_coef", 0.001)),
    }
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step, only = int(hf_config.get("decoder_sparse_step", 1)), list(hf_config.get("mlp_only_layers") or [])
        dense = [i for i in range(num_layers) if i in only or step < 1 or (i + 1) % step]
        if dense:
            raise tables.ConfigError(
                f"HF {model_type} config has decoder_sparse_step={step} and mlp_only_layers={only}: layers {dense} are "
                "dense MLPs among the mixture-of-experts layers; lmzoo's llama makes every layer sparse "
                "(decoder_sparse_step 1, mlp_only_layers [])"
            )
    return fields


def _fp8_block(hf_config: Mapping[str, Any]) -> tuple[int, int] | None:
    """The [rows, columns] of a fine-grained FP8 checkpoint's weight blocks, None for an unquantized one or gpt-oss's
    MXFP4 (gpt-oss is read in MXFP4, the others in FP8); any other quantization refused, naming the key."""
    model_type = str(hf_config.get("model_type"))
    methods = ("mxfp4",) if model_type == gpt_oss.MODEL_TYPE else ("fp8",)
    return quantized.check_quantization(hf_config, model_type, methods)


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.model fields of the "llama" family from an HF Llama, Mistral, Qwen2, Qwen3, Gemma 3 (text),
    Mixtral, Qwen2-MoE or Qwen3-MoE config.json dict."""
    model_type = hf_config.get("model_type")
    if model_type == "gemma3":
        raise tables.ConfigError(
            f"HF config has model_type='gemma3' (architectures {hf_config.get('architectures')}), Gemma 3's multimodal "
            "model; lmzoo's llama reads its text model: use a text-only checkpoint (model_type 'gemma3_text', "
            "Gemma3ForCausalLM, e.g. google/gemma-3-1b-it)"
        )
    if model_type not in ARCHITECTURES:
        raise tables.ConfigError(
            f"HF config has model_type={model_type!r} (architectures {hf_config.get('architectures')}); the llama "
            f"converter reads {', '.join(ARCHITECTURES.values())} (model_type {', '.join(ARCHITECTURES)})"
        )
    unsupported = [a for a in hf_config.get("architectures") or () if a != ARCHITECTURES[model_type]]
    if unsupported:
        raise tables.ConfigError(
            f"HF architecture {unsupported} is not supported; the llama converter reads {ARCHITECTURES[model_type]}"
        )
    keys = (
        "vocab_size",
        "max_position_embeddings",
        "hidden_size",
        "num_attention_heads",
        "num_hidden_layers",
        "intermediate_size",
    )
    missing = [key for key in keys if key not in hf_config]
    if missing:
        raise tables.ConfigError(f"HF {model_type} config lacks {missing}")
    _fp8_block(hf_config)  # refuses a quantization lmzoo does not dequantize on load
    for key, supported in _FIXED_HF_OPTIONS.items():
        if key == "attention_bias" and model_type == gpt_oss.MODEL_TYPE:  # its four biases: `out_bias`
            continue
        if hf_config.get(key, supported) != supported:
            raise tables.ConfigError(
                f"HF {model_type} config has {key}={hf_config[key]!r}; lmzoo's llama supports only {supported!r}"
            )
    emb_dim, num_heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
    num_layers = int(hf_config["num_hidden_layers"])
    kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
    gemma = model_type == "gemma3_text"
    # Where config.json leaves head_dim out, Qwen3Config's default is 128, Gemma3TextConfig's 256; the others' is
    # hidden_size / heads.
    head_dim = hf_config.get("head_dim", {"qwen3": 128, "gemma3_text": 256, "gpt_oss": 64}.get(model_type))
    if num_heads % kv_heads:
        raise tables.ConfigError(
            f"HF {model_type} config has num_key_value_heads={kv_heads}, which does not divide "
            f"num_attention_heads={num_heads} (each key/value head serves a whole group of query heads)"
        )
    # Gemma's fields are stated for every model type, so a target config that sets them differs from the checkpoint.
    if gemma:
        kinds = _GEMMA_ONLY | _gemma3_fields(hf_config, num_layers)
    elif model_type == gpt_oss.MODEL_TYPE:
        kinds = _GEMMA_ONLY | _gpt_oss_fields(hf_config, num_layers)
    else:
        kinds = _GEMMA_ONLY | _rope(hf_config) | {"sliding_window": _sliding_window(hf_config, model_type, num_layers)}
    return {
        "vocab_size": int(hf_config["vocab_size"]),
        "max_len": int(hf_config["max_position_embeddings"]),
        "emb_dim": emb_dim,
        "num_heads": num_heads,
        # 0, lmzoo's default, where HF's value is its own default, so a config that leaves them unset matches.
        "num_kv_heads": 0 if kv_heads == num_heads else kv_heads,
        "head_dim": 0 if head_dim in (None, emb_dim // num_heads) else int(head_dim),
        "num_layers": num_layers,
        "mlp_dim": int(hf_config["intermediate_size"]),
        **_moe_fields(hf_config, model_type, num_layers),
        # Qwen2-MoE's config.json says qkv_bias since transformers 5; earlier ones always had the biases.
        "qkv_bias": model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf_config.get("qkv_bias", True))),
        **_GPT_OSS_ONLY,
        **kinds,
        "qk_norm": model_type in _QK_NORM,
        "tie_embeddings": bool(hf_config.get("tie_word_embeddings", gemma)),
        "norm_epsilon": float(hf_config.get("rms_norm_eps", 1e-5 if model_type == gpt_oss.MODEL_TYPE else 1e-6)),
        "init_std": float(hf_config.get("initializer_range", 0.02)),
        "dropout_rate": 0.0,
        "attention_dropout_rate": float(hf_config.get("attention_dropout", 0.0)),
    }


def _gemma_switches(cfg: LlamaConfig) -> dict[str, Any]:
    """The fields only Gemma 3 sets (`_GEMMA_ONLY`) that `cfg` sets otherwise than their defaults, with its values."""
    return {name: getattr(cfg, name) for name, default in _GEMMA_ONLY.items() if getattr(cfg, name) != default}


def hf_model_type(cfg: LlamaConfig) -> str:
    """gemma3_text with Gemma's fields (`_gemma_switches`). With experts: qwen3_moe for qk_norm, else qwen2_moe for a
    shared expert, else mixtral. Without: qwen3 for qk_norm, else qwen2 for q/k/v biases, else mistral for a sliding
    window, else llama. Raises for models HF has no class for (Gemma's fields without all of sandwich_norms,
    embed_scale and qk_norm, or with q/k/v biases or experts; qk_norm with q/k/v biases or a shared expert; experts
    without a shared expert, with q/k/v biases or top-k weights not renormalised). gpt_oss for attention sinks or any
    of gpt-oss's fields (`_gpt_oss_problems` names what HF's class lacks)."""
    oss = {name: getattr(cfg, name) for name, default in _GPT_OSS_ONLY.items() if getattr(cfg, name) != default}
    if oss or cfg.yarn is not None:
        problems = _gpt_oss_problems(cfg)
        if problems:
            raise ValueError(
                f"a llama with {oss or {'rope_scaling_type': 'yarn'}} has no HF counterpart but GptOssForCausalLM, "
                f"which needs {'; '.join(problems)}"
            )
        return gpt_oss.MODEL_TYPE
    switches = _gemma_switches(cfg)
    if switches:
        if not (cfg.sandwich_norms and cfg.embed_scale and cfg.qk_norm) or cfg.qkv_bias or cfg.num_experts:
            raise ValueError(
                f"a llama with {switches}, qk_norm={cfg.qk_norm}, qkv_bias={cfg.qkv_bias} and num_experts="
                f"{cfg.num_experts} has no HF counterpart: Gemma3ForCausalLM (the HF model with those fields) has "
                "sandwich norms, scaled embeddings and q/k norms, no q/k/v biases and no experts; set "
                "config.model.sandwich_norms=True, embed_scale=True, qk_norm=True, qkv_bias=False and num_experts=0, "
                "or leave those fields at their defaults"
            )
        if cfg.mlp_activation not in tables.ACTIVATION_TO_HF:
            raise ValueError(
                f"config.model.mlp_activation={cfg.mlp_activation!r} has no HF name; Gemma3ForCausalLM takes "
                f"{sorted(tables.ACTIVATION_TO_HF)}"
            )
        return "gemma3_text"
    if cfg.qk_norm and (cfg.qkv_bias or (cfg.num_experts and cfg.shared_expert_mlp_dim)):
        raise ValueError(
            f"a llama with qk_norm, qkv_bias={cfg.qkv_bias} and shared_expert_mlp_dim={cfg.shared_expert_mlp_dim} "
            "has no HF counterpart: Qwen3ForCausalLM and Qwen3MoeForCausalLM (the HF models with q/k norms) have no "
            "q/k/v biases (their attention_bias also biases o_proj) and Qwen3-MoE no shared expert; set "
            "config.model.qkv_bias=False and config.model.shared_expert_mlp_dim=0, or qk_norm=False"
        )
    if cfg.num_experts:
        if cfg.qk_norm:
            return "qwen3_moe"
        if cfg.shared_expert_mlp_dim:
            return "qwen2_moe"
        if cfg.qkv_bias or not cfg.renormalize_expert_weights:
            raise ValueError(
                f"a llama with experts, qkv_bias={cfg.qkv_bias} and renormalize_expert_weights="
                f"{cfg.renormalize_expert_weights} has no HF counterpart: MixtralForCausalLM (no shared expert) has no "
                "q/k/v biases and renormalises the top-k weights, and Qwen2MoeForCausalLM needs a shared expert "
                "(config.model.shared_expert_mlp_dim > 0)"
            )
        return "mixtral"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window else "llama"


def _gpt_oss_problems(cfg: LlamaConfig) -> list[str]:
    """What `cfg` lacks of GptOssForCausalLM (each as "field=value"); empty when it is one."""
    wanted = {
        "attention_sinks": True,
        "router_bias": True,
        "expert_bias": True,
        "renormalize_expert_weights": True,
        "shared_expert_mlp_dim": 0,
        "out_bias": cfg.qkv_bias,
        "qk_norm": False,
        "sliding_rope_theta": 0.0,
    } | {name: default for name, default in _GEMMA_ONLY.items() if name not in ("layer_types", "sliding_rope_theta")}
    problems = [f"{name}={value!r}" for name, value in wanted.items() if getattr(cfg, name) != value]
    if not cfg.num_experts:
        problems.append("num_experts > 0")
    if cfg.swiglu_limit <= 0:
        problems.append("swiglu_limit > 0")
    if cfg.rope_scaling_factor and cfg.rope_scaling_type != "yarn":
        problems.append("rope_scaling_type='yarn' (or rope_scaling_factor=0)")
    return problems


def _gpt_oss_config_to_hf(cfg: LlamaConfig, hf_config: dict[str, Any]) -> dict[str, Any]:
    """`hf_config` (the keys every model type shares) as GptOssConfig's: one rope dict for every layer, the layer kinds
    (every layer the kind of the window when layer_types is empty), the experts and their clamped SwiGLU."""
    moe = cfg.moe
    common = {key: value for key, value in hf_config.items() if key not in ("rope_theta", "rope_scaling")}
    return common | {
        "intermediate_size": moe.expert_mlp_dim,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "router_aux_loss_coef": moe.load_balance_coef,
        "swiglu_limit": moe.swiglu_limit,
        "swiglu_alpha": moe.swiglu_alpha,
        "attention_bias": cfg.qkv_bias,
        "rope_parameters": _rope_to_hf(cfg),
        "layer_types": list(cfg.layer_types) or [SLIDING if cfg.sliding_window else FULL] * cfg.num_layers,
        # HF's model builds a sliding mask whatever the kinds: a window its full layers do not read
        "sliding_window": cfg.sliding_window or gpt_oss.DEFAULTS["sliding_window"],
        "output_router_logits": False,
    }


def config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """An HF config.json dict (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Mixtral, Qwen2-MoE or Qwen3-MoE:
    `hf_model_type`) for a "llama" config.

    Residual dropout has no HF field (HF's decoders have none); it does not change the exported model's function.
    Nor have the MoE form, its capacity and the router z-loss: HF computes every assignment (the dropless form).
    """
    model_type = hf_model_type(cfg)
    scaling = _rope_to_hf(cfg)
    rope = {"rope_theta": scaling.pop("rope_theta")}
    if scaling["rope_type"] != "default":
        rope["rope_scaling"] = scaling
    hf_config = {
        "model_type": model_type,
        "architectures": [ARCHITECTURES[model_type]],
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_len,
        "hidden_size": cfg.emb_dim,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "num_hidden_layers": cfg.num_layers,
        "intermediate_size": cfg.mlp_dim,
        "hidden_act": "silu",
        **rope,
        "rms_norm_eps": cfg.norm_epsilon,
        "initializer_range": cfg.init_std,
        "attention_dropout": cfg.attention_dropout_rate,
        "tie_word_embeddings": cfg.tie_embeddings,
        # HF's Llama defaults are 1 and 2, which `generate` would stop at; export_hf sets the tokenizer's.
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if model_type == "llama":
        return hf_config | {"attention_bias": False, "mlp_bias": False}
    if model_type == "gemma3_text":
        return _gemma3_config_to_hf(cfg, hf_config)
    if model_type == gpt_oss.MODEL_TYPE:
        return _gpt_oss_config_to_hf(cfg, hf_config)
    if model_type == "mistral":
        return hf_config | {"sliding_window": cfg.sliding_window}
    if model_type == "mixtral":
        moe = cfg.moe
        return hf_config | {
            "intermediate_size": moe.expert_mlp_dim,
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.experts_per_token,
            "router_aux_loss_coef": moe.load_balance_coef,
            "router_jitter_noise": 0.0,
            "sliding_window": cfg.sliding_window or None,
        }
    window = cfg.sliding_window or None
    if model_type == "qwen3_moe":
        moe = cfg.moe
        return hf_config | {
            "attention_bias": False,
            "use_sliding_window": window is not None,
            "sliding_window": window,
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": moe.expert_mlp_dim,
            "norm_topk_prob": moe.renormalize_expert_weights,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": moe.load_balance_coef,
        }
    hf_config |= {
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0 if window else cfg.num_layers,
        "layer_types": ["sliding_attention" if window else "full_attention"] * cfg.num_layers,
    }
    if model_type == "qwen2":
        return hf_config
    if model_type == "qwen3":
        return hf_config | {"attention_bias": False}
    moe = cfg.moe
    return hf_config | {
        "qkv_bias": cfg.qkv_bias,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token,
        "moe_intermediate_size": moe.expert_mlp_dim,
        "shared_expert_intermediate_size": moe.shared_expert_mlp_dim,
        "norm_topk_prob": moe.renormalize_expert_weights,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": moe.load_balance_coef,
    }


def _gemma3_config_to_hf(cfg: LlamaConfig, hf_config: dict[str, Any]) -> dict[str, Any]:
    """`hf_config` (the keys every model type shares) as Gemma3TextConfig's: one rope dict per layer kind (every
    layer the kind of the window when layer_types is empty, rotating as lmzoo's do then), GeGLU's HF name, no
    soft-capping."""
    kinds = list(cfg.layer_types) or [SLIDING if cfg.sliding_window else FULL] * cfg.num_layers
    scalar = cfg.query_pre_attn_scalar or cfg.head_size
    if scalar != int(scalar):
        raise ValueError(
            f"config.model.query_pre_attn_scalar={scalar} has no HF form: Gemma3TextConfig takes an integer"
        )
    if cfg.emb_dim % cfg.num_heads:
        raise ValueError(
            f"config.model.emb_dim={cfg.emb_dim} is not a multiple of num_heads={cfg.num_heads}, which "
            "Gemma3TextConfig refuses (whatever head_dim is); choose num_heads dividing emb_dim"
        )
    common = {key: value for key, value in hf_config.items() if key not in ("rope_theta", "rope_scaling", "hidden_act")}
    return common | {
        "hidden_activation": {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.mlp_activation, cfg.mlp_activation),
        "rope_parameters": {kind: _rope_to_hf(cfg, kind) for kind in (SLIDING, FULL)},
        "layer_types": kinds,
        "sliding_window": cfg.sliding_window or None,
        "query_pre_attn_scalar": int(scalar),
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def _swiglu(module: str, path: tuple[str, ...], d: int, f: int) -> list[Entry]:
    """An HF gated MLP's gate_proj, up_proj, down_proj -> wi_0, wi_1, wo kernels (Llama's MLP, Qwen2-MoE's shared
    expert)."""
    return [
        *tables.linear(f"{module}.gate_proj", (*path, "wi_0"), d, f, bias=False),
        *tables.linear(f"{module}.up_proj", (*path, "wi_1"), d, f, bias=False),
        *tables.linear(f"{module}.down_proj", (*path, "wo"), f, d, bias=False),
    ]


def _feed_forward(prefix: str, path: tuple[str, ...], cfg: LlamaConfig, model_type: str) -> list[Entry]:
    """One layer's feed-forward: Llama's MLP, or the router, the experts (one HF tensor per expert, which
    `_stack_experts` gathers into the stacked kernel: leaf path (..., "wi_0", "e")) and Qwen2-MoE's shared expert."""
    d, moe = cfg.emb_dim, cfg.moe
    if moe is None:
        return _swiglu(prefix + "mlp", path, d, cfg.mlp_dim)
    if model_type == gpt_oss.MODEL_TYPE:
        return _gpt_oss_feed_forward(prefix + "mlp", path, cfg)
    module, f = prefix + _FEED_FORWARD[model_type], moe.expert_mlp_dim
    table = tables.linear(f"{module}.gate", (*path, "router"), d, moe.num_experts, bias=False)
    kernels = zip(_EXPERT_KERNELS, _EXPERT_TENSORS[model_type], ((d, f), (d, f), (f, d)), strict=True)
    for kernel, name, (n_in, n_out) in kernels:
        # HF [out, in] -> [in, out], as tables.linear, one leaf per expert
        for e in range(moe.num_experts):
            hf_name = f"{module}.experts.{e}.{name}.weight"
            table.append(Entry(hf_name, (*path, kernel, str(e)), (n_out, n_in), (n_in, n_out), transpose=True))
    if moe.shared_expert_mlp_dim:
        table += _swiglu(f"{module}.shared_expert", (*path, "shared"), d, moe.shared_expert_mlp_dim)
        # nn.Linear(D, 1) [1, D] -> Einsum kernel [D]
        table.append(Entry(f"{module}.shared_expert_gate.weight", (*path, "shared_gate", "kernel"), (1, d), (d,), True))
    return table


def _gpt_oss_feed_forward(module: str, path: tuple[str, ...], cfg: LlamaConfig) -> list[Entry]:
    """gpt-oss's router (with its bias) and stacked experts, as `gpt_oss.split_experts` shows them: gate_proj,
    up_proj [E, D, F] -> wi_0, wi_1 and down_proj [E, F, D] -> wo as they are ([in, out] per expert), their biases
    [E, F] / [E, D] -> wi_0_bias, wi_1_bias, wo_bias."""
    d, moe = cfg.emb_dim, cfg.moe
    e, f = moe.num_experts, moe.expert_mlp_dim
    table = tables.linear(f"{module}.router", (*path, "router"), d, e, bias=moe.router_bias)
    for kernel, name, shape in (
        ("wi_0", "gate_proj", (e, d, f)),
        ("wi_1", "up_proj", (e, d, f)),
        ("wo", "down_proj", (e, f, d)),
    ):
        table.append(Entry(f"{module}.experts.{name}", (*path, kernel), shape, shape))
        if moe.expert_bias:
            bias = (e, shape[-1])
            table.append(Entry(f"{module}.experts.{name}_bias", (*path, f"{kernel}_bias"), bias, bias))
    return table


def entries(cfg: LlamaConfig) -> list[Entry]:
    """Every tensor of HF *ForCausalLM for `cfg` in state-dict order (without "model."), tied copy excluded; each
    expert's kernels as their own leaves (`_stack_experts`)."""
    d, v, h = cfg.emb_dim, cfg.vocab_size, cfg.head_size
    model_type = hf_model_type(cfg)
    n, k = cfg.num_heads, cfg.kv_heads
    gemma = model_type == "gemma3_text"
    norm = functools.partial(tables.norm, bias=False, offset=1.0 if gemma else 0.0)  # Gemma's scales are 1 + weight
    table = tables.table("embed_tokens", ("embed",), v, d)
    for i in range(cfg.num_layers):
        prefix, path = f"layers.{i}.", ("blocks", f"layer_{i}")
        attn = (*path, "attn")
        table += tables.linear(
            prefix + "self_attn.q_proj", (*attn, "query"), d, n * h, out_shape=(n, h), bias=cfg.qkv_bias
        )
        table += tables.linear(
            prefix + "self_attn.k_proj", (*attn, "key"), d, k * h, out_shape=(k, h), bias=cfg.qkv_bias
        )
        table += tables.linear(
            prefix + "self_attn.v_proj", (*attn, "value"), d, k * h, out_shape=(k, h), bias=cfg.qkv_bias
        )
        table += tables.linear(
            prefix + "self_attn.o_proj", (*attn, "out"), n * h, d, in_shape=(n, h), bias=cfg.out_bias
        )
        if cfg.attention_sinks:
            table.append(Entry(prefix + "self_attn.sinks", (*attn, "sinks"), (n,), (n,)))
        if cfg.qk_norm:
            table += norm(prefix + "self_attn.q_norm", (*attn, "query_norm"), h)
            table += norm(prefix + "self_attn.k_norm", (*attn, "key_norm"), h)
        table += _feed_forward(prefix, (*path, "mlp"), cfg, model_type)
        table += norm(prefix + "input_layernorm", (*path, "ln_attn"), d)
        if gemma:  # HF's post_attention_layernorm is the attention output's there, Llama's pre-MLP norm elsewhere
            table += norm(prefix + "post_attention_layernorm", (*path, "ln_attn_out"), d)
            table += norm(prefix + "pre_feedforward_layernorm", (*path, "ln_mlp"), d)
            table += norm(prefix + "post_feedforward_layernorm", (*path, "ln_mlp_out"), d)
        else:
            table += norm(prefix + "post_attention_layernorm", (*path, "ln_mlp"), d)
    table += norm("norm", ("norm",), d)
    if not cfg.tie_embeddings:
        table += tables.linear("lm_head", ("lm_head",), d, v, bias=False)
    return table


def layout(cfg: LlamaConfig) -> tables.Layout:
    return tables.Layout(
        name=f"HF {ARCHITECTURES[hf_model_type(cfg)]}",
        family="llama",
        prefix="model.",
        heads=frozenset({"lm_head.weight"}),
        tied={"lm_head.weight": "embed_tokens.weight"} if cfg.tie_embeddings else {},
        skip=_BUFFER,
        tie_hint="; set tie_embeddings: False",
        note=" (names shown without the 'model.' prefix)"
        + (_GPT_OSS_NOTE if hf_model_type(cfg) == gpt_oss.MODEL_TYPE else _EXPERTS_NOTE * bool(cfg.num_experts)),
    )


_EXPERTS_NOTE = (
    "; experts are read one tensor per expert, as save_pretrained writes them (transformers 5's in-memory "
    "state_dict() fuses them into experts.gate_up_proj / experts.down_proj: save the model and read the folder)"
)


_GPT_OSS_NOTE = (
    "; gpt-oss's experts.gate_up_proj (and its bias, and its MXFP4 _blocks / _scales) is shown as its interleaved "
    "halves gate_proj and up_proj"
)


def _per_expert(cfg: LlamaConfig) -> bool:
    """Whether HF's checkpoints hold one tensor per expert (all but gpt-oss's, which stack them)."""
    return cfg.moe is not None and hf_model_type(cfg) != gpt_oss.MODEL_TYPE


def _stack_experts(params: Params, cfg: LlamaConfig) -> Params:
    """`params` (per-layer, as `entries` names them) with each layer's per-expert kernels {"0": [D, F], ...} stacked
    into one leaf [E, D, F] (lazily: `mapping.Stacked`, which reads expert by expert)."""
    if _per_expert(cfg):
        for i in range(cfg.num_layers):
            layer = params["blocks"][f"layer_{i}"]["mlp"]
            for kernel in _EXPERT_KERNELS:
                layer[kernel] = mapping.Stacked([layer[kernel][str(e)] for e in range(cfg.num_experts)])
    return params


def _split_experts(params: Params, cfg: LlamaConfig) -> Params:
    """The reverse of `_stack_experts` for lmzoo params in any layer layout: per-layer, each expert's kernels a leaf of
    their own (a leaf that is not [E, ...] is left for `tables.to_hf` to report)."""
    if not _per_expert(cfg):
        return params
    params = mapping.unstack_layers(params)  # new dicts down to the leaves: editing them leaves the caller's alone
    for layer in params.get("blocks", {}).values():
        ffn = layer.get("mlp", {}) if isinstance(layer, Mapping) else {}
        for kernel in _EXPERT_KERNELS:
            if kernel in ffn and np.ndim(ffn[kernel]) == 3 and np.shape(ffn[kernel])[0] == cfg.num_experts:
                stacked = np.asarray(ffn[kernel])
                ffn[kernel] = {str(e): stacked[e] for e in range(cfg.num_experts)}
    return params


def _sources(state_dict: Mapping[str, Any], cfg: LlamaConfig) -> Params:
    if hf_model_type(cfg) == gpt_oss.MODEL_TYPE:
        state_dict = gpt_oss.split_experts(state_dict)
    return _stack_experts(tables.to_sources(*tables.read_hf(state_dict, layout(cfg), entries(cfg))), cfg)


def from_hf(state_dict: Mapping[str, Any], cfg: LlamaConfig) -> Params:
    """HF Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 / Mixtral / Qwen2-MoE / Qwen3-MoE *ForCausalLM state dict (experts
    one tensor each, as in safetensors files) -> lmzoo "llama" params (per-layer, float32 numpy).

    With tied embeddings an `lm_head.weight` is accepted only if it equals `embed_tokens.weight`.
    """
    return mapping.materialize(_sources(state_dict, cfg))


def to_hf(params: Params, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """lmzoo "llama" params (per-layer or scanned) -> HF *ForCausalLM state dict of float32 numpy arrays (experts
    one tensor each, the layout safetensors files hold)."""
    state_dict = tables.to_hf(_split_experts(params, cfg), layout(cfg), entries(cfg))
    return gpt_oss.join_experts(state_dict) if hf_model_type(cfg) == gpt_oss.MODEL_TYPE else state_dict


def checkpoint_sources(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params as lazy leaves, read only when placed) of an HF Llama, Mistral, Qwen2, Qwen3,
    Gemma 3, Mixtral, Qwen2-MoE, Qwen3-MoE or gpt-oss checkpoint; fine-grained FP8 weights and gpt-oss's MXFP4
    experts dequantized as they are read."""
    fields = config_from_hf(hf_config)
    fp8_block = _fp8_block(hf_config)
    if fp8_block:
        state_dict = quantized.read_fp8_blocks(state_dict, fp8_block)
    return fields, _sources(state_dict, tables.checkpoint_config("llama", fields))


def read_checkpoint(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params: per-layer float32 numpy) of an HF Llama, Mistral, Qwen2, Qwen3, Gemma 3, Mixtral,
    Qwen2-MoE, Qwen3-MoE or gpt-oss checkpoint."""
    fields, sources = checkpoint_sources(hf_config, state_dict)
    return fields, mapping.materialize(sources)
