"""HF Qwen3.5 text model (Qwen3_5ForCausalLM, model_type qwen3_5_text; Qwen3_5MoeForCausalLM, qwen3_5_moe_text) <->
lmzoo "qwen3_5": config translation and tensor tables. The released checkpoints are the vision-language models
(Qwen3_5ForConditionalGeneration, model_type qwen3_5; Qwen3_5MoeForConditionalGeneration, qwen3_5_moe): their text
model is read as HF's *ForCausalLM reads it (text_config; the tensors under "model.language_model.", the vision
encoder "model.visual.*" left out).

HF's nn.Linear weights are [out, in] and are transposed. HF layer i is blocks/layer_(i // P)/block_(i % P) for the
repeating pattern of P layer kinds (`models.qwen3_5`). Gated DeltaNet layers (linear_attn): in_proj_qkv [2 G H + N P,
D] holds the queries, keys and values one after the other -> query (D, G, H), key (D, G, H), value (D, N, P);
conv1d [2 G H + N P, 1, W] likewise -> query_conv (W, G, H), key_conv, value_conv (W, N, P); in_proj_z -> gate (D, N,
P), in_proj_b -> beta (D, N), in_proj_a -> decay (D, N), dt_bias -> decay_bias, A_log -> decay_rate, norm -> norm (a
plain scale: HF's gated norm multiplies by its weight), out_proj -> out (N, P, D). Full-attention layers (self_attn):
q_proj [N 2H, D] holds each head's query then its gate -> query (D, N, H) and gate (D, N, H); k_proj, v_proj ->
key, value (D, K, H); o_proj -> out (N, H, D); q_norm, k_norm -> query_norm, key_norm. Every RMSNorm but the gated
one multiplies by 1 + weight (zero-centred): lmzoo's scale is weight + 1. Qwen3.5-MoE's feed-forward (every layer):
mlp.gate [E, D] -> router (D, E), mlp.experts.e.{gate,up,down}_proj -> slice e of wi_0, wi_1 [E, D, F] and wo [E, F,
D] (one tensor per expert, as save_pretrained writes them), mlp.shared_expert -> shared, mlp.shared_expert_gate [1,
D] -> shared_gate (D,).

Read from config.json as HF reads it: layer_types (or full_attention_interval), rope_parameters of rope_type default
with partial_rotary_factor (0.25 where absent); its mrope_section does not apply to text, whose three position rows are
equal. Refused, naming the key: another rope_type or activation, attention_bias. The multi-token-prediction weights
(mtp.*) of released checkpoints are not read, as HF does not.

Qwen3-Next (Qwen3NextForCausalLM, model_type qwen3_next), Qwen3.5's predecessor, has the same layers, norms (1 + w),
partial rotary and gated attention; it differs in the Gated DeltaNet's input projections, which are fused and
interleaved per key head g (r = N / G value heads each): in_proj_qkvz [G (2 H + 2 r P), D] holds, group by group, q_g
(H), k_g (H), the group's values (r P) and gates (r P) -> query, key (D, G, H), value, gate (D, N, P), and in_proj_ba
[G 2r, D] the group's betas then decays (r each) -> beta, decay (D, N) (`_split`, `_fuse`; conv1d is laid out as
Qwen3.5's). Its feed-forward is a mixture of experts (Qwen3.5-MoE's tensors) in layer i unless i is in mlp_only_layers,
where num_experts > 0 and (i + 1) % decoder_sparse_step == 0, else a SwiGLU of intermediate_size: all sparse or all
dense is read, a mix refused (naming both keys), as a sparse layer without a shared expert
(shared_expert_intermediate_size 0); norm_topk_prob is renormalize_expert_weights. Export writes qwen3_next when asked
(`hf_model_type`), or on its own for experts whose top-k weights are not renormalised, which only Qwen3-Next expresses.
"""

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from lmzoo.convert import mapping, tables
from lmzoo.convert.tables import Entry, Params
from lmzoo.models.qwen3_5 import FULL, FULL_ATTENTION_INTERVAL, LAYER_TYPES, LINEAR, Qwen3_5Config

