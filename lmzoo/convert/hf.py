"""HuggingFace PyTorch state dicts <-> lmzoo parameter trees; the only module that knows HF names.

Each family has a config map (HF config.json <-> config.model fields) and a weight map (HF state
dict <-> lmzoo parameter tree), registered in `CONVERTERS` for `load_pretrained("hf:PATH", ...)`.
The "bert" family reads HF BERT, RoBERTa, ALBERT and DistilBERT (by config.json model_type);
`classifier_from_hf` reads their *ForSequenceClassification checkpoints. The "seq2seq" family reads
HF T5 (v1.0 and v1.1) and BART *ForConditionalGeneration checkpoints.

Layouts: Flax kernels are [in, out]. HF GPT-2 uses `Conv1D`, whose weights are already [in, out]
and copy directly: c_attn [D, 3D] splits into query, key, value, each reshaped to (D, N, H), and
attn.c_proj [D, D] reshapes to (N, H, D). HF `nn.Linear` (BERT, T5, BART, ..., and GPT-2's untied
lm_head [V, D]) stores [out, in] and needs a transpose; BERT's query/key/value then reshape to
(D, N, H) and the attention output dense to (N, H, D).

Weights are read only from safetensors files: pickled `pytorch_model.bin` checkpoints are refused,
because unpickling can run arbitrary code.
"""

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import numpy as np
from safetensors.numpy import load_file

from lmzoo.models import make_config
from lmzoo.models.bert import BertConfig
from lmzoo.models.gpt2 import GPT2Config
from lmzoo.models.seq2seq import Seq2SeqConfig

Params = dict[str, Any]

_ACTIVATION_FROM_HF = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
}
_ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
# HF GPT-2 switches that lmzoo's decoder does not implement, with the only supported value.
_GPT2_FIXED_HF_OPTIONS = {
    "add_cross_attention": False,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
}
# Non-parameter buffers that older HF GPT-2 versions keep in the state dict (the causal mask).
_GPT2_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


