"""HuggingFace PyTorch state dicts <-> lmzoo parameter trees; the only module that knows HF names.

Each family has a config map (HF config.json <-> config.model fields) and a weight map (HF state
dict <-> lmzoo parameter tree), registered in `CONVERTERS` for `load_pretrained("hf:PATH", ...)`.

Layouts: Flax kernels are [in, out]. HF GPT-2 uses `Conv1D`, whose weights are already [in, out]
and copy directly: c_attn [D, 3D] splits into query, key, value, each reshaped to (D, N, H), and
attn.c_proj [D, D] reshapes to (N, H, D). HF `nn.Linear` (BERT, T5, BART, ..., and GPT-2's untied
lm_head [V, D]) stores [out, in] and needs a transpose.

Weights are read only from safetensors files: pickled `pytorch_model.bin` checkpoints are refused,
because unpickling can run arbitrary code.
"""

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import numpy as np
from safetensors.numpy import load_file

from lmzoo.models import make_config
from lmzoo.models.gpt2 import GPT2Config

Params = dict[str, Any]

_GPT2_ACTIVATION_FROM_HF = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
}
_GPT2_ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
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
    if hf_activation not in _GPT2_ACTIVATION_FROM_HF:
        raise ValueError(
            f"HF activation_function {hf_activation!r} has no lmzoo equivalent; "
            f"supported: {sorted(_GPT2_ACTIVATION_FROM_HF)}"
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
        "activation": _GPT2_ACTIVATION_FROM_HF[hf_activation],
        "layer_norm_epsilon": float(hf_config.get("layer_norm_epsilon", 1e-5)),
    }


def gpt2_config_to_hf(cfg: GPT2Config) -> dict[str, Any]:
    """An HF GPT-2 config.json dict for a "gpt2" config (pre-norm only: HF has no post-norm GPT)."""
    if not cfg.pre_norm:
        raise ValueError("HF GPT-2 is pre-norm; a pre_norm=False (original GPT) model has no HF GPT-2 equivalent")
    if cfg.activation not in _GPT2_ACTIVATION_TO_HF:
        raise ValueError(
            f"activation {cfg.activation!r} has no HF GPT-2 equivalent; supported: {sorted(_GPT2_ACTIVATION_TO_HF)}"
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
        "activation_function": _GPT2_ACTIVATION_TO_HF[cfg.activation],
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


# model_name -> (HF config.json dict -> config.model fields, (HF state dict, config) -> params).
CONVERTERS: dict[str, tuple[Callable[..., dict[str, Any]], Callable[..., Params]]] = {
    "gpt2": (gpt2_config_from_hf, gpt2_from_hf),
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


def _unstack_layers(params: Params) -> Params:
    """Inverse of `_stack_layers` on params["blocks"]."""
    stacked = params["blocks"]["layers"]

    def take(tree: Any, i: int) -> Any:
        if isinstance(tree, Mapping):
            return {key: take(value, i) for key, value in tree.items()}
        return np.asarray(tree[i])

    num_layers = len(next(iter(_flatten(stacked).values())))
    return {**params, "blocks": {f"layer_{i}": take(stacked, i) for i in range(num_layers)}}


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


def load_pretrained(spec: str, model_name: str, target_params: Any) -> Params:
    """Params of `model_name` from spec "hf:PATH", in the layout and dtypes of `target_params`.

    target_params: the configured model's unboxed parameter tree (arrays or ShapeDtypeStructs).
    Every parameter's shape must match; otherwise the error lists each mismatch and the config.model
    values that describe the checkpoint.
    """
    if not spec.startswith("hf:") or spec == "hf:":
        raise ValueError(
            f"unsupported pretrained spec {spec!r}; expected 'hf:PATH' (a folder with config.json and safetensors)"
        )
    if model_name not in CONVERTERS:
        raise ValueError(f"no HF converter for model_name {model_name!r}; available: {sorted(CONVERTERS)}")
    config_from_hf, from_hf = CONVERTERS[model_name]
    hf_config, state_dict = read_safetensors_dir(spec.removeprefix("hf:"))
    fields = config_from_hf(hf_config)
    target_params = nn.unbox(target_params)
    params = _to_layout(from_hf(state_dict, make_config(model_name, fields)), target_params)
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