MODEL_TYPE, ARCHITECTURE = "qwen3_5_text", "Qwen3_5ForCausalLM"
MOE_MODEL_TYPE, MOE_ARCHITECTURE = "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"
NEXT_MODEL_TYPE, NEXT_ARCHITECTURE = "qwen3_next", "Qwen3NextForCausalLM"  # dense or with experts
ARCHITECTURES = {MODEL_TYPE: ARCHITECTURE, MOE_MODEL_TYPE: MOE_ARCHITECTURE, NEXT_MODEL_TYPE: NEXT_ARCHITECTURE}
# The released checkpoints: the vision-language models, whose text model HF's *ForCausalLM also reads.
VL_MODEL_TYPE, VL_ARCHITECTURE = "qwen3_5", "Qwen3_5ForConditionalGeneration"
VL_MODEL_TYPES = {VL_MODEL_TYPE: MODEL_TYPE, "qwen3_5_moe": MOE_MODEL_TYPE}  # -> the text model's
MODEL_TYPES = (*ARCHITECTURES, *VL_MODEL_TYPES)  # the config.json model_types read (`convert.hf.family_of`)
VL_ARCHITECTURES = {VL_MODEL_TYPE: VL_ARCHITECTURE, "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
PREFIX, VL_PREFIX = "model.", "model.language_model."
# Qwen3_5TextConfig's defaults for the keys a config.json may leave out.
_DEFAULTS = {
    "vocab_size": 248_320,
    "hidden_size": 4096,
    "intermediate_size": 12_288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-6,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
# Qwen3_5MoeTextConfig's, where they differ.
_MOE_DEFAULTS = {
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
    "router_aux_loss_coef": 0.001,
}
# Qwen3NextConfig's defaults (Qwen3-Next-80B-A3B's shape: experts in every layer).
_NEXT_DEFAULTS = _DEFAULTS | {
    "vocab_size": 151_936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
}
# The multi-token-prediction module of released checkpoints, which HF does not load, and the vision encoder.
_SKIP = re.compile(r"mtp\..*|model\.visual\..*")


def _rope(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise tables.ConfigError(
            f"HF {hf_config.get('model_type', MODEL_TYPE)} config has rope_parameters rope_type {rope_type!r}; lmzoo's "
            "qwen3_5 implements 'default'"
        )
    theta = rope.get("rope_theta", hf_config.get("rope_theta", 10_000.0))
    fraction = rope.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 0.25))
    return {"rope_theta": float(theta), "rotary_fraction": float(fraction)}


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.model fields of the "qwen3_5" family from an HF Qwen3.5 config.json dict: a text model's, or the
    vision-language model's (its text_config, as HF's Qwen3_5ForCausalLM reads it)."""
    model_type = hf_config.get("model_type")
    if model_type in VL_MODEL_TYPES:
        if not isinstance(hf_config.get("text_config"), Mapping):
            raise tables.ConfigError(f"HF {model_type} config has no text_config")
        unsupported = [a for a in hf_config.get("architectures") or () if a != VL_ARCHITECTURES[model_type]]
        if unsupported:
            raise tables.ConfigError(
                f"HF architecture {unsupported} is not supported; a {model_type} config is "
                f"{VL_ARCHITECTURES[model_type]}'s"
            )
        text = dict(hf_config["text_config"])
        text.setdefault("tie_word_embeddings", hf_config.get("tie_word_embeddings", False))
        text_type = VL_MODEL_TYPES[model_type]
        return config_from_hf(text | {"model_type": text_type, "architectures": [ARCHITECTURES[text_type]]})
    if model_type not in ARCHITECTURES:
        raise tables.ConfigError(
            f"HF config has model_type={model_type!r}; the qwen3_5 converter reads {sorted(ARCHITECTURES.values())} "
            f"(model_types {sorted(ARCHITECTURES)}) and the text models of {sorted(VL_ARCHITECTURES.values())} "
            f"(model_types {sorted(VL_MODEL_TYPES)})"
        )
    unsupported = [a for a in hf_config.get("architectures") or () if a != ARCHITECTURES[model_type]]
    if unsupported:
        raise tables.ConfigError(
            f"HF architecture {unsupported} is not supported; a {model_type} config is {ARCHITECTURES[model_type]}'s"
        )
    defaults = {MODEL_TYPE: _DEFAULTS, MOE_MODEL_TYPE: _DEFAULTS | _MOE_DEFAULTS, NEXT_MODEL_TYPE: _NEXT_DEFAULTS}
    get = lambda key: hf_config.get(key, defaults[model_type].get(key))  # noqa: E731
    if get("hidden_act") not in (None, "silu"):
        raise tables.ConfigError(
            f"HF {model_type} config has hidden_act={get('hidden_act')!r}; lmzoo's qwen3_5 implements 'silu'"
        )
    if hf_config.get("attention_bias"):
        raise tables.ConfigError(
            f"HF {model_type} config has attention_bias=True; lmzoo's qwen3_5 has no attention biases"
        )
    num_layers = int(get("num_hidden_layers"))
    moe = _next_sparse(get, num_layers) if model_type == NEXT_MODEL_TYPE else model_type == MOE_MODEL_TYPE
    interval = int(hf_config.get("full_attention_interval") or FULL_ATTENTION_INTERVAL)
    kinds = list(hf_config.get("layer_types") or [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)])
    unknown = sorted({kind for kind in kinds if kind not in LAYER_TYPES})
    if unknown:
        raise tables.ConfigError(
            f"HF {model_type} config has layer_types {unknown[0]!r}; lmzoo's qwen3_5 implements {list(LAYER_TYPES)}"
        )
    experts = {}
    if moe:
        experts = {
            "num_experts": int(get("num_experts")),
            "experts_per_token": int(get("num_experts_per_tok")),
            "expert_mlp_dim": int(get("moe_intermediate_size")),
            "shared_expert_mlp_dim": int(get("shared_expert_intermediate_size")),
            # Qwen3.5-MoE's router always renormalises the top-k; Qwen3-Next's where norm_topk_prob
            "renormalize_expert_weights": bool(get("norm_topk_prob")) if model_type == NEXT_MODEL_TYPE else True,
            "load_balance_coef": float(get("router_aux_loss_coef")),
        }
    return {
        "vocab_size": int(get("vocab_size")),
        "max_len": int(get("max_position_embeddings")),
        "emb_dim": int(get("hidden_size")),
        "num_heads": int(get("num_attention_heads")),
        "num_kv_heads": int(get("num_key_value_heads") or get("num_attention_heads")),
        "head_dim": int(get("head_dim")),
        "num_layers": num_layers,
        # an MoE model has no dense feed-forward: mlp_dim is then the experts' (unused)
        "mlp_dim": int(get("moe_intermediate_size") if moe else get("intermediate_size")),
        **experts,
        **_rope(hf_config),
        "layer_types": tuple(kinds),
        "linear_key_heads": int(get("linear_num_key_heads")),
        "linear_value_heads": int(get("linear_num_value_heads")),
        "linear_key_dim": int(get("linear_key_head_dim")),
        "linear_value_dim": int(get("linear_value_head_dim")),
        "conv_width": int(get("linear_conv_kernel_dim")),
        "tie_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
        "norm_epsilon": float(get("rms_norm_eps")),
        "init_std": float(hf_config.get("initializer_range", 0.02)),
        "dropout_rate": 0.0,
        "attention_dropout_rate": float(hf_config.get("attention_dropout", 0.0)),
    }


def _next_sparse(get: Any, num_layers: int) -> bool:
    """Whether every feed-forward of a Qwen3-Next config is a mixture of experts (False: every one a SwiGLU). HF's
    Qwen3NextDecoderLayer: layer i has experts unless i is in mlp_only_layers, where num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0. A mix of both is refused, as a mixture without a shared expert."""
    only, step, experts = list(get("mlp_only_layers") or []), int(get("decoder_sparse_step")), int(get("num_experts"))
    if step < 1:
        raise tables.ConfigError(f"HF {NEXT_MODEL_TYPE} config has decoder_sparse_step={step}; HF needs >= 1")
    sparse = [i not in only and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)]
    if any(sparse) and not all(sparse):
        dense = [i for i, s in enumerate(sparse) if not s]
        raise tables.ConfigError(
            f"HF {NEXT_MODEL_TYPE} config has decoder_sparse_step={step}, mlp_only_layers={only}: layers {dense} are "
            "dense and the others mixtures of experts; lmzoo's qwen3_5 has experts in every layer or in none"
        )
    if all(sparse) and sparse and int(get("shared_expert_intermediate_size")) < 1:
        raise tables.ConfigError(
            f"HF {NEXT_MODEL_TYPE} config has shared_expert_intermediate_size="
            f"{get('shared_expert_intermediate_size')}; lmzoo's qwen3_5 reads a shared expert of width >= 1"
        )
    return bool(sparse) and all(sparse)


def hf_model_type(cfg: Qwen3_5Config, model_type: str | None = None) -> str:
    """qwen3_5_text, or qwen3_5_moe_text with experts; qwen3_next where `model_type` asks for it (the same function:
    Qwen3-Next reads any of these configs), or on its own for experts whose top-k weights are not renormalised, which
    only Qwen3-Next's norm_topk_prob expresses."""
    if model_type is None:
        if cfg.moe is not None and not cfg.moe.renormalize_expert_weights:
            return NEXT_MODEL_TYPE
        return MODEL_TYPE if cfg.moe is None else MOE_MODEL_TYPE
    if model_type not in ARCHITECTURES or model_type == (MOE_MODEL_TYPE if cfg.moe is None else MODEL_TYPE):
        raise ValueError(
            f"a qwen3_5 {'without' if cfg.moe is None else 'with'} experts exports to HF model_type "
            f"{hf_model_type(cfg)!r} or {NEXT_MODEL_TYPE!r}, not {model_type!r}"
        )
    return model_type


