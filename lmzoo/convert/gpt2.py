"""HF GPT-2 (GPT2LMHeadModel / GPT2Model) <-> lmzoo "gpt2": config translation and tensor table.

HF GPT-2's Conv1D weights are [in, out] like Flax kernels and copy directly; the fused c_attn [D, 3D]
splits into query, key, value, each reshaped to (D, N, H), and attn.c_proj [D, D] reshapes to (N, H, D).
The untied lm_head is an nn.Linear [V, D] and is transposed.
"""

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from lmzoo.convert import mapping, tables
from lmzoo.convert.tables import Entry, Params
from lmzoo.models.gpt2 import GPT2Config

# HF GPT-2 switches that lmzoo's decoder does not implement, with the only supported value.
_FIXED_HF_OPTIONS = {
    "add_cross_attention": False,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
}
# Non-parameter buffers that older HF GPT-2 versions keep in the state dict (the causal mask).
_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
MODEL_TYPES = ("gpt2",)  # the config.json model_types this converter reads (`convert.hf.family_of`)


def config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.model fields of the "gpt2" family from an HF GPT-2 config.json dict."""
    model_type = hf_config.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise tables.ConfigError(
            f"HF config has model_type={model_type!r}; the gpt2 converter reads only 'gpt2' checkpoints"
        )
    missing = [key for key in ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer") if key not in hf_config]
    if missing:
        raise tables.ConfigError(f"HF GPT-2 config lacks {missing}")
    for key, supported in _FIXED_HF_OPTIONS.items():
        if hf_config.get(key, supported) != supported:
            raise tables.ConfigError(
                f"HF GPT-2 config has {key}={hf_config[key]!r}; lmzoo's gpt2 supports only {supported!r}"
            )
    hf_activation = hf_config.get("activation_function", "gelu_new")
    if hf_activation not in tables.ACTIVATION_FROM_HF:
        raise tables.ConfigError(
            f"HF activation_function {hf_activation!r} has no lmzoo equivalent; "
            f"supported: {sorted(tables.ACTIVATION_FROM_HF)}"
        )
    n_embd, n_inner = int(hf_config["n_embd"]), hf_config.get("n_inner")
    return {
        "vocab_size": int(hf_config["vocab_size"]),
        "max_len": int(hf_config["n_positions"]),
        "emb_dim": n_embd,
        "num_heads": int(hf_config["n_head"]),
        "num_layers": int(hf_config["n_layer"]),
        "mlp_dim": 4 * n_embd if n_inner is None else int(n_inner),
        "dropout_rate": float(hf_config.get("resid_pdrop", 0.1)),
        "attention_dropout_rate": float(hf_config.get("attn_pdrop", 0.1)),
        "pre_norm": True,
        "use_bias": True,
        "tie_embeddings": bool(hf_config.get("tie_word_embeddings", True)),
        "activation": tables.ACTIVATION_FROM_HF[hf_activation],
        "layer_norm_epsilon": float(hf_config.get("layer_norm_epsilon", 1e-5)),
    }


def config_to_hf(cfg: GPT2Config) -> dict[str, Any]:
    """An HF GPT-2 config.json dict for a "gpt2" config (pre-norm with biases only, as HF GPT-2 is)."""
    if not cfg.pre_norm:
        raise ValueError("HF GPT-2 is pre-norm; a pre_norm=False (original GPT) model has no HF GPT-2 equivalent")
    if not cfg.use_bias:
        raise ValueError("HF GPT-2 has biases everywhere; a use_bias=False model has no HF GPT-2 equivalent")
    if cfg.activation not in tables.ACTIVATION_TO_HF:
        raise ValueError(
            f"activation {cfg.activation!r} has no HF GPT-2 equivalent; supported: {sorted(tables.ACTIVATION_TO_HF)}"
        )
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_len,
        "n_embd": cfg.emb_dim,
        "n_head": cfg.num_heads,
        "n_layer": cfg.num_layers,
        "n_inner": cfg.mlp_dim,
        "activation_function": tables.ACTIVATION_TO_HF[cfg.activation],
        "resid_pdrop": cfg.dropout_rate,
        "embd_pdrop": cfg.dropout_rate,
        "attn_pdrop": cfg.attention_dropout_rate,
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "tie_word_embeddings": cfg.tie_embeddings,
        **_FIXED_HF_OPTIONS,
    }


def entries(cfg: GPT2Config) -> list[Entry]:
    """Every tensor of HF GPT2LMHeadModel for `cfg` in state-dict order (without "transformer."), tied copy excluded."""
    d, f, v = cfg.emb_dim, cfg.mlp_dim, cfg.vocab_size
    heads = (cfg.num_heads, cfg.head_dim)
    table = tables.table("wte", ("wte",), v, d) + tables.table("wpe", ("wpe",), cfg.max_len, d)
    for i in range(cfg.num_layers):
        prefix, path = f"h.{i}.", ("blocks", f"layer_{i}")
        table += tables.norm(prefix + "ln_1", (*path, "ln_attn"), d)
        for index, name in enumerate(("query", "key", "value")):
            table += tables.conv1d(
                prefix + "attn.c_attn", (*path, "attn", name), d, d, out_shape=heads, part=(index, 3)
            )
        table += tables.conv1d(prefix + "attn.c_proj", (*path, "attn", "out"), d, d, in_shape=heads)
        table += tables.norm(prefix + "ln_2", (*path, "ln_mlp"), d)
        table += tables.conv1d(prefix + "mlp.c_fc", (*path, "mlp", "wi"), d, f)
        table += tables.conv1d(prefix + "mlp.c_proj", (*path, "mlp", "wo"), f, d)
    table += tables.norm("ln_f", ("ln_final",), d)
    if not cfg.tie_embeddings:
        table += tables.linear("lm_head", ("lm_head",), d, v, bias=False)
    return table


def layout(cfg: GPT2Config) -> tables.Layout:
    return tables.Layout(
        name="HF GPT-2",
        family="gpt2",
        prefix="transformer.",
        heads=frozenset({"lm_head.weight"}),
        tied={"lm_head.weight": "wte.weight"} if cfg.tie_embeddings else {},
        skip=_BUFFER,
        tie_hint="; set tie_embeddings: False",
        note=" (names shown without the optional 'transformer.' prefix)",
    )


def _sources(state_dict: Mapping[str, Any], cfg: GPT2Config) -> Params:
    return tables.to_sources(*tables.read_hf(state_dict, layout(cfg), entries(cfg)))


def from_hf(state_dict: Mapping[str, Any], cfg: GPT2Config) -> Params:
    """HF GPT2LMHeadModel / GPT2Model state dict -> lmzoo "gpt2" params (per-layer, float32 numpy).

    Keys may carry the `transformer.` prefix or not; the causal-mask buffers are ignored. With
    tied embeddings an `lm_head.weight` is accepted only if it equals `wte.weight`.
    """
    return mapping.materialize(_sources(state_dict, cfg))


def to_hf(params: Params, cfg: GPT2Config) -> dict[str, np.ndarray]:
    """lmzoo "gpt2" params (per-layer or scanned) -> HF GPT2LMHeadModel state dict of float32 numpy arrays."""
    config_to_hf(cfg)
    return tables.to_hf(params, layout(cfg), entries(cfg))


def classifier_to_hf(params: Params, cfg: GPT2Config) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Params of `heads.SequenceClassifier(GPT2(cfg), num_labels, head="linear", pooling="last")` -> (HF
    GPT2ForSequenceClassification config.json dict without its labels and pad id, state dict).

    HF's `score` layer has no bias: the classifier's bias b is folded into the final LayerNorm's bias,
    which feeds only that layer there: ln_f.bias + delta with score(delta) = b (the least-norm delta,
    exact since the score kernel's C <= D columns are independent; anything else is an error).
    """
    hf_config = config_to_hf(cfg) | {"architectures": ["GPT2ForSequenceClassification"]}
    kernel = np.asarray(params["classifier"]["kernel"], np.float64)  # [D, C]
    bias = np.asarray(params["classifier"]["bias"], np.float64)  # [C]
    delta = np.linalg.lstsq(kernel.T, bias, rcond=None)[0]  # [D]
    if not np.allclose(delta @ kernel, bias, rtol=0, atol=1e-6 * max(1.0, float(np.abs(bias).max()))):
        raise ValueError("the classifier's bias cannot be folded into ln_f (its kernel's columns are dependent)")
    backbone = dict(params["backbone"])
    ln_bias = np.asarray(backbone["ln_final"]["bias"], np.float64) + delta
    backbone["ln_final"] = {**backbone["ln_final"], "bias": ln_bias}
    backbone.pop("lm_head", None)  # an untied LM head is not part of the classifier
    table = entries(dataclasses.replace(cfg, tie_embeddings=True))  # without an lm_head
    table += tables.linear("score", ("score",), cfg.emb_dim, kernel.shape[1], bias=False)
    naming = layout(cfg)._replace(heads=frozenset({"score.weight"}), tied={})
    return hf_config, tables.to_hf({**backbone, "score": {"kernel": kernel}}, naming, table)


def checkpoint_sources(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params as lazy leaves, read only when placed) of an HF GPT-2 checkpoint."""
    fields = config_from_hf(hf_config)
    return fields, _sources(state_dict, tables.checkpoint_config("gpt2", fields))


def read_checkpoint(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params: per-layer float32 numpy) of an HF GPT-2 checkpoint."""
    fields, sources = checkpoint_sources(hf_config, state_dict)
    return fields, mapping.materialize(sources)