def gpt2_config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.model fields of the "gpt2" family from an HF GPT-2 config.json dict."""
    model_type = hf_config.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise ValueError(f"HF config has model_type={model_type!r}; the gpt2 converter reads only 'gpt2' checkpoints")
    missing = [key for key in ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer") if key not in hf_config]
    if missing:
        raise ValueError(f"HF GPT-2 config lacks {missing}")
    for key, supported in _GPT2_FIXED_HF_OPTIONS.items():
        if hf_config.get(key, supported) != supported:
            raise ValueError(f"HF GPT-2 config has {key}={hf_config[key]!r}; lmzoo's gpt2 supports only {supported!r}")
    hf_activation = hf_config.get("activation_function", "gelu_new")
    if hf_activation not in _ACTIVATION_FROM_HF:
        raise ValueError(
            f"HF activation_function {hf_activation!r} has no lmzoo equivalent; "
            f"supported: {sorted(_ACTIVATION_FROM_HF)}"
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
        "tie_embeddings": bool(hf_config.get("tie_word_embeddings", True)),
        "activation": _ACTIVATION_FROM_HF[hf_activation],
        "layer_norm_epsilon": float(hf_config.get("layer_norm_epsilon", 1e-5)),
    }


def gpt2_config_to_hf(cfg: GPT2Config) -> dict[str, Any]:
    """An HF GPT-2 config.json dict for a "gpt2" config (pre-norm only: HF has no post-norm GPT)."""
    if not cfg.pre_norm:
        raise ValueError("HF GPT-2 is pre-norm; a pre_norm=False (original GPT) model has no HF GPT-2 equivalent")
    if cfg.activation not in _ACTIVATION_TO_HF:
        raise ValueError(
            f"activation {cfg.activation!r} has no HF GPT-2 equivalent; supported: {sorted(_ACTIVATION_TO_HF)}"
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
        "activation_function": _ACTIVATION_TO_HF[cfg.activation],
        "resid_pdrop": cfg.dropout_rate,
        "embd_pdrop": cfg.dropout_rate,
        "attn_pdrop": cfg.attention_dropout_rate,
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "tie_word_embeddings": cfg.tie_embeddings,
        **_GPT2_FIXED_HF_OPTIONS,
    }


def _gpt2_hf_shapes(cfg: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Unprefixed HF GPT-2 parameter name -> shape for `cfg` (lm_head only when untied)."""
    d, f, v = cfg.emb_dim, cfg.mlp_dim, cfg.vocab_size
    shapes = {"wte.weight": (v, d), "wpe.weight": (cfg.max_len, d)}
    for i in range(cfg.num_layers):
        shapes |= {
            f"h.{i}.ln_1.weight": (d,),
            f"h.{i}.ln_1.bias": (d,),
            f"h.{i}.attn.c_attn.weight": (d, 3 * d),
            f"h.{i}.attn.c_attn.bias": (3 * d,),
            f"h.{i}.attn.c_proj.weight": (d, d),
            f"h.{i}.attn.c_proj.bias": (d,),
            f"h.{i}.ln_2.weight": (d,),
            f"h.{i}.ln_2.bias": (d,),
            f"h.{i}.mlp.c_fc.weight": (d, f),
            f"h.{i}.mlp.c_fc.bias": (f,),
            f"h.{i}.mlp.c_proj.weight": (f, d),
            f"h.{i}.mlp.c_proj.bias": (d,),
        }
    shapes |= {"ln_f.weight": (d,), "ln_f.bias": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def _gpt2_normalize(state_dict: Mapping[str, Any], cfg: GPT2Config) -> dict[str, np.ndarray]:
    """Unprefixed float32 copies of the expected tensors; errors list unexpected, missing, misshapen keys."""
    tensors, unexpected = {}, []
    for key, value in state_dict.items():
        name = key.removeprefix("transformer.")
        if _GPT2_BUFFER.fullmatch(name):
            continue
        if name in tensors:
            unexpected.append(key)
        tensors[name] = np.array(value, dtype=np.float32)
    expected = _gpt2_hf_shapes(cfg)
    if cfg.tie_embeddings and "lm_head.weight" in tensors:
        lm_head = tensors.pop("lm_head.weight")
        if "wte.weight" in tensors and not np.array_equal(lm_head, tensors["wte.weight"]):
            raise ValueError(
                "checkpoint has an lm_head.weight different from wte.weight but the config ties them; "
                "set tie_embeddings: False"
            )
    unexpected += sorted(set(tensors) - set(expected))
    missing = [name for name in expected if name not in tensors]
    if unexpected or missing:
        raise ValueError(
            f"HF GPT-2 state dict does not match the config: unexpected keys {unexpected}, missing keys {missing} "
            "(names shown without the optional 'transformer.' prefix)"
        )
    misshapen = [
        f"{name}: {tensors[name].shape} (expected {shape})"
        for name, shape in expected.items()
        if tensors[name].shape != shape
    ]
    if misshapen:
        raise ValueError("HF GPT-2 tensors with unexpected shapes: " + "; ".join(misshapen))
    return tensors


def gpt2_from_hf(state_dict: Mapping[str, np.ndarray], cfg: GPT2Config) -> Params:
    """HF GPT2LMHeadModel / GPT2Model state dict -> lmzoo "gpt2" params (per-layer, float32 numpy).

    Keys may carry the `transformer.` prefix or not; the causal-mask buffers are ignored. With
    tied embeddings an `lm_head.weight` is accepted only if it equals `wte.weight`.
    """
    sd = _gpt2_normalize(state_dict, cfg)
    d, heads = cfg.emb_dim, (cfg.num_heads, cfg.head_dim)
    blocks = {}
    for i in range(cfg.num_layers):
        p = f"h.{i}."
        qkv = np.split(sd[p + "attn.c_attn.weight"], 3, axis=1)
        qkv_bias = np.split(sd[p + "attn.c_attn.bias"], 3)
        attn = {
            name: {"kernel": kernel.reshape(d, *heads), "bias": bias.reshape(heads)}
            for name, kernel, bias in zip(("query", "key", "value"), qkv, qkv_bias, strict=True)
        }
        attn["out"] = {"kernel": sd[p + "attn.c_proj.weight"].reshape(*heads, d), "bias": sd[p + "attn.c_proj.bias"]}
        blocks[f"layer_{i}"] = {
            "attn": attn,
            "ln_attn": {"scale": sd[p + "ln_1.weight"], "bias": sd[p + "ln_1.bias"]},
            "ln_mlp": {"scale": sd[p + "ln_2.weight"], "bias": sd[p + "ln_2.bias"]},
            "mlp": {
                "wi": {"kernel": sd[p + "mlp.c_fc.weight"], "bias": sd[p + "mlp.c_fc.bias"]},
                "wo": {"kernel": sd[p + "mlp.c_proj.weight"], "bias": sd[p + "mlp.c_proj.bias"]},
            },
        }
    params = {
        "blocks": blocks,
        "ln_final": {"scale": sd["ln_f.weight"], "bias": sd["ln_f.bias"]},
        "wpe": {"embedding": sd["wpe.weight"]},
        "wte": {"embedding": sd["wte.weight"]},
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": np.ascontiguousarray(sd["lm_head.weight"].T)}
    return params


def gpt2_to_hf(params: Params, cfg: GPT2Config) -> dict[str, np.ndarray]:
    """lmzoo "gpt2" params (per-layer or scanned) -> HF GPT2LMHeadModel state dict of float32 numpy arrays."""
    if "layers" in params["blocks"]:
        params = _unstack_layers(params)

    def get(tree: Params, *path: str) -> np.ndarray:
        for name in path:
            tree = tree[name]
        return np.ascontiguousarray(np.asarray(tree, dtype=np.float32))

    d = cfg.emb_dim
    sd = {
        "transformer.wte.weight": get(params, "wte", "embedding"),
        "transformer.wpe.weight": get(params, "wpe", "embedding"),
    }
    for i in range(cfg.num_layers):
        block, p = params["blocks"][f"layer_{i}"], f"transformer.h.{i}."
        sd[p + "ln_1.weight"] = get(block, "ln_attn", "scale")
        sd[p + "ln_1.bias"] = get(block, "ln_attn", "bias")
        qkv = ("query", "key", "value")
        sd[p + "attn.c_attn.weight"] = np.concatenate(
            [get(block, "attn", n, "kernel").reshape(d, d) for n in qkv], axis=1
        )
        sd[p + "attn.c_attn.bias"] = np.concatenate([get(block, "attn", n, "bias").reshape(d) for n in qkv])
        sd[p + "attn.c_proj.weight"] = get(block, "attn", "out", "kernel").reshape(d, d)
        sd[p + "attn.c_proj.bias"] = get(block, "attn", "out", "bias")
        sd[p + "ln_2.weight"] = get(block, "ln_mlp", "scale")
        sd[p + "ln_2.bias"] = get(block, "ln_mlp", "bias")
        sd[p + "mlp.c_fc.weight"] = get(block, "mlp", "wi", "kernel")
        sd[p + "mlp.c_fc.bias"] = get(block, "mlp", "wi", "bias")
        sd[p + "mlp.c_proj.weight"] = get(block, "mlp", "wo", "kernel")
        sd[p + "mlp.c_proj.bias"] = get(block, "mlp", "wo", "bias")
    sd["transformer.ln_f.weight"] = get(params, "ln_final", "scale")
    sd["transformer.ln_f.bias"] = get(params, "ln_final", "bias")
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["transformer.wte.weight"].copy()
    else:
        sd["lm_head.weight"] = np.ascontiguousarray(get(params, "lm_head", "kernel").T)
    return sd


# BERT family: HF BERT, RoBERTa, ALBERT and DistilBERT are four naming schemes of lmzoo's one "bert" model.

# config.model field -> (HF config.json key, HF class default; None = required).
_BERT_COMMON_KEYS = {
    "vocab_size": ("vocab_size", None),
    "max_len": ("max_position_embeddings", None),
    "emb_dim": ("hidden_size", None),
    "num_heads": ("num_attention_heads", None),
    "num_layers": ("num_hidden_layers", None),
    "mlp_dim": ("intermediate_size", None),
    "type_vocab_size": ("type_vocab_size", 2),
    "activation": ("hidden_act", "gelu"),
    "layer_norm_epsilon": ("layer_norm_eps", 1e-12),
    "dropout_rate": ("hidden_dropout_prob", 0.1),
    "attention_dropout_rate": ("attention_probs_dropout_prob", 0.1),
}
_BERT_HF_KEYS = {
    "bert": _BERT_COMMON_KEYS,
    "roberta": _BERT_COMMON_KEYS,
    "albert": _BERT_COMMON_KEYS | {
        "embedding_dim": ("embedding_size", 128),
        "activation": ("hidden_act", "gelu_new"),
        "dropout_rate": ("hidden_dropout_prob", 0.0),
        "attention_dropout_rate": ("attention_probs_dropout_prob", 0.0),
    },
    "distilbert": {
        "vocab_size": ("vocab_size", None),
        "max_len": ("max_position_embeddings", None),
        "emb_dim": ("dim", None),
        "num_heads": ("n_heads", None),
        "num_layers": ("n_layers", None),
        "mlp_dim": ("hidden_dim", None),
        "activation": ("activation", "gelu"),
        "dropout_rate": ("dropout", 0.1),
        "attention_dropout_rate": ("attention_dropout", 0.1),
    },
}
_BERT_ENCODER_OPTIONS = {"is_decoder": False, "add_cross_attention": False, "position_embedding_type": "absolute"}
# HF switches that lmzoo's encoder does not implement, with the only supported value.
_BERT_FIXED_HF_OPTIONS = {
    "bert": _BERT_ENCODER_OPTIONS | {"tie_word_embeddings": True},
    "roberta": _BERT_ENCODER_OPTIONS | {"tie_word_embeddings": True},
    "albert": {
        "num_hidden_groups": 1,
        "inner_group_num": 1,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
    },
    "distilbert": {"tie_word_embeddings": True},
}
_BERT_CLASS_PREFIX = {"bert": "Bert", "roberta": "Roberta", "albert": "Albert", "distilbert": "DistilBert"}
_BERT_MODULES_BERT = {
    "layer": "encoder.layer.{i}.",
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "out": "attention.output.dense",
    "ln_attn": "attention.output.LayerNorm",
    "wi": "intermediate.dense",
    "wo": "output.dense",
    "ln_mlp": "output.LayerNorm",
    "embed_projection": None,
    "pooler": "pooler.dense",
    "sentence_classifier": "cls.seq_relationship",
    "mlm_dense": "cls.predictions.transform.dense",
    "mlm_norm": "cls.predictions.transform.LayerNorm",
    "mlm_bias": "cls.predictions.bias",
    "decoder": "cls.predictions.decoder",
}
# model_type -> lmzoo module -> HF module name without the "{model_type}." prefix ("{i}": layer index; None: absent).
_BERT_MODULES = {
    "bert": _BERT_MODULES_BERT,
    "roberta": _BERT_MODULES_BERT | {
        "sentence_classifier": None,
        "mlm_dense": "lm_head.dense",
        "mlm_norm": "lm_head.layer_norm",
        "mlm_bias": "lm_head.bias",
        "decoder": "lm_head.decoder",
    },
    "albert": {
        "layer": "encoder.albert_layer_groups.0.albert_layers.0.",
        "query": "attention.query",
        "key": "attention.key",
        "value": "attention.value",
        "out": "attention.dense",
        "ln_attn": "attention.LayerNorm",
        "wi": "ffn",
        "wo": "ffn_output",
        "ln_mlp": "full_layer_layer_norm",
        "embed_projection": "encoder.embedding_hidden_mapping_in",
        "pooler": "pooler",
        "sentence_classifier": "sop_classifier.classifier",
        "mlm_dense": "predictions.dense",
        "mlm_norm": "predictions.LayerNorm",
        "mlm_bias": "predictions.bias",
        "decoder": "predictions.decoder",
    },
    "distilbert": {
        "layer": "transformer.layer.{i}.",
        "query": "attention.q_lin",
        "key": "attention.k_lin",
        "value": "attention.v_lin",
        "out": "attention.out_lin",
        "ln_attn": "sa_layer_norm",
        "wi": "ffn.lin1",
        "wo": "ffn.lin2",
        "ln_mlp": "output_layer_norm",
        "embed_projection": None,
        "pooler": None,
        "sentence_classifier": None,
        "mlm_dense": "vocab_transform",
        "mlm_norm": "vocab_layer_norm",
        "mlm_bias": "vocab_projector.bias",
        "decoder": "vocab_projector",
    },
}
# model_type -> HF *ForSequenceClassification head modules: lmzoo SequenceClassifier param -> HF module.
_CLASSIFIER_MODULES = {
    "bert": {"classifier": "classifier"},
    "roberta": {"head_dense": "classifier.dense", "classifier": "classifier.out_proj"},
    "albert": {"classifier": "classifier"},
    "distilbert": {"head_dense": "pre_classifier", "classifier": "classifier"},
}
# model_type -> `heads.SequenceClassifier(head=...)` of its HF *ForSequenceClassification.
CLASSIFIER_HEADS = {"bert": "pooler", "roberta": "dense_tanh", "albert": "pooler", "distilbert": "dense_relu"}
# Non-parameter buffers of HF embeddings (position ids 0..P-1, zero token types).
_BERT_BUFFER = re.compile(r"embeddings\.(position_ids|token_type_ids)")


class _Entry(NamedTuple):
    """One HF tensor <-> one lmzoo leaf: leaf = (tensor.T if transpose else tensor).reshape(shape)."""

    group: str  # "encoder", "pooler", "sentence_classifier", "mlm" or "classifier"
    hf: str  # HF name without the "{model_type}." prefix
    path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    transpose: bool


def _linear(
    group: str, module: str, path: tuple[str, ...], n_in: int, n_out: int, in_shape=None, out_shape=None, bias=True
) -> list[_Entry]:
    """nn.Linear weight [out, in] (and bias) -> Einsum kernel (*in_shape, *out_shape) (and bias out_shape)."""
    in_shape, out_shape = in_shape or (n_in,), out_shape or (n_out,)
    entries = [_Entry(group, f"{module}.weight", (*path, "kernel"), (n_out, n_in), (*in_shape, *out_shape), True)]
    if bias:
        entries.append(_Entry(group, f"{module}.bias", (*path, "bias"), (n_out,), out_shape, False))
    return entries


def _norm(group: str, module: str, path: tuple[str, ...], d: int, bias: bool = True) -> list[_Entry]:
    entries = [_Entry(group, f"{module}.weight", (*path, "scale"), (d,), (d,), False)]
    if bias:
        entries.append(_Entry(group, f"{module}.bias", (*path, "bias"), (d,), (d,), False))
    return entries


def _bert_entries(cfg: BertConfig, model_type: str) -> list[_Entry]:
    """Every tensor of the HF model of `cfg`: encoder, pooler and sentence head as cfg enables, MLM head."""
    names = _BERT_MODULES[model_type]
    h, e, f, v = cfg.emb_dim, cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size
    tables = {"word_embeddings": v, "position_embeddings": cfg.max_len}
    if cfg.type_vocab_size:
        tables["token_type_embeddings"] = cfg.type_vocab_size
    entries = [
        _Entry("encoder", f"embeddings.{name}.weight", (name, "embedding"), (rows, e), (rows, e), False)
        for name, rows in tables.items()
    ]
    entries += _norm("encoder", "embeddings.LayerNorm", ("ln_embed",), e)
    if e != h:
        entries += _linear("encoder", names["embed_projection"], ("embed_projection",), e, h)
    blocks = {"shared": 0} if cfg.share_layers else {f"layer_{i}": i for i in range(cfg.num_layers)}
    heads = (cfg.num_heads, cfg.head_dim)
    for block, i in blocks.items():
        prefix, path = names["layer"].format(i=i), ("blocks", block)
        for qkv in ("query", "key", "value"):
            entries += _linear("encoder", prefix + names[qkv], (*path, "attn", qkv), h, h, out_shape=heads)
        entries += _linear("encoder", prefix + names["out"], (*path, "attn", "out"), h, h, in_shape=heads)
        entries += _norm("encoder", prefix + names["ln_attn"], (*path, "ln_attn"), h)
        entries += _linear("encoder", prefix + names["wi"], (*path, "mlp", "wi"), h, f)
        entries += _linear("encoder", prefix + names["wo"], (*path, "mlp", "wo"), f, h)
        entries += _norm("encoder", prefix + names["ln_mlp"], (*path, "ln_mlp"), h)
    if cfg.pooler:
        entries += _linear("pooler", names["pooler"], ("pooler",), h, h)
    if cfg.sentence_head:
        entries += _linear("sentence_classifier", names["sentence_classifier"], ("sentence_classifier",), h, 2)
    entries += _linear("mlm", names["mlm_dense"], ("mlm_dense",), h, e)
    entries += _norm("mlm", names["mlm_norm"], ("mlm_norm",), e)
    return entries + [_Entry("mlm", names["mlm_bias"], ("mlm_bias",), (v,), (v,), False)]


def _bert_tied(model_type: str) -> dict[str, str]:
    """HF copies -> the tensor they are tied to: the MLM decoder's weight (word embeddings) and bias."""
    names = _BERT_MODULES[model_type]
    tied = {
        f"{names['decoder']}.weight": "embeddings.word_embeddings.weight",
        f"{names['decoder']}.bias": names["mlm_bias"],
    }
    return {copy: source for copy, source in tied.items() if copy != source}


def _check_bert_family(cfg: BertConfig, model_type: str) -> None:
    """Raises unless `cfg` describes a model that HF `model_type` can express."""
    if model_type not in _BERT_MODULES:
        raise ValueError(f"model_type {model_type!r} is not a BERT-family HF model; supported: {sorted(_BERT_MODULES)}")
    names = _BERT_MODULES[model_type]
    rules = {
        "share_layers exactly for ALBERT (one shared layer)": cfg.share_layers == (model_type == "albert"),
        "embedding_dim != emb_dim exactly for ALBERT (its E -> H projection always exists)":
            (cfg.embed_dim != cfg.emb_dim) == (model_type == "albert"),
        "type_vocab_size 0 exactly for DistilBERT": (cfg.type_vocab_size == 0) == (model_type == "distilbert"),
        "position_offset > 0 exactly for RoBERTa": (cfg.position_offset > 0) == (model_type == "roberta"),
        "activation 'gelu' for RoBERTa (its MLM head hard-codes exact GELU)":
            model_type != "roberta" or cfg.activation == "gelu",
        "layer_norm_epsilon 1e-12 for DistilBERT (hard-coded)":
            model_type != "distilbert" or cfg.layer_norm_epsilon == 1e-12,
        f"pooler False ({model_type} has none)": not cfg.pooler or names["pooler"] is not None,
        f"sentence_head False ({model_type} has no NSP/SOP head)":
            not cfg.sentence_head or names["sentence_classifier"] is not None,
    }  # fmt: skip
    broken = [rule for rule, ok in rules.items() if not ok]
    if broken:
        raise ValueError(f"the config has no HF {model_type} equivalent; it needs: " + "; ".join(broken))


def bert_config_from_hf(
    hf_config: Mapping[str, Any], *, pooler: bool | None = None, sentence_head: bool | None = None
) -> dict[str, Any]:
    """config.model fields of the "bert" family from an HF BERT/RoBERTa/ALBERT/DistilBERT config.json dict.

    pooler / sentence_head: whether the checkpoint has a pooler and an NSP/SOP head (config.json does
    not say). None takes the family's pretraining layout: BERT and ALBERT have both, RoBERTa and
    DistilBERT neither; sentence_head=None follows pooler. *ForMaskedLM checkpoints need pooler=False.
    """
    model_type = hf_config.get("model_type")
    if model_type not in _BERT_HF_KEYS:
        raise ValueError(f"HF config has model_type={model_type!r}; the bert converter reads {sorted(_BERT_HF_KEYS)}")
    keys = _BERT_HF_KEYS[model_type]
    missing = [key for key, default in keys.values() if default is None and key not in hf_config]
    if missing:
        raise ValueError(f"HF {model_type} config lacks {missing}")
    for key, supported in _BERT_FIXED_HF_OPTIONS[model_type].items():
        if hf_config.get(key, supported) != supported:
            raise ValueError(
                f"HF {model_type} config has {key}={hf_config[key]!r}; lmzoo's bert supports only {supported!r}"
            )
    hf_activation = hf_config.get(*keys["activation"])
    if hf_activation not in _ACTIVATION_FROM_HF:
        raise ValueError(
            f"HF activation {hf_activation!r} has no lmzoo equivalent; supported: {sorted(_ACTIVATION_FROM_HF)}"
        )
    # Each value takes the type of the BertConfig default (int, float).
    fields = {
        field: type(getattr(BertConfig, field))(hf_config.get(key, default)) for field, (key, default) in keys.items()
    }
    pooler = model_type in ("bert", "albert") if pooler is None else pooler
    fields |= {
        "embedding_dim": fields.get("embedding_dim", 0),
        "type_vocab_size": fields.get("type_vocab_size", 0),
        "position_offset": int(hf_config.get("pad_token_id", 1)) + 1 if model_type == "roberta" else 0,
        "share_layers": model_type == "albert",
        "pooler": pooler,
        "sentence_head": (pooler and model_type in ("bert", "albert")) if sentence_head is None else sentence_head,
        "activation": _ACTIVATION_FROM_HF[hf_activation],
        "layer_norm_epsilon": fields.get("layer_norm_epsilon", 1e-12),
    }
    _check_bert_family(make_config("bert", fields), model_type)
    return fields


def bert_config_to_hf(cfg: BertConfig, *, model_type: str) -> dict[str, Any]:
    """An HF `model_type` config.json dict for a "bert" config; "architectures" names the heads
    (*ForPreTraining with a sentence head, else *ForMaskedLM)."""
    _check_bert_family(cfg, model_type)
    if cfg.activation not in _ACTIVATION_TO_HF:
        raise ValueError(f"activation {cfg.activation!r} has no HF equivalent; supported: {sorted(_ACTIVATION_TO_HF)}")
    values = dataclasses.asdict(cfg) | {"embedding_dim": cfg.embed_dim, "activation": _ACTIVATION_TO_HF[cfg.activation]}
    head = "ForPreTraining" if cfg.sentence_head else "ForMaskedLM"
    hf_config = {"model_type": model_type, "architectures": [_BERT_CLASS_PREFIX[model_type] + head]}
    hf_config |= {key: values[field] for field, (key, _) in _BERT_HF_KEYS[model_type].items()}
    if model_type == "roberta":
        hf_config["pad_token_id"] = cfg.position_offset - 1
    return hf_config | _BERT_FIXED_HF_OPTIONS[model_type]


def _collect_tensors(
    state_dict: Mapping[str, Any], *, family: str, prefix: str, skip: Callable[[str], bool], tied: Mapping[str, str],
    tie_hint: str = "",
) -> tuple[dict[str, np.ndarray], list[str]]:  # fmt: skip
    """(float32 tensors by name without `prefix`, duplicate keys). Names `skip` accepts are dropped;
    each tied copy folds into its source after checking that both hold the same values."""
    tensors, duplicates = {}, []
    for key, value in state_dict.items():
        name = key.removeprefix(prefix)
        if skip(name):
            continue
        if name in tensors:
            duplicates.append(key)
        tensors[name] = np.array(value, dtype=np.float32)
    for copy, source in tied.items():
        if copy not in tensors:
            continue
        value = tensors.pop(copy)
        if source not in tensors:
            tensors[source] = value
        elif not np.array_equal(value, tensors[source]):
            hint = tie_hint if copy == "lm_head.weight" else ""
            raise ValueError(f"checkpoint has {copy} different from {source}; lmzoo's {family} ties them{hint}")
    return tensors, duplicates


def _bert_read(
    state_dict: Mapping[str, Any], model_type: str, entries: list[_Entry], optional: tuple[str, ...]
) -> tuple[dict[str, np.ndarray], list[_Entry]]:
    """(unprefixed float32 tensors, the entries the checkpoint has); groups in `optional` may be absent as
    a whole. Buffers are skipped and tied copies checked; one error lists unexpected and missing keys."""
    tensors, unexpected = _collect_tensors(
        state_dict, family="bert", prefix=f"{model_type}.", skip=_BERT_BUFFER.fullmatch, tied=_bert_tied(model_type)
    )
    absent = {group for group in optional if not any(entry.hf in tensors for entry in entries if entry.group == group)}
    present = [entry for entry in entries if entry.group not in absent]
    unexpected += sorted(set(tensors) - {entry.hf for entry in present})
    missing = [entry.hf for entry in present if entry.hf not in tensors]
    if unexpected or missing:
        raise ValueError(
            f"HF {model_type} state dict does not match the config: unexpected keys {unexpected}, missing keys "
            f"{missing} (names shown without the optional '{model_type}.' prefix; pooler and sentence_head of "
            "the config say whether the checkpoint has a pooler and an NSP/SOP head)"
        )
    misshapen = [
        f"{entry.hf}: {tensors[entry.hf].shape} (expected {entry.hf_shape})"
        for entry in present
        if tensors[entry.hf].shape != entry.hf_shape
    ]
    if misshapen:
        raise ValueError(f"HF {model_type} tensors with unexpected shapes: " + "; ".join(misshapen))
    return tensors, present


def _entry_to_hf(params: Params, entry: _Entry) -> np.ndarray:
    """The HF tensor of `entry` (float32, contiguous) from the lmzoo leaf at entry.path."""
    leaf = params
    for name in entry.path:
        leaf = leaf[name]
    tensor = np.asarray(leaf, dtype=np.float32).reshape(entry.hf_shape[::-1] if entry.transpose else entry.hf_shape)
    return np.ascontiguousarray(tensor.T if entry.transpose else tensor)


def _to_params(tensors: Mapping[str, np.ndarray], entries: list[_Entry]) -> Params:
    """Nested lmzoo params from the HF tensors of `entries`."""
    params: Params = {}
    for entry in entries:
        *parents, leaf = entry.path
        node = params
        for name in parents:
            node = node.setdefault(name, {})
        tensor = tensors[entry.hf]
        node[leaf] = (tensor.T if entry.transpose else tensor).reshape(entry.shape)
    return params


def bert_from_hf(state_dict: Mapping[str, np.ndarray], cfg: BertConfig, *, model_type: str) -> Params:
    """HF BERT/RoBERTa/ALBERT/DistilBERT state dict -> lmzoo "bert" params (per-layer or shared, float32 numpy).

    Reads *ForMaskedLM, *ForPreTraining (NSP `cls.seq_relationship`, SOP `sop_classifier`) and the bare
    *Model, with or without the `{model_type}.` prefix; cfg.pooler / cfg.sentence_head must say whether
    the checkpoint has a pooler / sentence head. Buffers are ignored; tied decoder copies must equal
    the word embeddings and MLM bias. A checkpoint without an MLM head (bare *Model) gives no
    mlm_dense / mlm_norm and mlm_bias zeros (its init value; `Bert.setup` declares it even for
    `encode`): the params then fit `encode` and task heads, and `load_pretrained` into an MLM model
    lists the missing head.
    """
    _check_bert_family(cfg, model_type)
    params = _to_params(*_bert_read(state_dict, model_type, _bert_entries(cfg, model_type), optional=("mlm",)))
    params.setdefault("mlm_bias", np.zeros(cfg.vocab_size, np.float32))
    return params


def classifier_from_hf(state_dict: Mapping[str, np.ndarray], cfg: BertConfig, *, model_type: str) -> Params:
    """HF *ForSequenceClassification state dict -> params of
    `heads.SequenceClassifier(Bert(cfg), num_labels, head=CLASSIFIER_HEADS[model_type])`.

    cfg.pooler must match the checkpoint (BERT, ALBERT: True; RoBERTa, DistilBERT: False); cfg.sentence_head
    is ignored. The backbone's mlm_bias is zeros, as in `bert_from_hf` for a bare model.
    """
    cfg = dataclasses.replace(cfg, sentence_head=False)
    _check_bert_family(cfg, model_type)
    modules = _CLASSIFIER_MODULES[model_type]
    out_weight = f"{modules['classifier']}.weight"
    num_labels = np.shape(state_dict[out_weight])[0] if out_weight in state_dict else 0
    entries = [entry for entry in _bert_entries(cfg, model_type) if entry.group != "mlm"]
    for name, module in modules.items():
        n_out = num_labels if name == "classifier" else cfg.emb_dim
        entries += _linear("classifier", module, (name,), cfg.emb_dim, n_out)
    tensors, entries = _bert_read(state_dict, model_type, entries, optional=())
    backbone = _to_params(tensors, [entry for entry in entries if entry.group != "classifier"])
    backbone["mlm_bias"] = np.zeros(cfg.vocab_size, np.float32)
    return {"backbone": backbone, **_to_params(tensors, [entry for entry in entries if entry.group == "classifier"])}


def bert_to_hf(params: Params, cfg: BertConfig, *, model_type: str) -> dict[str, np.ndarray]:
    """lmzoo "bert" params (per-layer, scanned or shared) -> HF state dict of float32 numpy arrays.

    With an MLM head (mlm_dense) the keys are those of *ForMaskedLM, or *ForPreTraining with a sentence
    head, tied decoder copies included; without one, those of the bare *Model (no prefix, no mlm_bias).
    """
    _check_bert_family(cfg, model_type)
    if "layers" in params["blocks"]:
        params = _unstack_layers(params)
    with_mlm = "mlm_dense" in params
    prefix = f"{model_type}." if with_mlm or cfg.sentence_head else ""
    keys, sd = {}, {}
    for entry in _bert_entries(cfg, model_type):
        if entry.group == "mlm" and not with_mlm:
            continue
        keys[entry.hf] = prefix + entry.hf if entry.group in ("encoder", "pooler") else entry.hf
        sd[keys[entry.hf]] = _entry_to_hf(params, entry)
    if with_mlm:
        for copy, source in _bert_tied(model_type).items():
            sd[copy] = sd[keys[source]].copy()
    return sd


# Encoder-decoders: HF T5 (v1.0, v1.1) and BART are two naming schemes of lmzoo's one "seq2seq" model.

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
    "positions": "relative", "pre_norm": True, "norm": "rms", "use_bias": False, "embedding_norm": False,
    "scale_embeddings": False, "final_logits_bias": False, "attention_scale": 1.0,
}  # fmt: skip
_BART_FIXED = {
    "positions": "learned", "position_offset": 2, "pre_norm": False, "norm": "layer", "use_bias": True,
    "embedding_norm": True, "tie_embeddings": True, "scale_tied_logits": False, "final_logits_bias": True,
    "attention_scale": 0.0, "layer_norm_epsilon": 1e-5,
}  # fmt: skip
# Gated MLPs (activation, "linear") -> HF T5 feed_forward_proj; HF reads "gated-gelu" as tanh GELU.
_T5_GATED_TO_HF = {"gelu_tanh": "gated-gelu", "relu": "gated-relu", "silu": "gated-silu"}
# model_type -> (prefix of the model body's keys in *ForConditionalGeneration, keys HF skips when loading).
_SEQ2SEQ_LAYOUT = {
    "t5": ("", {"decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"}),
    "bart": ("model.", {"encoder.version", "decoder.version"}),
}
_SEQ2SEQ_HEAD_KEYS = ("lm_head.weight", "final_logits_bias")  # BART keys outside the "model." body


def _t5_activations(feed_forward_proj: str) -> tuple[str, ...]:
    """HF T5 feed_forward_proj ("relu", "gated-gelu", ...) -> MLP activations of the "seq2seq" family."""
    *gate, name = feed_forward_proj.split("-")
    if feed_forward_proj == "gated-gelu":
        name = "gelu_new"  # HF's backward-compatible reading
    if gate not in ([], ["gated"]) or name not in _ACTIVATION_FROM_HF:
        raise ValueError(
            f"HF T5 feed_forward_proj {feed_forward_proj!r} has no lmzoo equivalent; use ACT or gated-ACT with ACT "
            f"one of {sorted(_ACTIVATION_FROM_HF)}"
        )
    return (_ACTIVATION_FROM_HF[name], "linear") if gate else (_ACTIVATION_FROM_HF[name],)


def _t5_feed_forward_proj(activations: tuple[str, ...]) -> str | None:
    """Inverse of `_t5_activations`; None when HF T5 cannot express the activations."""
    if len(activations) == 1:
        return _ACTIVATION_TO_HF.get(activations[0])
    if len(activations) == 2 and activations[1] == "linear":
        return _T5_GATED_TO_HF.get(activations[0])
    return None


def _check_seq2seq(cfg: Seq2SeqConfig, model_type: str) -> None:
    """Raises unless `cfg` describes a model that HF `model_type` ("t5" or "bart") can express."""
    fixed = {"t5": _T5_FIXED, "bart": _BART_FIXED}[model_type]
    broken = [f"{key}={value!r}" for key, value in fixed.items() if getattr(cfg, key) != value]
    if model_type == "t5":
        rules = {
            "tie_embeddings == scale_tied_logits (HF T5 scales the decoder output exactly when the head is tied)":
                cfg.tie_embeddings == cfg.scale_tied_logits,
            f"activations (ACT,) with ACT in {sorted(_ACTIVATION_TO_HF)} or (ACT, 'linear') with ACT in "
            f"{sorted(_T5_GATED_TO_HF)}": _t5_feed_forward_proj(cfg.activations) is not None,
        }  # fmt: skip
    else:
        rules = {
            "head_dim * num_heads == emb_dim": cfg.head_dim * cfg.num_heads == cfg.emb_dim,
            f"one activation in {sorted(_ACTIVATION_TO_HF)}":
                len(cfg.activations) == 1 and cfg.activations[0] in _ACTIVATION_TO_HF,
        }  # fmt: skip
    broken += [rule for rule, ok in rules.items() if not ok]
    if broken:
        raise ValueError(f"the config has no HF {model_type} equivalent; it needs: " + "; ".join(broken))


def _seq2seq_fields(
    hf_config: Mapping[str, Any], model_type: str, keys: Mapping[str, tuple[str, Any]]
) -> dict[str, Any]:
    """The fields of `keys` from an HF config dict (None values take the HF default), typed like Seq2SeqConfig."""
    if hf_config.get("model_type", model_type) != model_type:
        raise ValueError(f"HF config has model_type={hf_config['model_type']!r}; expected {model_type!r}")
    missing = [key for key, default in keys.values() if default is None and hf_config.get(key) is None]
    if missing:
        raise ValueError(f"HF {model_type} config lacks {missing}")
    fields = {}
    for field, (key, default) in keys.items():
        value = hf_config.get(key)
        fields[field] = type(getattr(Seq2SeqConfig, field))(default if value is None else value)
    return fields


def t5_config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.model fields of the "seq2seq" family from an HF T5 config.json dict.

    v1.0 (feed_forward_proj "relu") has a tied head on the decoder output scaled by d_model ** -0.5;
    v1.1 ("gated-gelu") an untied, unscaled head. transformers >= 5 always sets tie_word_embeddings and
    keeps the v1.0/v1.1 switch in scale_decoder_outputs, which is read first. HF T5 applies dropout_rate
    to attention probabilities too. The decoder starts from decoder_start_token_id, else pad_token_id.
    """
    fields = _seq2seq_fields(hf_config, "t5", _T5_HF_KEYS)
    tied = bool(hf_config.get("scale_decoder_outputs", hf_config.get("tie_word_embeddings", True)))
    decoder_layers = hf_config.get("num_decoder_layers")
    start = next(
        (hf_config[key] for key in ("decoder_start_token_id", "pad_token_id") if hf_config.get(key) is not None), 0
    )
    return fields | _T5_FIXED | {
        "num_decoder_layers": fields["num_encoder_layers"] if decoder_layers is None else int(decoder_layers),
        "activations": _t5_activations(hf_config.get("feed_forward_proj", "relu")),
        "attention_dropout_rate": fields["dropout_rate"],
        "tie_embeddings": tied,
        "scale_tied_logits": tied,
        "decoder_start_id": int(start),
    }


def t5_config_to_hf(cfg: Seq2SeqConfig) -> dict[str, Any]:
    """An HF T5 config.json dict for a "seq2seq" config (attention_dropout_rate is not kept: HF T5 applies
    dropout_rate to attention probabilities)."""
    _check_seq2seq(cfg, "t5")
    return {
        "model_type": "t5",
        "architectures": ["T5ForConditionalGeneration"],
        **{key: getattr(cfg, field) for field, (key, _) in _T5_HF_KEYS.items()},
        "num_decoder_layers": cfg.num_decoder_layers,
        "feed_forward_proj": _t5_feed_forward_proj(cfg.activations),
        "tie_word_embeddings": cfg.tie_embeddings,
        "decoder_start_token_id": cfg.decoder_start_id,
        "is_encoder_decoder": True,
    }


def bart_config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.model fields of the "seq2seq" family from an HF BART config.json dict.

    Encoder and decoder must agree on heads and FFN size, and the head must be tied. HF's
    activation_dropout and layerdrop (training only) have no lmzoo equivalent and are not read.
    """
    fields = _seq2seq_fields(hf_config, "bart", _BART_HF_KEYS | {"max_len": ("max_position_embeddings", None)})
    for key, same in (("decoder_attention_heads", "encoder_attention_heads"), ("decoder_ffn_dim", "encoder_ffn_dim")):
        if hf_config.get(key, hf_config[same]) != hf_config[same]:
            raise ValueError(
                f"HF bart config has {key}={hf_config[key]} != {same}={hf_config[same]}; lmzoo's seq2seq uses one value"
            )
    if not hf_config.get("tie_word_embeddings", True):
        raise ValueError("HF bart config has tie_word_embeddings=False; lmzoo reads BART with its head tied")
    activation = hf_config.get("activation_function", "gelu")
    if activation not in _ACTIVATION_FROM_HF:
        raise ValueError(
            f"HF activation {activation!r} has no lmzoo equivalent; supported: {sorted(_ACTIVATION_FROM_HF)}"
        )
    return fields | _BART_FIXED | {
        "head_dim": fields["emb_dim"] // fields["num_heads"],
        "max_len": fields["max_len"] + _BART_FIXED["position_offset"],  # HF adds the offset rows itself
        "activations": (_ACTIVATION_FROM_HF[activation],),
        "init_scheme": "normal",  # BART's std init_std (0.02) for every weight
    }


def bart_config_to_hf(cfg: Seq2SeqConfig) -> dict[str, Any]:
    """An HF BART config.json dict for a "seq2seq" config."""
    _check_seq2seq(cfg, "bart")
    return {
        "model_type": "bart",
        "architectures": ["BartForConditionalGeneration"],
        **{key: getattr(cfg, field) for field, (key, _) in _BART_HF_KEYS.items()},
        "decoder_attention_heads": cfg.num_heads,
        "decoder_ffn_dim": cfg.mlp_dim,
        "max_position_embeddings": cfg.max_len - cfg.position_offset,
        "activation_function": _ACTIVATION_TO_HF[cfg.activations[0]],
        "activation_dropout": 0.0,
        "tie_word_embeddings": True,
        "is_encoder_decoder": True,
    }


def _attention_entries(
    module: str, path: tuple[str, ...], cfg: Seq2SeqConfig, names: tuple[str, str, str, str]
) -> list[_Entry]:
    """The query, key, value and output nn.Linear (`names` within `module`) of one HF attention."""
    d, heads, bias = cfg.emb_dim, (cfg.num_heads, cfg.head_dim), cfg.use_bias
    n = cfg.num_heads * cfg.head_dim
    entries = []
    for name, hf_name in zip(("query", "key", "value"), names[:3], strict=True):
        entries += _linear("seq2seq", f"{module}.{hf_name}", (*path, name), d, n, out_shape=heads, bias=bias)
    return entries + _linear("seq2seq", f"{module}.{names[3]}", (*path, "out"), n, d, in_shape=heads, bias=bias)


def _t5_entries(cfg: Seq2SeqConfig) -> list[_Entry]:
    """Every tensor of HF T5ForConditionalGeneration for `cfg`, tied copies excluded."""
    d, f, v = cfg.emb_dim, cfg.mlp_dim, cfg.vocab_size
    wis = ("wi",) if len(cfg.activations) == 1 else ("wi_0", "wi_1")
    qkvo = ("q", "k", "v", "o")
    entries = [_Entry("seq2seq", "shared.weight", ("embed", "embedding"), (v, d), (v, d), False)]
    for stack, num_layers in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        relpos_shape = (cfg.relative_buckets, cfg.num_heads)
        relpos = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        entries.append(_Entry("seq2seq", relpos, (f"{stack}_relpos", "embedding"), relpos_shape, relpos_shape, False))
        for i in range(num_layers):
            prefix, path = f"{stack}.block.{i}.layer.", (stack, f"layer_{i}")
            entries += _attention_entries(prefix + "0.SelfAttention", (*path, "attn"), cfg, qkvo)
            entries += _norm("seq2seq", prefix + "0.layer_norm", (*path, "ln_attn"), d, bias=False)
            mlp = prefix + "1."
            if stack == "decoder":
                entries += _attention_entries(prefix + "1.EncDecAttention", (*path, "cross_attn"), cfg, qkvo)
                entries += _norm("seq2seq", prefix + "1.layer_norm", (*path, "ln_cross"), d, bias=False)
                mlp = prefix + "2."
            for wi in wis:
                entries += _linear("seq2seq", f"{mlp}DenseReluDense.{wi}", (*path, "mlp", wi), d, f, bias=False)
            entries += _linear("seq2seq", f"{mlp}DenseReluDense.wo", (*path, "mlp", "wo"), f, d, bias=False)
            entries += _norm("seq2seq", mlp + "layer_norm", (*path, "ln_mlp"), d, bias=False)
        entries += _norm("seq2seq", f"{stack}.final_layer_norm", (f"{stack}_final_norm",), d, bias=False)
    if not cfg.tie_embeddings:
        entries += _linear("seq2seq", "lm_head", ("lm_head",), d, v, bias=False)
    return entries


def _bart_entries(cfg: Seq2SeqConfig) -> list[_Entry]:
    """Every tensor of HF BartForConditionalGeneration for `cfg` (without the "model." prefix), tied copies excluded."""
    d, f, v = cfg.emb_dim, cfg.mlp_dim, cfg.vocab_size
    entries = [_Entry("seq2seq", "shared.weight", ("embed", "embedding"), (v, d), (v, d), False)]
    for stack, num_layers in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        positions = (cfg.max_len, d)
        table = f"{stack}.embed_positions.weight"
        entries.append(_Entry("seq2seq", table, (f"{stack}_positions", "embedding"), positions, positions, False))
        entries += _norm("seq2seq", f"{stack}.layernorm_embedding", (f"{stack}_embed_norm",), d)
        for i in range(num_layers):
            prefix, path = f"{stack}.layers.{i}.", (stack, f"layer_{i}")
            projections = ("q_proj", "k_proj", "v_proj", "out_proj")
            entries += _attention_entries(prefix + "self_attn", (*path, "attn"), cfg, projections)
            entries += _norm("seq2seq", prefix + "self_attn_layer_norm", (*path, "ln_attn"), d)
            if stack == "decoder":
                entries += _attention_entries(prefix + "encoder_attn", (*path, "cross_attn"), cfg, projections)
                entries += _norm("seq2seq", prefix + "encoder_attn_layer_norm", (*path, "ln_cross"), d)
            entries += _linear("seq2seq", prefix + "fc1", (*path, "mlp", "wi"), d, f)
            entries += _linear("seq2seq", prefix + "fc2", (*path, "mlp", "wo"), f, d)
            entries += _norm("seq2seq", prefix + "final_layer_norm", (*path, "ln_mlp"), d)
    return entries + [_Entry("seq2seq", "final_logits_bias", ("final_logits_bias",), (1, v), (v,), False)]


def _seq2seq_entries(cfg: Seq2SeqConfig, model_type: str) -> list[_Entry]:
    return _t5_entries(cfg) if model_type == "t5" else _bart_entries(cfg)


def _seq2seq_tied(cfg: Seq2SeqConfig) -> dict[str, str]:
    """HF copies (without prefix) -> the shared embedding they are tied to: embed_tokens, and lm_head when tied."""
    copies = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"] + ["lm_head.weight"] * cfg.tie_embeddings
    return dict.fromkeys(copies, "shared.weight")


def _seq2seq_read(state_dict: Mapping[str, Any], cfg: Seq2SeqConfig, model_type: str) -> dict[str, np.ndarray]:
    """Unprefixed float32 tensors of every entry; tied copies checked, keys HF skips ignored, one error lists
    unexpected and missing keys."""
    prefix, ignored = _SEQ2SEQ_LAYOUT[model_type]
    tensors, unexpected = _collect_tensors(
        state_dict, family="seq2seq", prefix=prefix, skip=ignored.__contains__, tied=_seq2seq_tied(cfg),
        tie_hint="; set tie_embeddings and scale_tied_logits False (T5 v1.1)",
    )  # fmt: skip
    if model_type == "bart":  # as in HF, a checkpoint without final_logits_bias (a bare BartModel) has zeros
        tensors.setdefault("final_logits_bias", np.zeros((1, cfg.vocab_size), np.float32))
    expected = {entry.hf: entry.hf_shape for entry in _seq2seq_entries(cfg, model_type)}
    unexpected += sorted(set(tensors) - set(expected))
    missing = [name for name in expected if name not in tensors]
    if unexpected or missing:
        raise ValueError(
            f"HF {model_type} state dict does not match the config: unexpected keys {unexpected}, missing keys "
            f"{missing}" + (f" (names shown without the optional '{prefix}' prefix)" if prefix else "")
        )
    misshapen = [
        f"{name}: {tensors[name].shape} (expected {shape})"
        for name, shape in expected.items()
        if tensors[name].shape != shape
    ]
    if misshapen:
        raise ValueError(f"HF {model_type} tensors with unexpected shapes: " + "; ".join(misshapen))
    return tensors


def _seq2seq_from_hf(state_dict: Mapping[str, Any], cfg: Seq2SeqConfig, model_type: str) -> Params:
    _check_seq2seq(cfg, model_type)
    return _to_params(_seq2seq_read(state_dict, cfg, model_type), _seq2seq_entries(cfg, model_type))


def _seq2seq_to_hf(params: Params, cfg: Seq2SeqConfig, model_type: str) -> dict[str, np.ndarray]:
    _check_seq2seq(cfg, model_type)
    for stack in ("encoder", "decoder"):
        if "layers" in params[stack]:
            params = _unstack_layers(params, stack)
    prefix = _SEQ2SEQ_LAYOUT[model_type][0]

    def key(name: str) -> str:
        return name if name in _SEQ2SEQ_HEAD_KEYS else prefix + name

    sd = {key(entry.hf): _entry_to_hf(params, entry) for entry in _seq2seq_entries(cfg, model_type)}
    for copy, source in _seq2seq_tied(cfg).items():
        sd[key(copy)] = sd[key(source)].copy()
    return sd


def t5_from_hf(state_dict: Mapping[str, np.ndarray], cfg: Seq2SeqConfig) -> Params:
    """HF T5ForConditionalGeneration (or T5Model with a tied head) state dict -> lmzoo "seq2seq" params
    (per-layer, float32 numpy). embed_tokens copies, and lm_head when cfg ties the head, must equal shared."""
    return _seq2seq_from_hf(state_dict, cfg, "t5")


def t5_to_hf(params: Params, cfg: Seq2SeqConfig) -> dict[str, np.ndarray]:
    """lmzoo "seq2seq" params (per-layer or scanned) -> HF T5ForConditionalGeneration state dict (float32
    numpy), tied copies included."""
    return _seq2seq_to_hf(params, cfg, "t5")


def bart_from_hf(state_dict: Mapping[str, np.ndarray], cfg: Seq2SeqConfig) -> Params:
    """HF BartForConditionalGeneration (or BartModel: no "model." prefix, final_logits_bias zeros) state dict
    -> lmzoo "seq2seq" params (per-layer, float32 numpy). Tied copies must equal model.shared."""
    return _seq2seq_from_hf(state_dict, cfg, "bart")


def bart_to_hf(params: Params, cfg: Seq2SeqConfig) -> dict[str, np.ndarray]:
    """lmzoo "seq2seq" params (per-layer or scanned) -> HF BartForConditionalGeneration state dict (float32
    numpy), tied copies included."""
    return _seq2seq_to_hf(params, cfg, "bart")


def _gpt2_checkpoint(
    hf_config: Mapping[str, Any], state_dict: Mapping[str, np.ndarray]
) -> tuple[dict[str, Any], Params]:
    fields = gpt2_config_from_hf(hf_config)
    return fields, gpt2_from_hf(state_dict, make_config("gpt2", fields))


def _bert_checkpoint(
    hf_config: Mapping[str, Any], state_dict: Mapping[str, np.ndarray]
) -> tuple[dict[str, Any], Params]:
    """Fields and params of any BERT-family checkpoint (by config.json model_type), pooler and NSP/SOP
    head as the checkpoint has them."""
    fields = bert_config_from_hf(hf_config)
    model_type = hf_config["model_type"]
    names = _BERT_MODULES[model_type]
    keys = {key.removeprefix(f"{model_type}.") for key in state_dict}
    modules = (names["pooler"], names["sentence_classifier"])
    pooler, sentence = (module is not None and f"{module}.weight" in keys for module in modules)
    fields |= {"pooler": pooler, "sentence_head": sentence}
    return fields, bert_from_hf(state_dict, make_config("bert", fields), model_type=model_type)


_SEQ2SEQ_FAMILIES = {"t5": (t5_config_from_hf, t5_from_hf), "bart": (bart_config_from_hf, bart_from_hf)}


def _seq2seq_checkpoint(
    hf_config: Mapping[str, Any], state_dict: Mapping[str, np.ndarray]
) -> tuple[dict[str, Any], Params]:
    """Fields and params of an HF T5 or BART checkpoint (by config.json model_type)."""
    model_type = hf_config.get("model_type")
    if model_type not in _SEQ2SEQ_FAMILIES:
        raise ValueError(
            f"HF config has model_type={model_type!r}; the seq2seq converter reads {sorted(_SEQ2SEQ_FAMILIES)}"
        )
    config_from_hf, from_hf = _SEQ2SEQ_FAMILIES[model_type]
    fields = config_from_hf(hf_config)
    return fields, from_hf(state_dict, make_config("seq2seq", fields))


# model_name -> (HF config.json dict, HF state dict) -> (config.model fields, params).
CONVERTERS: dict[str, Callable[[Mapping[str, Any], Mapping[str, np.ndarray]], tuple[dict[str, Any], Params]]] = {
    "gpt2": _gpt2_checkpoint,
    "bert": _bert_checkpoint,
    "seq2seq": _seq2seq_checkpoint,
}


def read_safetensors_dir(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config.json dict, state dict) of an HF checkpoint folder with single or sharded safetensors weights."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"HF checkpoint folder {folder} does not exist")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{config_file} not found; an HF checkpoint folder needs config.json next to the weights"
        )
    hf_config = json.loads(config_file.read_text())
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return hf_config, load_file(single)
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        state_dict = {}
        for shard in sorted(set(weight_map.values())):
            shard_file = folder / shard
            if not shard_file.is_file():
                raise FileNotFoundError(f"shard {shard_file} listed in {index} not found")
            state_dict |= load_file(shard_file)
        absent = sorted(set(weight_map) - set(state_dict))
        if absent:
            raise ValueError(f"tensors {absent} listed in {index} are not in their shards")
        return hf_config, state_dict
    pickled = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
    if pickled:
        raise ValueError(
            f"{folder} holds only pickled PyTorch weights ({', '.join(pickled)}); lmzoo refuses pickled checkpoints "
            "for safety (unpickling can run arbitrary code) and reads safetensors only. Convert once, in an "
            "environment you trust: `transformers.AutoModelForCausalLM.from_pretrained(dir)"
            ".save_pretrained(new_dir, safe_serialization=True)`, then load 'hf:new_dir'."
        )
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def _stack_layers(blocks: Mapping[str, Any]) -> Params:
    """{"layer_0": tree, ..., "layer_{L-1}": tree} -> {"layers": tree with a leading [L] axis} (nn.scan layout)."""
    layers = [blocks[f"layer_{i}"] for i in range(len(blocks))]

    def stack(*subtrees: Any) -> Any:
        if isinstance(subtrees[0], Mapping):
            return {key: stack(*(tree[key] for tree in subtrees)) for key in subtrees[0]}
        return np.stack(subtrees)

    return {"layers": stack(*layers)}