def config_to_hf(cfg: Qwen3_5Config, model_type: str | None = None) -> dict[str, Any]:
    """An HF Qwen3_5TextConfig (Qwen3_5MoeTextConfig with experts; Qwen3NextConfig for qwen3_next, `hf_model_type`)
    config.json dict for a "qwen3_5" config."""
    moe, model_type = cfg.moe, hf_model_type(cfg, model_type)
    renormalizes = moe is None or moe.renormalize_expert_weights or model_type == NEXT_MODEL_TYPE
    if moe is not None and (not moe.shared_expert_mlp_dim or not renormalizes):
        raise ValueError(
            f"a qwen3_5 with experts, shared_expert_mlp_dim={moe.shared_expert_mlp_dim} and "
            f"renormalize_expert_weights={moe.renormalize_expert_weights} has no HF counterpart: "
            f"{MOE_ARCHITECTURE} has a shared expert and renormalises the top-k weights, {NEXT_ARCHITECTURE} has a "
            "shared expert"
        )
    experts = {}
    if moe is not None:
        experts = {
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": moe.expert_mlp_dim,
            "shared_expert_intermediate_size": moe.shared_expert_mlp_dim,
            "router_aux_loss_coef": moe.load_balance_coef,
        }
    if model_type == NEXT_MODEL_TYPE:  # experts in every layer, or none (Qwen3NextConfig's default is 512)
        experts = {"num_experts": 0} | experts | {"decoder_sparse_step": 1, "mlp_only_layers": []}
        experts["norm_topk_prob"] = moe is None or moe.renormalize_expert_weights
    return experts | {
        "model_type": model_type,
        "architectures": [ARCHITECTURES[model_type]],
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_len,
        "hidden_size": cfg.emb_dim,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers,
        "intermediate_size": cfg.mlp_dim,
        "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.rotary_fraction,
        },
        "layer_types": list(cfg.kinds),
        "linear_num_key_heads": cfg.linear_key_heads,
        "linear_num_value_heads": cfg.linear_value_heads,
        "linear_key_head_dim": cfg.linear_key_dim,
        "linear_value_head_dim": cfg.linear_value_dim,
        "linear_conv_kernel_dim": cfg.conv_width,
        "rms_norm_eps": cfg.norm_epsilon,
        "initializer_range": cfg.init_std,
        "attention_bias": False,
        "attention_dropout": cfg.attention_dropout_rate,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def _layer_path(cfg: Qwen3_5Config, i: int) -> tuple[str, ...]:
    period = len(cfg.pattern)
    return ("blocks", f"layer_{i // period}", f"block_{i % period}")


