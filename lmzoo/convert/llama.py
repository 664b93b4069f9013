"""HF Llama / Mistral / Qwen2 (*ForCausalLM) <-> lmzoo "llama": config translation and tensor table.

All three are the same decoder to lmzoo: Mistral adds a sliding window, Qwen2 q/k/v biases. HF's nn.Linear
weights are [out, in] and are transposed: q_proj [N*H, D] -> query (D, N, H), k_proj / v_proj [K*H, D] ->
(D, K, H), o_proj [D, N*H] -> out (N, H, D); gate_proj, up_proj, down_proj -> wi_0, wi_1, wo.
"""

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from lmzoo.convert import mapping
from lmzoo.convert.mapping import Entry, Params
from lmzoo.models.llama import LlamaConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Switches lmzoo's llama does not implement, with the only supported value. Llama's attention_bias also biases
# o_proj, which lmzoo's attention has no parameter for; Qwen2's q/k/v biases are implied by its model_type.
_FIXED_HF_OPTIONS = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
# Rotary inverse frequencies that checkpoints converted by older transformers versions saved with the weights.
_BUFFER = re.compile(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _rope(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta and the llama3 scaling fields from `rope_parameters` (transformers 5) or `rope_theta` +
    `rope_scaling` (earlier config.json files)."""
    field = "rope_parameters" if hf_config.get("rope_parameters") else "rope_scaling"
    rope = dict(hf_config.get(field) or {})
    theta = rope.get("rope_theta", hf_config.get("rope_theta", 10_000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise mapping.ConfigError(
            f"HF config has {field}.partial_rotary_factor={rope['partial_rotary_factor']!r}; "
            "lmzoo's llama rotates the whole head (1.0)"
        )
    # factor 0 (no scaling) is stated, so a target config that scales differs from an unscaled checkpoint.
    fields: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling_factor": 0.0}
    if rope_type == "default":
        return fields
    if rope_type != "llama3":
        raise mapping.ConfigError(
            f"HF config has {field} rope_type {rope_type!r}; lmzoo's llama implements only 'default' and 'llama3'"
        )
    return fields | {
        "rope_scaling_factor": float(rope["factor"]),
        "rope_low_freq_factor": float(rope["low_freq_factor"]),
        "rope_high_freq_factor": float(rope["high_freq_factor"]),
        "rope_original_max_len": int(rope["original_max_position_embeddings"]),
    }


def _sliding_window(hf_config: Mapping[str, Any], model_type: str, num_layers: int) -> int:
    """The window every layer uses (0: none); Qwen2 models whose layers differ are refused."""
    window = hf_config.get("sliding_window")
    if model_type == "mistral":
        return int(window or 0)
    if model_type == "llama" or not hf_config.get("use_sliding_window", False) or not window:
        return 0
    first_sliding = int(hf_config.get("max_window_layers", num_layers))
    kinds = hf_config.get("layer_types") or [
        "sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)
    ]
    if set(kinds) == {"full_attention"}:
        return 0
    if set(kinds) != {"sliding_attention"}:
        raise mapping.ConfigError(
            f"HF Qwen2 config has use_sliding_window=True with max_window_layers={first_sliding} < "
            f"num_hidden_layers={num_layers}: only some layers slide (layer_types {kinds}); lmzoo's llama applies "
            "one sliding_window to every layer (max_window_layers 0) or none (use_sliding_window False)"
        )
    return int(window)


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.model fields of the "llama" family from an HF Llama, Mistral or Qwen2 config.json dict."""
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise mapping.ConfigError(
            f"HF config has model_type={model_type!r} (architectures {hf_config.get('architectures')}); the llama "
            f"converter reads {', '.join(ARCHITECTURES.values())} (model_type {', '.join(ARCHITECTURES)})"
        )
    unsupported = [a for a in hf_config.get("architectures") or () if a != ARCHITECTURES[model_type]]
    if unsupported:
        raise mapping.ConfigError(
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
        raise mapping.ConfigError(f"HF {model_type} config lacks {missing}")
    for key, supported in _FIXED_HF_OPTIONS.items():
        if hf_config.get(key, supported) != supported:
            raise mapping.ConfigError(
                f"HF {model_type} config has {key}={hf_config[key]!r}; lmzoo's llama supports only {supported!r}"
            )
    emb_dim, num_heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
    num_layers = int(hf_config["num_hidden_layers"])
    kv_heads, head_dim = int(hf_config.get("num_key_value_heads") or num_heads), hf_config.get("head_dim")
    if num_heads % kv_heads:
        raise mapping.ConfigError(
            f"HF {model_type} config has num_key_value_heads={kv_heads}, which does not divide "
            f"num_attention_heads={num_heads} (each key/value head serves a whole group of query heads)"
        )
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
        **_rope(hf_config),
        "sliding_window": _sliding_window(hf_config, model_type, num_layers),
        "qkv_bias": model_type == "qwen2",
        "tie_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
        "norm_epsilon": float(hf_config.get("rms_norm_eps", 1e-6)),
        "init_std": float(hf_config.get("initializer_range", 0.02)),
        "dropout_rate": 0.0,
        "attention_dropout_rate": float(hf_config.get("attention_dropout", 0.0)),
    }


def hf_model_type(cfg: LlamaConfig) -> str:
    """qwen2 for q/k/v biases, else mistral for a sliding window, else llama."""
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window else "llama"


def config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """An HF config.json dict (Llama, Mistral or Qwen2: `hf_model_type`) for a "llama" config.

    Residual dropout has no HF field (HF's decoders have none); it does not change the exported model's function.
    """
    model_type = hf_model_type(cfg)
    rope = {"rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        factor, low, high, original = cfg.rope_scaling
        rope["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }
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
    if model_type == "mistral":
        return hf_config | {"sliding_window": cfg.sliding_window}
    window = cfg.sliding_window or None
    return hf_config | {
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0 if window else cfg.num_layers,
        "layer_types": ["sliding_attention" if window else "full_attention"] * cfg.num_layers,
    }


def entries(cfg: LlamaConfig) -> list[Entry]:
    """Every tensor of HF *ForCausalLM for `cfg` in state-dict order (without "model."), tied copy excluded."""
    d, f, v, h = cfg.emb_dim, cfg.mlp_dim, cfg.vocab_size, cfg.head_size
    n, k = cfg.num_heads, cfg.kv_heads
    table = mapping.table("embed_tokens", ("embed",), v, d)
    for i in range(cfg.num_layers):
        prefix, path = f"layers.{i}.", ("blocks", f"layer_{i}")
        attn = (*path, "attn")
        table += mapping.linear(
            prefix + "self_attn.q_proj", (*attn, "query"), d, n * h, out_shape=(n, h), bias=cfg.qkv_bias
        )
        table += mapping.linear(
            prefix + "self_attn.k_proj", (*attn, "key"), d, k * h, out_shape=(k, h), bias=cfg.qkv_bias
        )
        table += mapping.linear(
            prefix + "self_attn.v_proj", (*attn, "value"), d, k * h, out_shape=(k, h), bias=cfg.qkv_bias
        )
        table += mapping.linear(prefix + "self_attn.o_proj", (*attn, "out"), n * h, d, in_shape=(n, h), bias=False)
        table += mapping.linear(prefix + "mlp.gate_proj", (*path, "mlp", "wi_0"), d, f, bias=False)
        table += mapping.linear(prefix + "mlp.up_proj", (*path, "mlp", "wi_1"), d, f, bias=False)
        table += mapping.linear(prefix + "mlp.down_proj", (*path, "mlp", "wo"), f, d, bias=False)
        table += mapping.norm(prefix + "input_layernorm", (*path, "ln_attn"), d, bias=False)
        table += mapping.norm(prefix + "post_attention_layernorm", (*path, "ln_mlp"), d, bias=False)
    table += mapping.norm("norm", ("norm",), d, bias=False)
    if not cfg.tie_embeddings:
        table += mapping.linear("lm_head", ("lm_head",), d, v, bias=False)
    return table


def layout(cfg: LlamaConfig) -> mapping.Layout:
    return mapping.Layout(
        name=f"HF {ARCHITECTURES[hf_model_type(cfg)]}",
        family="llama",
        prefix="model.",
        heads=frozenset({"lm_head.weight"}),
        tied={"lm_head.weight": "embed_tokens.weight"} if cfg.tie_embeddings else {},
        skip=_BUFFER,
        tie_hint="; set tie_embeddings: False",
        note=" (names shown without the 'model.' prefix)",
    )


def _sources(state_dict: Mapping[str, Any], cfg: LlamaConfig) -> Params:
    return mapping.to_sources(*mapping.read_hf(state_dict, layout(cfg), entries(cfg)))


def from_hf(state_dict: Mapping[str, Any], cfg: LlamaConfig) -> Params:
    """HF Llama / Mistral / Qwen2 *ForCausalLM state dict -> lmzoo "llama" params (per-layer, float32 numpy).

    With tied embeddings an `lm_head.weight` is accepted only if it equals `embed_tokens.weight`.
    """
    return mapping.materialize(_sources(state_dict, cfg))


def to_hf(params: Params, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """lmzoo "llama" params (per-layer or scanned) -> HF *ForCausalLM state dict of float32 numpy arrays."""
    return mapping.to_hf(params, layout(cfg), entries(cfg))


def checkpoint_sources(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params as lazy `mapping` leaves, read only when placed) of an HF Llama, Mistral or
    Qwen2 checkpoint."""
    fields = config_from_hf(hf_config)
    return fields, _sources(state_dict, mapping.checkpoint_config("llama", fields))


def read_checkpoint(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params: per-layer float32 numpy) of an HF Llama, Mistral or Qwen2 checkpoint."""
    fields, sources = checkpoint_sources(hf_config, state_dict)
    return fields, mapping.materialize(sources)