def _unstack_layers(params: Params, key: str = "blocks") -> Params:
    """Inverse of `_stack_layers` on params[key]."""
    stacked = params[key]["layers"]

    def take(tree: Any, i: int) -> Any:
        if isinstance(tree, Mapping):
            return {key: take(value, i) for key, value in tree.items()}
        return np.asarray(tree[i])

    num_layers = len(next(iter(_flatten(stacked).values())))
    return {**params, key: {f"layer_{i}": take(stacked, i) for i in range(num_layers)}}


def _is_per_layer(tree: Mapping[str, Any]) -> bool:
    """Whether `tree` is exactly {"layer_0": ..., ..., "layer_{L-1}": ...} (BlockStack without scan)."""
    return bool(tree) and set(tree) == {f"layer_{i}" for i in range(len(tree))}


def _to_layout(tree: Any, target: Any) -> Any:
    """`tree` with every per-layer subtree stacked where `target` holds the scanned `layers` subtree."""
    if not isinstance(tree, Mapping) or not isinstance(target, Mapping):
        return tree
    if set(target) == {"layers"} and _is_per_layer(tree):
        tree = _stack_layers(tree)
    return {key: _to_layout(value, target[key]) if key in target else value for key, value in tree.items()}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> {"a/b/c": leaf}."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat |= _flatten(value, f"{prefix}/{key}" if prefix else str(key))
    return flat