def entries(cfg: Qwen3_5Config, model_type: str | None = None) -> list[Entry]:
    """Every tensor of the HF model of `cfg` (`hf_model_type`) without "model.", tied copy excluded. The fused tensors
    are whole leaves here ("qkv", "conv", "query_gate"; Qwen3-Next's "qkvz" (D, G, 2 H + 2 r P) and "ba" (D, G, 2 r),
    one row of columns per key head), which `_split` cuts into lmzoo's and `_fuse` joins back."""
    next_ = hf_model_type(cfg, model_type) == NEXT_MODEL_TYPE
    d, v, h = cfg.emb_dim, cfg.vocab_size, cfg.head_dim
    n, k = cfg.num_heads, cfg.num_kv_heads
    g_heads, n_heads, kh, vp = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    channels = 2 * g_heads * kh + n_heads * vp
    norm = lambda module, path, width: tables.norm(module, path, width, bias=False, offset=1.0)  # noqa: E731
    table = tables.table("embed_tokens", ("embed",), v, d)
    for i, kind in enumerate(cfg.kinds):
        prefix, path = f"layers.{i}.", _layer_path(cfg, i)
        if kind == LINEAR:
            mixer, lin = prefix + "linear_attn.", (*path, "linear_attn")
            if next_:
                group = channels // g_heads + n_heads // g_heads * vp  # q_g, k_g, the group's values and gates
                table += [
                    Entry(
                        mixer + "in_proj_qkvz.weight", (*lin, "qkvz"), (g_heads * group, d), (d, g_heads, group), True
                    ),
                    Entry(
                        mixer + "in_proj_ba.weight",
                        (*lin, "ba"),
                        (2 * n_heads, d),
                        (d, g_heads, 2 * n_heads // g_heads),
                        True,
                    ),
                ]
            else:
                table += [
                    Entry(mixer + "in_proj_qkv.weight", (*lin, "qkv"), (channels, d), (d, channels), transpose=True),
                ]
                table += tables.linear(
                    mixer + "in_proj_z", (*lin, "gate"), d, n_heads * vp, out_shape=(n_heads, vp), bias=False
                )
                table += tables.linear(mixer + "in_proj_b", (*lin, "beta"), d, n_heads, bias=False)
                table += tables.linear(mixer + "in_proj_a", (*lin, "decay"), d, n_heads, bias=False)
            table += [
                Entry(
                    mixer + "conv1d.weight",
                    (*lin, "conv"),
                    (channels, 1, cfg.conv_width),
                    (cfg.conv_width, channels),
                    transpose=True,
                ),
                Entry(mixer + "dt_bias", (*lin, "decay_bias"), (n_heads,), (n_heads,)),
                Entry(mixer + "A_log", (*lin, "decay_rate"), (n_heads,), (n_heads,)),
                Entry(mixer + "norm.weight", (*lin, "norm"), (vp,), (vp,)),
            ]
            table += tables.linear(
                mixer + "out_proj", (*lin, "out"), n_heads * vp, d, in_shape=(n_heads, vp), bias=False
            )
        else:
            attn, at = prefix + "self_attn.", (*path, "attn")
            table += [Entry(attn + "q_proj.weight", (*at, "query_gate"), (n * 2 * h, d), (d, n, 2 * h), transpose=True)]
            table += tables.linear(attn + "k_proj", (*at, "key"), d, k * h, out_shape=(k, h), bias=False)
            table += tables.linear(attn + "v_proj", (*at, "value"), d, k * h, out_shape=(k, h), bias=False)
            table += tables.linear(attn + "o_proj", (*at, "out"), n * h, d, in_shape=(n, h), bias=False)
            table += norm(attn + "q_norm", (*at, "query_norm"), h)
            table += norm(attn + "k_norm", (*at, "key_norm"), h)
        table += _feed_forward(prefix + "mlp", (*path, "mlp"), cfg)
        table += norm(prefix + "input_layernorm", (*path, "ln_attn"), d)
        table += norm(prefix + "post_attention_layernorm", (*path, "ln_mlp"), d)
    table += norm("norm", ("norm",), d)
    if not cfg.tie_embeddings:
        table += tables.linear("lm_head", ("lm_head",), d, v, bias=False)
    return table


def _swiglu(module: str, path: tuple[str, ...], d: int, f: int) -> list[Entry]:
    return [
        *tables.linear(f"{module}.gate_proj", (*path, "wi_0"), d, f, bias=False),
        *tables.linear(f"{module}.up_proj", (*path, "wi_1"), d, f, bias=False),
        *tables.linear(f"{module}.down_proj", (*path, "wo"), f, d, bias=False),
    ]


_EXPERT_KERNELS = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))


