"""HF T5 (v1.0, v1.1) and BART <-> lmzoo "seq2seq": two naming schemes of one encoder-decoder.

Config translation (config.json <-> config.model) and the tensor table of each model_type. HF
nn.Linear weights are [out, in] and are transposed into Flax [in, out] kernels; query/key/value then
reshape to (D, N, H) and the attention output to (N, H, D).
"""

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from lmzoo.convert import mapping, tables
from lmzoo.convert.tables import Entry, Params
from lmzoo.models.seq2seq import Seq2SeqConfig

# config.model field -> (HF config.json key, HF class default; None = required).
_T5_HF_KEYS = {
    "vocab_size": ("vocab_size", None),
    "emb_dim": ("d_model", None),
    "head_dim": ("d_kv", None),
    "mlp_dim": ("d_ff", None),
    "num_heads": ("num_heads", None),
    "num_encoder_layers": ("num_layers", None),
    "relative_buckets": ("relative_attention_num_buckets", 32),
    "relative_max_distance": ("relative_attention_max_distance", 128),
    "dropout_rate": ("dropout_rate", 0.1),
    "layer_norm_epsilon": ("layer_norm_epsilon", 1e-6),
    "embedding_init_std": ("initializer_factor", 1.0),
}
_BART_HF_KEYS = {
    "vocab_size": ("vocab_size", None),
    "emb_dim": ("d_model", None),
    "num_heads": ("encoder_attention_heads", None),
    "num_encoder_layers": ("encoder_layers", None),
    "num_decoder_layers": ("decoder_layers", None),
    "mlp_dim": ("encoder_ffn_dim", None),
    "dropout_rate": ("dropout", 0.1),
    "attention_dropout_rate": ("attention_dropout", 0.0),
    "embedding_init_std": ("init_std", 0.02),
    "scale_embeddings": ("scale_embedding", False),
    "decoder_start_id": ("decoder_start_token_id", 2),
}
# config.model fields that HF T5 / BART hard-code.
_T5_FIXED = {
    "positions": "relative",
    "pre_norm": True,
    "norm": "rms",
    "use_bias": False,
    "embedding_norm": False,
    "scale_embeddings": False,
    "final_logits_bias": False,
    "attention_scale": 1.0,
}
_BART_FIXED = {
    "positions": "learned",
    "position_offset": 2,
    "pre_norm": False,
    "norm": "layer",
    "use_bias": True,
    "embedding_norm": True,
    "tie_embeddings": True,
    "scale_tied_logits": False,
    "final_logits_bias": True,
    "attention_scale": 0.0,
    "layer_norm_epsilon": 1e-5,
}
# Gated MLPs (activation, "linear") -> HF T5 feed_forward_proj; HF reads "gated-gelu" as tanh GELU.
_T5_GATED_TO_HF = {"gelu_tanh": "gated-gelu", "relu": "gated-relu", "silu": "gated-silu"}
# model_type -> (prefix of the model body's keys in *ForConditionalGeneration, keys HF skips when loading).
_LAYOUT = {
    "t5": ("", re.compile(r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight")),
    "bart": ("model.", re.compile(r"(encoder|decoder)\.version")),
}
MODEL_TYPES = tuple(_LAYOUT)  # the config.json model_types this converter reads (`convert.hf.family_of`)
_HEAD_KEYS = frozenset({"lm_head.weight", "final_logits_bias"})  # BART keys outside the "model." body


def _t5_activations(feed_forward_proj: str) -> tuple[str, ...]:
    """HF T5 feed_forward_proj ("relu", "gated-gelu", ...) -> MLP activations of the "seq2seq" family."""
    *gate, name = feed_forward_proj.split("-")
    if feed_forward_proj == "gated-gelu":
        name = "gelu_new"  # HF's backward-compatible reading
    if gate not in ([], ["gated"]) or name not in tables.ACTIVATION_FROM_HF:
        raise tables.ConfigError(
            f"HF T5 feed_forward_proj {feed_forward_proj!r} has no lmzoo equivalent; use ACT or gated-ACT with ACT "
            f"one of {sorted(tables.ACTIVATION_FROM_HF)}"
        )
    return (tables.ACTIVATION_FROM_HF[name], "linear") if gate else (tables.ACTIVATION_FROM_HF[name],)


def _t5_feed_forward_proj(activations: tuple[str, ...]) -> str | None:
    """Inverse of `_t5_activations`; None when HF T5 cannot express the activations."""
    if len(activations) == 1:
        return tables.ACTIVATION_TO_HF.get(activations[0])
    if len(activations) == 2 and activations[1] == "linear":
        return _T5_GATED_TO_HF.get(activations[0])
    return None


def _check(cfg: Seq2SeqConfig, model_type: str) -> None:
    """Raises unless `cfg` describes a model that HF `model_type` ("t5" or "bart") can express."""
    fixed = {"t5": _T5_FIXED, "bart": _BART_FIXED}[model_type]
    broken = [f"{key}={value!r}" for key, value in fixed.items() if getattr(cfg, key) != value]
    if model_type == "t5":
        rules = {
            "tie_embeddings when scale_tied_logits (the decoder output is scaled only for a head tied to the embedding)": (
                cfg.tie_embeddings or not cfg.scale_tied_logits
            ),
            f"activations (ACT,) with ACT in {sorted(tables.ACTIVATION_TO_HF)} or (ACT, 'linear') with ACT in "
            f"{sorted(_T5_GATED_TO_HF)}": _t5_feed_forward_proj(cfg.activations) is not None,
        }
    else:
        rules = {
            "head_dim * num_heads == emb_dim": cfg.head_dim * cfg.num_heads == cfg.emb_dim,
            f"one activation in {sorted(tables.ACTIVATION_TO_HF)}": len(cfg.activations) == 1
            and cfg.activations[0] in tables.ACTIVATION_TO_HF,
        }
    broken += [rule for rule, ok in rules.items() if not ok]
    if broken:
        raise ValueError(f"the config has no HF {model_type} equivalent; it needs: " + "; ".join(broken))


def _typed_fields(hf_config: Mapping[str, Any], model_type: str, keys: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """The fields of `keys` from an HF config dict (None values take the HF default), typed like Seq2SeqConfig."""
    if hf_config.get("model_type", model_type) != model_type:
        raise tables.ConfigError(f"HF config has model_type={hf_config['model_type']!r}; expected {model_type!r}")
    missing = [key for key, default in keys.values() if default is None and hf_config.get(key) is None]
    if missing:
        raise tables.ConfigError(f"HF {model_type} config lacks {missing}")
    fields = {}
    for field, (key, default) in keys.items():
        value = hf_config.get(key)
        fields[field] = type(getattr(Seq2SeqConfig, field))(default if value is None else value)
    return fields


def t5_config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.model fields of the "seq2seq" family from an HF T5 config.json dict.

    v1.0 (feed_forward_proj "relu") has a tied head on the decoder output scaled by d_model ** -0.5;
    v1.1 ("gated-gelu") an untied, unscaled head. transformers >= 5 always sets tie_word_embeddings and
    keeps the v1.0/v1.1 switch in scale_decoder_outputs, which is read first (`read_checkpoint` ties an unscaled
    head saved without lm_head.weight). HF T5 applies dropout_rate
    to attention probabilities too. The decoder starts from decoder_start_token_id, else pad_token_id.
    """
    fields = _typed_fields(hf_config, "t5", _T5_HF_KEYS)
    tied = bool(hf_config.get("scale_decoder_outputs", hf_config.get("tie_word_embeddings", True)))
    decoder_layers = hf_config.get("num_decoder_layers")
    start = next(
        (hf_config[key] for key in ("decoder_start_token_id", "pad_token_id") if hf_config.get(key) is not None), 0
    )
    return (
        fields
        | _T5_FIXED
        | {
            "num_decoder_layers": fields["num_encoder_layers"] if decoder_layers is None else int(decoder_layers),
            "activations": _t5_activations(hf_config.get("feed_forward_proj", "relu")),
            "attention_dropout_rate": fields["dropout_rate"],
            "tie_embeddings": tied,
            "scale_tied_logits": tied,
            "decoder_start_id": int(start),
        }
    )


def t5_config_to_hf(cfg: Seq2SeqConfig) -> dict[str, Any]:
    """An HF T5 config.json dict for a "seq2seq" config (attention_dropout_rate is not kept: HF T5 applies
    dropout_rate to attention probabilities)."""
    _check(cfg, "t5")
    return {
        "model_type": "t5",
        "architectures": ["T5ForConditionalGeneration"],
        **{key: getattr(cfg, field) for field, (key, _) in _T5_HF_KEYS.items()},
        "num_decoder_layers": cfg.num_decoder_layers,
        "feed_forward_proj": _t5_feed_forward_proj(cfg.activations),
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_decoder_outputs": cfg.scale_tied_logits,
        "decoder_start_token_id": cfg.decoder_start_id,
        "is_encoder_decoder": True,
    }


def bart_config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.model fields of the "seq2seq" family from an HF BART config.json dict.

    Encoder and decoder must agree on heads and FFN size, and the head must be tied. HF's
    activation_dropout and layerdrop (training only) have no lmzoo equivalent and are not read.
    """
    fields = _typed_fields(hf_config, "bart", _BART_HF_KEYS | {"max_len": ("max_position_embeddings", None)})
    for key, same in (("decoder_attention_heads", "encoder_attention_heads"), ("decoder_ffn_dim", "encoder_ffn_dim")):
        if hf_config.get(key, hf_config[same]) != hf_config[same]:
            raise tables.ConfigError(
                f"HF bart config has {key}={hf_config[key]} != {same}={hf_config[same]}; lmzoo's seq2seq uses one value"
            )
    if not hf_config.get("tie_word_embeddings", True):
        raise tables.ConfigError("HF bart config has tie_word_embeddings=False; lmzoo reads BART with its head tied")
    activation = hf_config.get("activation_function", "gelu")
    if activation not in tables.ACTIVATION_FROM_HF:
        raise tables.ConfigError(
            f"HF activation {activation!r} has no lmzoo equivalent; supported: {sorted(tables.ACTIVATION_FROM_HF)}"
        )
    return (
        fields
        | _BART_FIXED
        | {
            "head_dim": fields["emb_dim"] // fields["num_heads"],
            "max_len": fields["max_len"] + _BART_FIXED["position_offset"],  # HF adds the offset rows itself
            "activations": (tables.ACTIVATION_FROM_HF[activation],),
            "init_scheme": "normal",  # BART's std init_std (0.02) for every weight
        }
    )


def bart_config_to_hf(cfg: Seq2SeqConfig) -> dict[str, Any]:
    """An HF BART config.json dict for a "seq2seq" config."""
    _check(cfg, "bart")
    return {
        "model_type": "bart",
        "architectures": ["BartForConditionalGeneration"],
        **{key: getattr(cfg, field) for field, (key, _) in _BART_HF_KEYS.items()},
        "decoder_attention_heads": cfg.num_heads,
        "decoder_ffn_dim": cfg.mlp_dim,
        "max_position_embeddings": cfg.max_len - cfg.position_offset,
        "activation_function": tables.ACTIVATION_TO_HF[cfg.activations[0]],
        "activation_dropout": 0.0,
        "tie_word_embeddings": True,
        "is_encoder_decoder": True,
    }


def _attention_entries(
    module: str, path: tuple[str, ...], cfg: Seq2SeqConfig, names: tuple[str, str, str, str]
) -> list[Entry]:
    """The query, key, value and output nn.Linear (`names` within `module`) of one HF attention."""
    d, heads, bias = cfg.emb_dim, (cfg.num_heads, cfg.head_dim), cfg.use_bias
    n = cfg.num_heads * cfg.head_dim
    entries = []
    for name, hf_name in zip(("query", "key", "value"), names[:3], strict=True):
        entries += tables.linear(f"{module}.{hf_name}", (*path, name), d, n, out_shape=heads, bias=bias)
    return entries + tables.linear(f"{module}.{names[3]}", (*path, "out"), n, d, in_shape=heads, bias=bias)


def _t5_entries(cfg: Seq2SeqConfig) -> list[Entry]:
    """Every tensor of HF T5ForConditionalGeneration for `cfg`, tied copies excluded."""
    d, f, v = cfg.emb_dim, cfg.mlp_dim, cfg.vocab_size
    wis = ("wi",) if len(cfg.activations) == 1 else ("wi_0", "wi_1")
    qkvo = ("q", "k", "v", "o")
    entries = tables.table("shared", ("embed",), v, d)
    for stack, num_layers in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        relpos = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias"
        entries += tables.table(relpos, (f"{stack}_relpos",), cfg.relative_buckets, cfg.num_heads)
        for i in range(num_layers):
            prefix, path = f"{stack}.block.{i}.layer.", (stack, f"layer_{i}")
            entries += _attention_entries(prefix + "0.SelfAttention", (*path, "attn"), cfg, qkvo)
            entries += tables.norm(prefix + "0.layer_norm", (*path, "ln_attn"), d, bias=False)
            mlp = prefix + "1."
            if stack == "decoder":
                entries += _attention_entries(prefix + "1.EncDecAttention", (*path, "cross_attn"), cfg, qkvo)
                entries += tables.norm(prefix + "1.layer_norm", (*path, "ln_cross"), d, bias=False)
                mlp = prefix + "2."
            for wi in wis:
                entries += tables.linear(f"{mlp}DenseReluDense.{wi}", (*path, "mlp", wi), d, f, bias=False)
            entries += tables.linear(f"{mlp}DenseReluDense.wo", (*path, "mlp", "wo"), f, d, bias=False)
            entries += tables.norm(mlp + "layer_norm", (*path, "ln_mlp"), d, bias=False)
        entries += tables.norm(f"{stack}.final_layer_norm", (f"{stack}_final_norm",), d, bias=False)
    if not cfg.tie_embeddings:
        entries += tables.linear("lm_head", ("lm_head",), d, v, bias=False)
    return entries


def _bart_entries(cfg: Seq2SeqConfig) -> list[Entry]:
    """Every tensor of HF BartForConditionalGeneration for `cfg` (without the "model." prefix), tied copies excluded."""
    d, f, v = cfg.emb_dim, cfg.mlp_dim, cfg.vocab_size
    entries = tables.table("shared", ("embed",), v, d)
    for stack, num_layers in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        entries += tables.table(f"{stack}.embed_positions", (f"{stack}_positions",), cfg.max_len, d)
        entries += tables.norm(f"{stack}.layernorm_embedding", (f"{stack}_embed_norm",), d)
        for i in range(num_layers):
            prefix, path = f"{stack}.layers.{i}.", (stack, f"layer_{i}")
            projections = ("q_proj", "k_proj", "v_proj", "out_proj")
            entries += _attention_entries(prefix + "self_attn", (*path, "attn"), cfg, projections)
            entries += tables.norm(prefix + "self_attn_layer_norm", (*path, "ln_attn"), d)
            if stack == "decoder":
                entries += _attention_entries(prefix + "encoder_attn", (*path, "cross_attn"), cfg, projections)
                entries += tables.norm(prefix + "encoder_attn_layer_norm", (*path, "ln_cross"), d)
            entries += tables.linear(prefix + "fc1", (*path, "mlp", "wi"), d, f)
            entries += tables.linear(prefix + "fc2", (*path, "mlp", "wo"), f, d)
            entries += tables.norm(prefix + "final_layer_norm", (*path, "ln_mlp"), d)
    return entries + [Entry("final_logits_bias", ("final_logits_bias",), (1, v), (v,), group="bias")]


def _entries(cfg: Seq2SeqConfig, model_type: str) -> list[Entry]:
    return _t5_entries(cfg) if model_type == "t5" else _bart_entries(cfg)


def _layout(cfg: Seq2SeqConfig, model_type: str) -> tables.Layout:
    """Naming around the entries: "model." body for BART, embed_tokens (and a tied lm_head) as copies of shared."""
    prefix, ignored = _LAYOUT[model_type]
    copies = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"] + ["lm_head.weight"] * cfg.tie_embeddings
    return tables.Layout(
        name=f"HF {model_type}",
        family="seq2seq",
        prefix=prefix,
        heads=_HEAD_KEYS,
        tied=dict.fromkeys(copies, "shared.weight"),
        skip=ignored,
        tie_hint="; set tie_embeddings and scale_tied_logits False (T5 v1.1)",
        note=f" (names shown without the optional '{prefix}' prefix)" if prefix else "",
    )


def _sources(state_dict: Mapping[str, Any], cfg: Seq2SeqConfig, model_type: str) -> Params:
    _check(cfg, model_type)
    table = _entries(cfg, model_type)
    params = tables.to_sources(*tables.read_hf(state_dict, _layout(cfg, model_type), table, optional=("bias",)))
    if model_type == "bart":  # as in HF, a checkpoint without final_logits_bias (a bare BartModel) has zeros
        params.setdefault("final_logits_bias", np.zeros(cfg.vocab_size, np.float32))
    return params


def _to_hf(params: Params, cfg: Seq2SeqConfig, model_type: str) -> dict[str, np.ndarray]:
    _check(cfg, model_type)
    return tables.to_hf(params, _layout(cfg, model_type), _entries(cfg, model_type))


def t5_from_hf(state_dict: Mapping[str, Any], cfg: Seq2SeqConfig) -> Params:
    """HF T5ForConditionalGeneration (or T5Model with a tied head) state dict -> lmzoo "seq2seq" params
    (per-layer, float32 numpy). embed_tokens copies, and lm_head when cfg ties the head, must equal shared."""
    return mapping.materialize(_sources(state_dict, cfg, "t5"))


def t5_to_hf(params: Params, cfg: Seq2SeqConfig) -> dict[str, np.ndarray]:
    """lmzoo "seq2seq" params (per-layer or scanned) -> HF T5ForConditionalGeneration state dict (float32
    numpy), tied copies included."""
    return _to_hf(params, cfg, "t5")


def bart_from_hf(state_dict: Mapping[str, Any], cfg: Seq2SeqConfig) -> Params:
    """HF BartForConditionalGeneration (or BartModel: no "model." prefix, final_logits_bias zeros) state dict
    -> lmzoo "seq2seq" params (per-layer, float32 numpy). Tied copies must equal model.shared."""
    return mapping.materialize(_sources(state_dict, cfg, "bart"))


def bart_to_hf(params: Params, cfg: Seq2SeqConfig) -> dict[str, np.ndarray]:
    """lmzoo "seq2seq" params (per-layer or scanned) -> HF BartForConditionalGeneration state dict (float32
    numpy), tied copies included."""
    return _to_hf(params, cfg, "bart")


_CONFIG_FROM_HF = {"t5": t5_config_from_hf, "bart": bart_config_from_hf}


def checkpoint_sources(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params as lazy leaves, read only when placed) of an HF T5 or BART checkpoint
    (by config.json model_type)."""
    model_type = hf_config.get("model_type")
    if model_type not in _CONFIG_FROM_HF:
        raise tables.ConfigError(
            f"HF config has model_type={model_type!r}; the seq2seq converter reads {sorted(_CONFIG_FROM_HF)}"
        )
    fields = _CONFIG_FROM_HF[model_type](hf_config)
    if model_type == "t5" and not fields["tie_embeddings"] and "lm_head.weight" not in state_dict:
        # transformers 5 ties an unscaled (v1.1) head to the embedding unless a checkpoint's lm_head differs, and then
        # saves no lm_head.weight; it reloads as that shared layer, which lmzoo's tied, unscaled head computes.
        fields["tie_embeddings"] = True
    return fields, _sources(state_dict, tables.checkpoint_config("seq2seq", fields), model_type)


def read_checkpoint(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params: per-layer float32 numpy) of an HF T5 or BART checkpoint."""
    fields, sources = checkpoint_sources(hf_config, state_dict)
    return fields, mapping.materialize(sources)