def _cast_like(tree: Any, target: Any) -> Any:
    """`tree` as numpy arrays with the dtypes of the matching `target` leaves."""
    if isinstance(tree, Mapping):
        return {key: _cast_like(value, target[key]) for key, value in tree.items()}
    return np.asarray(tree, dtype=target.dtype)


def _read_pretrained(spec: str, model_name: str) -> tuple[dict[str, Any], Params]:
    if not spec.startswith("hf:") or spec == "hf:":
        raise ValueError(
            f"unsupported pretrained spec {spec!r}; expected 'hf:PATH' (a folder with config.json and safetensors)"
        )
    if model_name not in CONVERTERS:
        raise ValueError(f"no HF converter for model_name {model_name!r}; available: {sorted(CONVERTERS)}")
    hf_config, state_dict = read_safetensors_dir(spec.removeprefix("hf:"))
    return CONVERTERS[model_name](hf_config, state_dict)


def convert_pretrained(spec: str, model_name: str, target_params: Any) -> Params:
    """Every parameter the checkpoint "hf:PATH" has, in the layer layout of `target_params` (unchecked:
    callers that take a subset, such as a classifier's backbone, compare shapes themselves)."""
    return _to_layout(_read_pretrained(spec, model_name)[1], nn.unbox(target_params))