def _feed_forward(module: str, path: tuple[str, ...], cfg: Qwen3_5Config) -> list[Entry]:
    """A layer's SwiGLU, or its router (gate [E, D] -> router (D, E)), experts (one HF tensor per expert, as
    save_pretrained writes them: leaves (..., "wi_0", "e") that `_split` stacks), shared expert and its gate [1, D]
    -> shared_gate (D,)."""
    d, moe = cfg.emb_dim, cfg.moe
    if moe is None:
        return _swiglu(module, path, d, cfg.mlp_dim)
    f = moe.expert_mlp_dim
    table = tables.linear(f"{module}.gate", (*path, "router"), d, moe.num_experts, bias=False)
    for kernel, name in _EXPERT_KERNELS:
        n_in, n_out = (f, d) if kernel == "wo" else (d, f)
        for e in range(moe.num_experts):
            hf_name = f"{module}.experts.{e}.{name}.weight"
            table.append(Entry(hf_name, (*path, kernel, str(e)), (n_out, n_in), (n_in, n_out), transpose=True))
    table += _swiglu(f"{module}.shared_expert", (*path, "shared"), d, moe.shared_expert_mlp_dim)
    table.append(Entry(f"{module}.shared_expert_gate.weight", (*path, "shared_gate", "kernel"), (1, d), (d,), True))
    return table


