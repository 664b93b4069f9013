"""HF BERT, RoBERTa, ALBERT and DistilBERT <-> lmzoo "bert": four naming schemes of one encoder.

Config translation (config.json <-> config.model) and the tensor table of each model_type. HF
nn.Linear weights are [out, in] and are transposed into Flax [in, out] kernels; query/key/value then
reshape to (D, N, H) and the attention output to (N, H, D). `classifier_from_hf` and `classifier_to_hf`
read and write the *ForSequenceClassification checkpoints.
"""

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from lmzoo.convert import mapping, tables
from lmzoo.convert.tables import Entry, Params
from lmzoo.models.bert import BertConfig

# config.model field -> (HF config.json key, HF class default; None = required).
_COMMON_KEYS = {
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
_HF_KEYS = {
    "bert": _COMMON_KEYS,
    "roberta": _COMMON_KEYS,
    "albert": _COMMON_KEYS
    | {
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
_ENCODER_OPTIONS = {"is_decoder": False, "add_cross_attention": False, "position_embedding_type": "absolute"}
# HF switches that lmzoo's encoder does not implement, with the only supported value.
_FIXED_HF_OPTIONS = {
    "bert": _ENCODER_OPTIONS | {"tie_word_embeddings": True},
    "roberta": _ENCODER_OPTIONS | {"tie_word_embeddings": True},
    "albert": {
        "num_hidden_groups": 1,
        "inner_group_num": 1,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
    },
    "distilbert": {"tie_word_embeddings": True},
}
_CLASS_PREFIX = {"bert": "Bert", "roberta": "Roberta", "albert": "Albert", "distilbert": "DistilBert"}
_MODULES_BERT = {
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
_MODULES = {
    "bert": _MODULES_BERT,
    "roberta": _MODULES_BERT
    | {
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
MODEL_TYPES = tuple(_MODULES)  # the config.json model_types this converter reads (`convert.hf.family_of`)
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
_BUFFER = re.compile(r"embeddings\.(position_ids|token_type_ids)")


def entries(cfg: BertConfig, model_type: str) -> list[Entry]:
    """Every tensor of the HF model of `cfg`: encoder, pooler and sentence head as cfg enables, MLM head."""
    names = _MODULES[model_type]
    h, e, f, v = cfg.emb_dim, cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size
    embeddings = {"word_embeddings": v, "position_embeddings": cfg.max_len}
    if cfg.type_vocab_size:
        embeddings["token_type_embeddings"] = cfg.type_vocab_size
    table = [
        entry for name, rows in embeddings.items() for entry in tables.table(f"embeddings.{name}", (name,), rows, e)
    ]
    table += tables.norm("embeddings.LayerNorm", ("ln_embed",), e)
    if cfg.embed_projection:
        table += tables.linear(names["embed_projection"], ("embed_projection",), e, h)
    blocks = {"shared": 0} if cfg.share_layers else {f"layer_{i}": i for i in range(cfg.num_layers)}
    heads = (cfg.num_heads, cfg.head_dim)
    for block, i in blocks.items():
        prefix, path = names["layer"].format(i=i), ("blocks", block)
        for qkv in ("query", "key", "value"):
            table += tables.linear(prefix + names[qkv], (*path, "attn", qkv), h, h, out_shape=heads)
        table += tables.linear(prefix + names["out"], (*path, "attn", "out"), h, h, in_shape=heads)
        table += tables.norm(prefix + names["ln_attn"], (*path, "ln_attn"), h)
        table += tables.linear(prefix + names["wi"], (*path, "mlp", "wi"), h, f)
        table += tables.linear(prefix + names["wo"], (*path, "mlp", "wo"), f, h)
        table += tables.norm(prefix + names["ln_mlp"], (*path, "ln_mlp"), h)
    if cfg.pooler:
        table += tables.linear(names["pooler"], ("pooler",), h, h, group="pooler")
    if cfg.sentence_head:
        head = names["sentence_classifier"]
        table += tables.linear(head, ("sentence_classifier",), h, 2, group="sentence_classifier")
    table += tables.linear(names["mlm_dense"], ("mlm_dense",), h, e, group="mlm")
    table += tables.norm(names["mlm_norm"], ("mlm_norm",), e, group="mlm")
    return table + [Entry(names["mlm_bias"], ("mlm_bias",), (v,), (v,), group="mlm")]


def _tied(model_type: str) -> dict[str, str]:
    """HF copies -> the tensor they are tied to: the MLM decoder's weight (word embeddings) and bias."""
    names = _MODULES[model_type]
    tied = {
        f"{names['decoder']}.weight": "embeddings.word_embeddings.weight",
        f"{names['decoder']}.bias": names["mlm_bias"],
    }
    return {copy: source for copy, source in tied.items() if copy != source}


def _check_family(cfg: BertConfig, model_type: str) -> None:
    """Raises unless `cfg` describes a model that HF `model_type` can express."""
    if model_type not in _MODULES:
        raise ValueError(f"model_type {model_type!r} is not a BERT-family HF model; supported: {sorted(_MODULES)}")
    names = _MODULES[model_type]
    rules = {
        "share_layers exactly for ALBERT (one shared layer)": cfg.share_layers == (model_type == "albert"),
        "embed_projection exactly for ALBERT (its E -> H projection always exists)": cfg.embed_projection
        == (model_type == "albert"),
        "type_vocab_size 0 exactly for DistilBERT": (cfg.type_vocab_size == 0) == (model_type == "distilbert"),
        "position_offset > 0 exactly for RoBERTa": (cfg.position_offset > 0) == (model_type == "roberta"),
        "activation 'gelu' for RoBERTa (its MLM head hard-codes exact GELU)": model_type != "roberta"
        or cfg.activation == "gelu",
        "layer_norm_epsilon 1e-12 for DistilBERT (hard-coded)": model_type != "distilbert"
        or cfg.layer_norm_epsilon == 1e-12,
        f"pooler False ({model_type} has none)": not cfg.pooler or names["pooler"] is not None,
        f"sentence_head False ({model_type} has no NSP/SOP head)": not cfg.sentence_head
        or names["sentence_classifier"] is not None,
    }
    broken = [rule for rule, ok in rules.items() if not ok]
    if broken:
        raise ValueError(f"the config has no HF {model_type} equivalent; it needs: " + "; ".join(broken))


def config_from_hf(
    hf_config: Mapping[str, Any], *, pooler: bool | None = None, sentence_head: bool | None = None
) -> dict[str, Any]:
    """config.model fields of the "bert" family from an HF BERT/RoBERTa/ALBERT/DistilBERT config.json dict.

    pooler / sentence_head: whether the checkpoint has a pooler and an NSP/SOP head (config.json does
    not say). None takes the family's pretraining layout: BERT and ALBERT have both, RoBERTa and
    DistilBERT neither; sentence_head=None follows pooler. *ForMaskedLM checkpoints need pooler=False.
    """
    model_type = hf_config.get("model_type")
    if model_type not in _HF_KEYS:
        raise tables.ConfigError(
            f"HF config has model_type={model_type!r}; the bert converter reads {sorted(_HF_KEYS)}"
        )
    keys = _HF_KEYS[model_type]
    missing = [key for key, default in keys.values() if default is None and key not in hf_config]
    if missing:
        raise tables.ConfigError(f"HF {model_type} config lacks {missing}")
    for key, supported in _FIXED_HF_OPTIONS[model_type].items():
        if hf_config.get(key, supported) != supported:
            raise tables.ConfigError(
                f"HF {model_type} config has {key}={hf_config[key]!r}; lmzoo's bert supports only {supported!r}"
            )
    hf_activation = hf_config.get(*keys["activation"])
    if hf_activation not in tables.ACTIVATION_FROM_HF:
        raise tables.ConfigError(
            f"HF activation {hf_activation!r} has no lmzoo equivalent; supported: {sorted(tables.ACTIVATION_FROM_HF)}"
        )
    # Each value takes the type of the BertConfig default (int, float).
    fields = {
        field: type(getattr(BertConfig, field))(hf_config.get(key, default)) for field, (key, default) in keys.items()
    }
    pooler = model_type in ("bert", "albert") if pooler is None else pooler
    embedding_dim = fields.get("embedding_dim", 0)
    fields |= {
        "embedding_dim": 0 if embedding_dim == fields["emb_dim"] else embedding_dim,  # 0: E = H
        "embed_projection": model_type == "albert",
        "type_vocab_size": fields.get("type_vocab_size", 0),
        "position_offset": int(hf_config.get("pad_token_id", 1)) + 1 if model_type == "roberta" else 0,
        "share_layers": model_type == "albert",
        "pooler": pooler,
        "sentence_head": (pooler and model_type in ("bert", "albert")) if sentence_head is None else sentence_head,
        "activation": tables.ACTIVATION_FROM_HF[hf_activation],
        "layer_norm_epsilon": fields.get("layer_norm_epsilon", 1e-12),
    }
    _check_family(tables.checkpoint_config("bert", fields), model_type)
    return fields


def config_to_hf(cfg: BertConfig, *, model_type: str) -> dict[str, Any]:
    """An HF `model_type` config.json dict for a "bert" config; "architectures" names the heads
    (*ForPreTraining with a sentence head, else *ForMaskedLM)."""
    _check_family(cfg, model_type)
    if cfg.activation not in tables.ACTIVATION_TO_HF:
        raise ValueError(
            f"activation {cfg.activation!r} has no HF equivalent; supported: {sorted(tables.ACTIVATION_TO_HF)}"
        )
    activation = tables.ACTIVATION_TO_HF[cfg.activation]
    values = dataclasses.asdict(cfg) | {"embedding_dim": cfg.embed_dim, "activation": activation}
    head = "ForPreTraining" if cfg.sentence_head else "ForMaskedLM"
    hf_config = {"model_type": model_type, "architectures": [_CLASS_PREFIX[model_type] + head]}
    hf_config |= {key: values[field] for field, (key, _) in _HF_KEYS[model_type].items()}
    if model_type == "roberta":
        hf_config["pad_token_id"] = cfg.position_offset - 1
    return hf_config | _FIXED_HF_OPTIONS[model_type]


def layout(model_type: str, *, heads: frozenset[str] = frozenset(), tied: bool = True) -> tables.Layout:
    """Naming around the entries; `heads`: the names outside the `{model_type}.` body; tied: fold the MLM
    decoder copies."""
    return tables.Layout(
        name=f"HF {model_type}",
        family="bert",
        prefix=f"{model_type}.",
        heads=heads,
        tied=_tied(model_type) if tied else {},
        skip=_BUFFER,
        note=f" (names shown without the optional '{model_type}.' prefix; pooler and sentence_head of "
        "the config say whether the checkpoint has a pooler and an NSP/SOP head)",
    )


def from_hf(state_dict: Mapping[str, Any], cfg: BertConfig, *, model_type: str) -> Params:
    """HF BERT/RoBERTa/ALBERT/DistilBERT state dict -> lmzoo "bert" params (per-layer or shared, float32 numpy).

    Reads *ForMaskedLM, *ForPreTraining (NSP `cls.seq_relationship`, SOP `sop_classifier`) and the bare
    *Model, with or without the `{model_type}.` prefix; cfg.pooler / cfg.sentence_head must say whether
    the checkpoint has a pooler / sentence head. Buffers are ignored; tied decoder copies must equal
    the word embeddings and MLM bias. A checkpoint without an MLM head (bare *Model) gives no
    mlm_dense / mlm_norm and mlm_bias zeros (its init value; `Bert.setup` declares it even for
    `encode`): the params then fit `encode` and task heads, and loading them into an MLM model
    reports the head as newly initialised.
    """
    return mapping.materialize(_sources(state_dict, cfg, model_type))


def _sources(state_dict: Mapping[str, Any], cfg: BertConfig, model_type: str) -> Params:
    _check_family(cfg, model_type)
    table = entries(cfg, model_type)
    params = tables.to_sources(*tables.read_hf(state_dict, layout(model_type), table, optional=("mlm",)))
    params.setdefault("mlm_bias", np.zeros(cfg.vocab_size, np.float32))
    return params


def classifier_from_hf(state_dict: Mapping[str, Any], cfg: BertConfig, *, model_type: str) -> Params:
    """HF *ForSequenceClassification state dict -> params of
    `heads.SequenceClassifier(Bert(cfg), num_labels, head=CLASSIFIER_HEADS[model_type])`.

    cfg.pooler must match the checkpoint (BERT, ALBERT: True; RoBERTa, DistilBERT: False); cfg.sentence_head
    is ignored. The backbone's mlm_bias is zeros, as in `from_hf` for a bare model.
    """
    cfg = dataclasses.replace(cfg, sentence_head=False)
    _check_family(cfg, model_type)
    out_weight = f"{_CLASSIFIER_MODULES[model_type]['classifier']}.weight"
    num_labels = np.shape(state_dict[out_weight])[0] if out_weight in state_dict else 0
    table = _classifier_entries(cfg, model_type, num_labels)
    tensors, table = tables.read_hf(state_dict, layout(model_type, tied=False), table)
    backbone = tables.to_sources(tensors, [entry for entry in table if entry.group != "classifier"])
    backbone["mlm_bias"] = np.zeros(cfg.vocab_size, np.float32)
    head = tables.to_sources(tensors, [entry for entry in table if entry.group == "classifier"])
    return mapping.materialize({"backbone": backbone, **head})


def _classifier_entries(cfg: BertConfig, model_type: str, num_labels: int) -> list[Entry]:
    """The tensors of HF *ForSequenceClassification: the encoder (no MLM or sentence head) and the classifier."""
    table = [entry for entry in entries(cfg, model_type) if entry.group != "mlm"]
    for name, module in _CLASSIFIER_MODULES[model_type].items():
        n_out = num_labels if name == "classifier" else cfg.emb_dim
        table += tables.linear(module, (name,), cfg.emb_dim, n_out, group="classifier")
    return table


def classifier_to_hf(
    params: Params, cfg: BertConfig, *, model_type: str
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Params of `heads.SequenceClassifier(Bert(cfg), num_labels, head=CLASSIFIER_HEADS[model_type])` -> (HF
    *ForSequenceClassification config.json dict without its labels, state dict of float32 numpy arrays)."""
    cfg = dataclasses.replace(cfg, sentence_head=False)
    hf_config = config_to_hf(cfg, model_type=model_type)
    hf_config["architectures"] = [_CLASS_PREFIX[model_type] + "ForSequenceClassification"]
    backbone = {key: value for key, value in params["backbone"].items() if key != "mlm_bias"}
    head = {name: params[name] for name in _CLASSIFIER_MODULES[model_type]}
    table = _classifier_entries(cfg, model_type, np.shape(params["classifier"]["kernel"])[-1])
    heads = frozenset(entry.hf for entry in table if entry.group == "classifier")
    return hf_config, tables.to_hf({**backbone, **head}, layout(model_type, heads=heads, tied=False), table)


def to_hf(params: Params, cfg: BertConfig, *, model_type: str) -> dict[str, np.ndarray]:
    """lmzoo "bert" params (per-layer, scanned or shared) -> HF state dict of float32 numpy arrays.

    With an MLM head (mlm_dense) the keys are those of *ForMaskedLM, or *ForPreTraining with a sentence
    head, tied decoder copies included; without one, those of the bare *Model (no prefix; the mlm_bias
    placeholder is not written).
    """
    _check_family(cfg, model_type)
    with_mlm = "mlm_dense" in params
    table = [entry for entry in entries(cfg, model_type) if with_mlm or entry.group != "mlm"]
    if not with_mlm:
        params = {key: value for key, value in params.items() if key != "mlm_bias"}
    heads = frozenset(entry.hf for entry in table if entry.group in ("mlm", "sentence_classifier"))
    naming = layout(model_type, heads=heads | set(_tied(model_type)), tied=with_mlm)
    return tables.to_hf(params, naming, table, prefixed=with_mlm or cfg.sentence_head)


def checkpoint_sources(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params as lazy leaves, read only when placed) of any BERT-family checkpoint
    (by config.json model_type), pooler and NSP/SOP head as the checkpoint has them."""
    fields = config_from_hf(hf_config)
    model_type = hf_config["model_type"]
    names = _MODULES[model_type]
    keys = {key.removeprefix(f"{model_type}.") for key in state_dict}
    modules = (names["pooler"], names["sentence_classifier"])
    pooler, sentence = (module is not None and f"{module}.weight" in keys for module in modules)
    fields |= {"pooler": pooler, "sentence_head": sentence}
    return fields, _sources(state_dict, tables.checkpoint_config("bert", fields), model_type)


def read_checkpoint(hf_config: Mapping[str, Any], state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], Params]:
    """(config.model fields, params: per-layer float32 numpy) of any BERT-family checkpoint."""
    fields, sources = checkpoint_sources(hf_config, state_dict)
    return fields, mapping.materialize(sources)