def load_pretrained(spec: str, model_name: str, target_params: Any) -> Params:
    """Params of `model_name` from spec "hf:PATH", in the layout and dtypes of `target_params`.

    target_params: the configured model's unboxed parameter tree (arrays or ShapeDtypeStructs).
    Every parameter's shape must match; otherwise the error lists each mismatch and the config.model
    values that describe the checkpoint.
    """
    fields, params = _read_pretrained(spec, model_name)
    target_params = nn.unbox(target_params)
    params = _to_layout(params, target_params)
    got, want = _flatten(params), _flatten(target_params)
    problems = []
    for name in sorted(got.keys() | want.keys()):
        if name not in got:
            problems.append(f"  {name}: not in the checkpoint (model expects {tuple(want[name].shape)})")
        elif name not in want:
            problems.append(f"  {name}: checkpoint has {tuple(got[name].shape)}, model has no such parameter")
        elif tuple(got[name].shape) != tuple(want[name].shape):
            problems.append(f"  {name}: checkpoint {tuple(got[name].shape)} vs model {tuple(want[name].shape)}")
    if problems:
        suggestion = ", ".join(f"{key}: {value!r}" for key, value in fields.items())
        raise ValueError(
            f"checkpoint {spec!r} does not fit the configured {model_name} model:\n" + "\n".join(problems)
            + f"\nthe checkpoint's HF config corresponds to config.model = {{{suggestion}}}"
        )
    return _cast_like(params, target_params)