def layout(cfg: Qwen3_5Config, prefix: str = PREFIX, model_type: str | None = None) -> tables.Layout:
    """HF's names around the entries: the body under `prefix` ("model.", or the VL_PREFIX of a released checkpoint)."""
    return tables.Layout(
        name=f"HF {ARCHITECTURES[hf_model_type(cfg, model_type)]}",
        family="qwen3_5",
        prefix=prefix,
        heads=frozenset({"lm_head.weight"}),
        tied={"lm_head.weight": "embed_tokens.weight"} if cfg.tie_embeddings else {},
        skip=_SKIP,
        tie_hint="; set tie_embeddings: False",
        note=f" (names shown without the {prefix!r} prefix)",
    )


class Columns(mapping.LazyLeaf):
    """Columns [start, stop) of the last axis of a leaf (lazy or an array), that axis reshaped to the trailing axes of
    `shape`: one of the parts of a fused HF tensor. A box of it reads the leaf's leading axes over the box's range
    and the part's columns whole."""

    def __init__(self, leaf: Any, start: int, stop: int, shape: tuple[int, ...]):
        self.leaf, self.start, self.stop = leaf, start, stop
        self.shape, self.dtype = tuple(shape), np.dtype(leaf.dtype)
        self.lead = len(leaf.shape) - 1  # the leaf's axes kept as they are

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        box = mapping.box_of(index, self.shape)
        rows = tuple(slice(*bounds) for bounds in box[: self.lead])
        block = np.asarray(self.leaf[(*rows, slice(self.start, self.stop))])
        block = block.reshape(block.shape[: self.lead] + self.shape[self.lead :])
        return block[(slice(None),) * self.lead + tuple(slice(*bounds) for bounds in box[self.lead :])]


class GroupColumns(mapping.LazyLeaf):
    """Columns [start, stop) of the last axis of a leaf [D, G, W] (lazy or an array) that holds the same parts key head
    by key head (Qwen3-Next's fused projections), the group and column axes merged into the trailing axes of `shape`
    ([D, N, P] or [D, N], N = G r: value head g r + j is group g's j-th; [D, G, H] for a query or key). A box reads
    the leaf's rows over the box's range and the part's columns of every group whole. Not a `Columns`: the part is not
    one run of the HF tensor's output features (`fused_parts`)."""

    def __init__(self, leaf: Any, start: int, stop: int, shape: tuple[int, ...]):
        self.leaf, self.start, self.stop = leaf, start, stop
        self.shape, self.dtype = tuple(shape), np.dtype(leaf.dtype)

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        box = mapping.box_of(index, self.shape)
        block = np.asarray(self.leaf[(slice(*box[0]), slice(None), slice(self.start, self.stop))])
        block = block.reshape(block.shape[:1] + self.shape[1:])  # [D', G, r P] -> [D', N, P]
        return block[(slice(None),) + tuple(slice(*bounds) for bounds in box[1:])]


def _next_widths(cfg: Qwen3_5Config) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """(kernel name, start, stop) of each part of a key head's columns in Qwen3-Next's in_proj_qkvz and in_proj_ba."""
    h, r = cfg.linear_key_dim, cfg.linear_value_heads // cfg.linear_key_heads
    r_p = r * cfg.linear_value_dim
    qkvz = [("query", 0, h), ("key", h, 2 * h), ("value", 2 * h, 2 * h + r_p), ("gate", 2 * h + r_p, 2 * h + 2 * r_p)]
    return qkvz, [("beta", 0, r), ("decay", r, 2 * r)]


def _mixer_widths(cfg: Qwen3_5Config) -> list[tuple[str, str, tuple[int, ...]]]:
    """(kernel name, conv name, per-tap shape) of the fused query/key/value channels, in HF's order."""
    g_heads, n_heads = cfg.linear_key_heads, cfg.linear_value_heads
    return [
        ("query", "query_conv", (g_heads, cfg.linear_key_dim)),
        ("key", "key_conv", (g_heads, cfg.linear_key_dim)),
        ("value", "value_conv", (n_heads, cfg.linear_value_dim)),
    ]


def _layers(params: Params, cfg: Qwen3_5Config):
    """(kind, that layer's params) of every HF layer of per-layer params."""
    for i, kind in enumerate(cfg.kinds):
        node = params
        for name in _layer_path(cfg, i):
            node = node[name]
        yield kind, node


def _split(params: Params, cfg: Qwen3_5Config, model_type: str | None = None) -> Params:
    """`params` as `entries` names them -> lmzoo's leaves: the fused leaves cut into their parts (lazily)."""
    next_ = hf_model_type(cfg, model_type) == NEXT_MODEL_TYPE
    d, g_heads, n_heads = cfg.emb_dim, cfg.linear_key_heads, cfg.linear_value_heads
    for kind, layer in _layers(params, cfg):
        if kind == LINEAR:
            mixer, start = layer["linear_attn"], 0
            qkv, conv = None if next_ else mixer.pop("qkv"), mixer.pop("conv")
            for name, conv_name, shape in _mixer_widths(cfg):
                stop = start + int(np.prod(shape))
                if not next_:
                    mixer[name] = {"kernel": Columns(qkv, start, stop, (d, *shape))}
                mixer[conv_name] = Columns(conv, start, stop, (cfg.conv_width, *shape))
                start = stop
            if next_:  # qkvz (D, G, 2 H + 2 r P), ba (D, G, 2 r): each key head's parts
                qkvz, ba = mixer.pop("qkvz"), mixer.pop("ba")
                for name, start, stop in _next_widths(cfg)[0]:
                    per_group = name in ("query", "key")
                    shape = (d, g_heads, stop - start) if per_group else (d, n_heads, cfg.linear_value_dim)
                    mixer[name] = {"kernel": GroupColumns(qkvz, start, stop, shape)}
                for name, start, stop in _next_widths(cfg)[1]:
                    mixer[name] = {"kernel": GroupColumns(ba, start, stop, (d, n_heads))}
        else:
            attn, h = layer["attn"], cfg.head_dim
            fused = attn.pop("query_gate")  # (D, N, 2H): each head's query, then its gate
            attn["query"] = {"kernel": Columns(fused, 0, h, (cfg.emb_dim, cfg.num_heads, h))}
            attn["gate"] = {"kernel": Columns(fused, h, 2 * h, (cfg.emb_dim, cfg.num_heads, h))}
        if cfg.moe is not None:  # each expert's kernel {"0": [D, F], ...} -> one [E, D, F] leaf, read expert by expert
            ffn = layer["mlp"]
            for kernel, _ in _EXPERT_KERNELS:
                ffn[kernel] = mapping.Stacked([ffn[kernel][str(e)] for e in range(cfg.num_experts)])
    return params


def fused_parts(cfg: Qwen3_5Config) -> dict[tuple[str, ...], list[tuple[tuple[str, ...], int, int, tuple[int, ...]]]]:
    """{path of a fused leaf of `entries` ("qkv", "query_gate"): [(lmzoo kernel path, start, stop, kernel shape)]}:
    the columns [start, stop) of the leaf's last axis that `_split` cuts into each kernel, i.e. the lmzoo kernels of
    one HF nn.Linear (`lmzoo.lora.peft` reads and writes their adapters)."""
    leaves = {entry.path: np.broadcast_to(np.float32(0), entry.shape) for entry in entries(cfg)}  # shapes, no memory
    tree: Params = {}
    for path, leaf in leaves.items():
        node = tree
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = leaf
    fused = {id(leaf): path for path, leaf in leaves.items()}
    parts: dict[tuple[str, ...], list[tuple[tuple[str, ...], int, int, tuple[int, ...]]]] = {}
    for name, leaf in mapping.flatten(_split(tree, cfg)).items():
        if isinstance(leaf, Columns) and name.endswith("/kernel"):
            parts.setdefault(fused[id(leaf.leaf)], []).append(
                (tuple(name.split("/")), leaf.start, leaf.stop, leaf.shape)
            )
    return parts


def _fuse(params: Params, cfg: Qwen3_5Config, model_type: str | None = None) -> Params:
    """The reverse of `_split` for lmzoo params in any layer layout (per-layer afterwards)."""
    next_ = hf_model_type(cfg, model_type) == NEXT_MODEL_TYPE
    params = mapping.unstack_layers(params)
    d, g_heads = cfg.emb_dim, cfg.linear_key_heads
    for kind, layer in _layers(params, cfg):
        if kind == LINEAR:
            mixer = layer["linear_attn"]
            if next_:  # each key head's parts side by side: [D, N, ...] -> [D, G, r ...]
                for fused, parts in zip(("qkvz", "ba"), _next_widths(cfg), strict=True):
                    kernels = [np.asarray(mixer.pop(name)["kernel"]).reshape(d, g_heads, -1) for name, _, _ in parts]
                    mixer[fused] = np.concatenate(kernels, axis=-1)
            parts = [(mixer.pop(name, None), mixer.pop(conv)) for name, conv, _ in _mixer_widths(cfg)]
            if not next_:
                mixer["qkv"] = np.concatenate([np.asarray(k["kernel"]).reshape(d, -1) for k, _ in parts], axis=-1)
            mixer["conv"] = np.concatenate([np.asarray(c).reshape(cfg.conv_width, -1) for _, c in parts], axis=-1)
        else:
            attn = layer["attn"]
            query, gate = np.asarray(attn.pop("query")["kernel"]), np.asarray(attn.pop("gate")["kernel"])
            attn["query_gate"] = np.concatenate([query, gate], axis=-1)
        if cfg.moe is not None:
            ffn = layer["mlp"]
            for kernel, _ in _EXPERT_KERNELS:
                stacked = np.asarray(ffn[kernel])
                ffn[kernel] = {str(e): stacked[e] for e in range(cfg.num_experts)}
    return params


def _sources(
    state_dict: Mapping[str, Any], cfg: Qwen3_5Config, prefix: str = PREFIX, model_type: str | None = None
) -> Params:
    table = entries(cfg, model_type)
    return _split(
        tables.to_sources(*tables.read_hf(state_dict, layout(cfg, prefix, model_type), table)), cfg, model_type
    )


def from_hf(state_dict: Mapping[str, Any], cfg: Qwen3_5Config, model_type: str | None = None) -> Params:
    """HF Qwen3_5ForCausalLM state dict (that of `model_type`, `hf_model_type`: qwen3_next for Qwen3NextForCausalLM's)
    -> lmzoo "qwen3_5" params (per-layer, float32 numpy). With tied embeddings an `lm_head.weight` is accepted only if
    it equals `embed_tokens.weight`."""
    return mapping.materialize(_sources(state_dict, cfg, model_type=model_type))


def to_hf(params: Params, cfg: Qwen3_5Config, model_type: str | None = None) -> dict[str, np.ndarray]:
    """lmzoo "qwen3_5" params (per-layer or scanned) -> the state dict of float32 numpy arrays of HF
    Qwen3_5ForCausalLM, or of the model `hf_model_type(cfg, model_type)` names."""
    return tables.to_hf(_fuse(params, cfg, model_type), layout(cfg, model_type=model_type), entries(cfg, model_type))


def checkpoint_sources(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params as lazy leaves, read only when placed) of an HF Qwen3.5 checkpoint: a text model,
    or the text model of a vision-language one (its vision encoder left out); or of a Qwen3-Next one."""
    fields, model_type = config_from_hf(hf_config), hf_config.get("model_type")
    prefix = VL_PREFIX if model_type in VL_MODEL_TYPES else PREFIX
    model_type = NEXT_MODEL_TYPE if model_type == NEXT_MODEL_TYPE else None
    return fields, _sources(state_dict, tables.checkpoint_config("qwen3_5", fields), prefix, model_type)


def read_checkpoint(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params: per-layer float32 numpy) of an HF Qwen3.5 checkpoint (`checkpoint_sources`)."""
    fields, sources = checkpoint_sources(hf_config, state_dict)
    return fields, mapping.materialize(sources)
