"""PEFT's LoRA adapter folders (adapter_config.json + adapter_model.safetensors) <-> lmzoo adapters
(`lmzoo.lora`), for the families whose HF names `lmzoo.convert` tables: llama (Llama, Mistral, Qwen2).

PEFT keeps, per adapted nn.Linear of the HF model, lora_A [r, in] and lora_B [out, r] under
"base_model.model.<module>.lora_{A,B}.weight", and adds scale * lora_B @ lora_A to the weight [out, in]. lmzoo's
adapters are the transposes, reshaped to the kernel's axes: A [*inputs, r], B [r, *outputs] (q_proj: A [D, r],
B [r, N, H]; o_proj: A [N, H, r], B [r, D]). Which lmzoo kernel each HF module is comes from the family's tensor
table (`llama.entries`), so the names live in one place. Only plain LoRA is read: DoRA, LoRA biases, PEFT's
modules_to_save and per-module ranks or alphas are refused by name.
"""

import json
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from lmzoo import storage
from lmzoo.convert import llama, mapping
from lmzoo.lora import transform
from lmzoo.models import make_config

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel wraps the base model as .base_model.model
FAMILIES = {"llama": llama}  # model_name -> converter with entries(cfg) and layout(cfg)
# adapter_config.json fields that change what an adapter computes, with the value plain LoRA has; any other value is
# refused. Absent fields (older PEFT versions) count as plain.
PLAIN = {
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "target_parameters": None,
    "layer_replication": None,
    "trainable_token_indices": None,
    "use_qalora": False,
    "alora_invocation_tokens": None,
}
_TENSOR = re.compile(r"(.+)\.lora_([AB])\.weight")


class Linear(NamedTuple):
    """One HF nn.Linear an adapter may target: its module key in the model ("model.layers.0.self_attn.q_proj"), its
    sizes, and the lmzoo kernel's shape [*inputs, *outputs] with `inputs` axes of inputs."""

    key: str
    n_in: int
    n_out: int
    shape: tuple[int, ...]
    inputs: int


def _family(model_name: str, model_fields: Any) -> tuple[Any, Any]:
    if model_name not in FAMILIES:
        raise ValueError(
            f"PEFT adapters are read and written for {sorted(FAMILIES)} (HF Llama, Mistral, Qwen2); model_name "
            f"{model_name!r} has none: merge its adapters (lmzoo.lora.merge) and export the merged params"
        )
    cfg = model_fields if hasattr(model_fields, "__dataclass_fields__") else make_config(model_name, model_fields)
    return FAMILIES[model_name], cfg


def linears(model_name: str, model_fields: Any) -> dict[tuple[str, ...], Linear]:
    """{lmzoo module path (per-layer): Linear} of every nn.Linear in the family's tensor table for this config."""
    converter, cfg = _family(model_name, model_fields)
    layout = converter.layout(cfg)
    found = {}
    for entry in converter.entries(cfg):
        if not (entry.transpose and entry.path[-1] == "kernel" and entry.hf.endswith(".weight")):
            continue
        module = entry.hf.removesuffix(".weight")
        n_out, n_in = entry.hf_shape
        inputs = next(k for k in range(1, len(entry.shape)) if math.prod(entry.shape[:k]) == n_in)
        key = module if entry.hf in layout.heads else layout.prefix + module
        found[entry.path[:-1]] = Linear(key, n_in, n_out, tuple(entry.shape), inputs)
    return found


def _target_modules(adapted: list[tuple[str, ...]], table: Mapping[tuple[str, ...], Linear]) -> list[str]:
    """PEFT's target_modules: the modules' short names ("q_proj") when every module of each name is adapted, else
    their full keys (PEFT matches a list entry against a module key or its dotted suffix)."""
    names = {table[module].key.rsplit(".", 1)[-1] for module in adapted}
    every = [module for module, linear in table.items() if linear.key.rsplit(".", 1)[-1] in names]
    if sorted(every) == sorted(adapted):
        return sorted(names)
    return sorted(table[module].key for module in adapted)


def save_peft(
    out_dir: str,
    adapters: Any,
    config: transform.LoraConfig,
    model_name: str,
    model_fields: Any,
    *,
    base_model_name_or_path: str | None = None,
) -> dict[str, Any]:
    """Writes `adapters` (per-layer or scanned, boxed or not) as a PEFT LoRA folder that
    `peft.PeftModel.from_pretrained(hf_model, out_dir)` loads onto the HF export of the base; tensors in float32.
    Returns {"path", "tensors", "target_modules"}."""
    from safetensors.numpy import save as safetensors_bytes

    full = transform.trained_in_full(adapters)
    if full:
        raise ValueError(
            f"these adapters come with modules trained in full ({', '.join('/'.join(p) for p in list(full)[:4])}), "
            "which have no HF counterpart in a PEFT adapter folder of this family; export the merged model instead"
        )
    table = linears(model_name, model_fields)
    pairs = transform.adapter_pairs(mapping.unstack_layers(jax.device_get(nn.unbox(adapters))))
    tensors, problems = {}, []
    for module, (a, b) in pairs.items():
        where = "/".join(module)
        if module not in table:
            problems.append(f"{where}: not a linear of the HF model (PEFT can name: {_short_names(table)})")
            continue
        linear, r = table[module], a.shape[-1]
        if tuple(a.shape[:-1]) + tuple(b.shape[1:]) != linear.shape or b.shape[0] != r:
            problems.append(f"{where}: kernel {linear.shape}, adapters {tuple(a.shape)} and {tuple(b.shape)}")
            continue
        if r != config.rank:
            problems.append(f"{where}: rank {r}, config.rank {config.rank}")
            continue
        tensors[f"{PREFIX}{linear.key}.lora_A.weight"] = np.asarray(a, np.float32).reshape(linear.n_in, r).T
        tensors[f"{PREFIX}{linear.key}.lora_B.weight"] = np.asarray(b, np.float32).reshape(r, linear.n_out).T
    if problems:
        raise ValueError(f"cannot write these adapters as PEFT's for {model_name}: " + "; ".join(problems))
    targets = _target_modules(list(pairs), table)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.rank,
        "lora_alpha": int(config.alpha) if float(config.alpha).is_integer() else config.alpha,
        "lora_dropout": config.dropout,
        "use_rslora": config.rslora,
        "target_modules": targets,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
        **PLAIN,
    }
    out = storage.path(out_dir)
    storage.write_text(out / CONFIG_FILE, json.dumps(adapter_config, indent=2) + "\n")
    contiguous = {name: np.ascontiguousarray(t) for name, t in sorted(tensors.items())}
    storage.write_bytes(out / WEIGHTS_FILE, safetensors_bytes(contiguous, metadata={"format": "pt"}))
    return {"path": str(out), "tensors": len(tensors), "target_modules": targets}


def _short_names(table: Mapping[tuple[str, ...], Linear]) -> str:
    return ", ".join(dict.fromkeys(linear.key.rsplit(".", 1)[-1] for linear in table.values()))


def _read_config(folder: Any) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not storage.exists(file):
        raise FileNotFoundError(f"{file} not found; a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        adapter_config = json.loads(storage.read_text(file))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    if adapter_config.get("peft_type") != "LORA":
        raise ValueError(f"{file} has peft_type {adapter_config.get('peft_type')!r}; lmzoo reads 'LORA' adapters")
    unsupported = [
        f"{field}={adapter_config[field]!r}"
        for field, plain in PLAIN.items()
        if adapter_config.get(field, plain) not in (plain, None, False, {}, [], "none")
    ]
    if unsupported:
        raise ValueError(
            f"{file} has {', '.join(unsupported)}; lmzoo reads plain LoRA adapters (one rank and alpha for every "
            "module, no DoRA, biases or fully trained modules)"
        )
    return adapter_config


def _read_weights(folder: Any) -> dict[str, np.ndarray]:
    from safetensors.flax import load as safetensors_load

    file = folder / WEIGHTS_FILE
    if not storage.exists(file):
        pickled = folder / "adapter_model.bin"
        if storage.exists(pickled):
            raise ValueError(
                f"{folder} holds only pickled PyTorch weights (adapter_model.bin); lmzoo reads safetensors only "
                "(unpickling can run arbitrary code): save the adapter again with safe_serialization=True"
            )
        raise FileNotFoundError(f"{file} not found")
    return {name: np.asarray(value, np.float32) for name, value in safetensors_load(storage.read_bytes(file)).items()}


def load_peft(folder: str, params: Any, model_name: str, model_fields: Any) -> tuple[Any, transform.LoraConfig]:
    """(adapters, LoraConfig) of a PEFT LoRA folder for the model of `params` (its layer layout: per-layer or
    scanned), as float32 numpy arrays; `transform.merge(params, adapters, config)` applies them.

    An adapter of another base (a module the model lacks, a tensor of another shape) is a ValueError naming every
    such tensor, its shape and the model's."""
    root = storage.path(folder)
    adapter_config = _read_config(root)
    tensors = _read_weights(root)
    table = linears(model_name, model_fields)
    by_key = {linear.key: module for module, linear in table.items()}
    r = int(adapter_config["r"])
    found: dict[tuple[str, ...], dict[str, np.ndarray]] = {}
    problems = []
    for name, tensor in tensors.items():
        match = _TENSOR.fullmatch(name.removeprefix(PREFIX))
        if not name.startswith(PREFIX) or match is None:
            problems.append(f"{name}: not a LoRA weight of a linear layer (lmzoo reads lora_A / lora_B)")
            continue
        key, which = match.groups()
        if key not in by_key:
            problems.append(f"{name}: the model has no linear {key}")
            continue
        linear = table[by_key[key]]
        want = (r, linear.n_in) if which == "A" else (linear.n_out, r)
        if tuple(tensor.shape) != want:
            problems.append(f"{name}: adapter {tuple(tensor.shape)}, model expects {want}")
            continue
        found.setdefault(by_key[key], {})[which] = tensor
    problems += [
        f"{PREFIX}{table[module].key}.lora_{'B' if 'A' in pair else 'A'}.weight: missing"
        for module, pair in found.items()
        if len(pair) == 1
    ]
    if problems:
        raise ValueError(
            f"PEFT adapter {folder} does not fit the configured {model_name} model (an adapter of another base model, "
            f"or of another config.model; r={r}): " + "; ".join(problems)
        )
    if not found:
        raise ValueError(f"PEFT adapter {folder} holds no LoRA weights")
    shaped = {}
    for module, pair in found.items():
        linear = table[module]
        a = pair["A"].T.reshape(*linear.shape[: linear.inputs], r)
        b = pair["B"].T.reshape(r, *linear.shape[linear.inputs :])
        shaped[(*module, transform.LORA_A)], shaped[(*module, transform.LORA_B)] = a, b
    adapters = _in_layout(traverse_util.unflatten_dict(shaped), nn.unbox(params), folder)
    config = transform.LoraConfig(
        targets=_targets(list(found), table),
        rank=r,
        alpha=float(adapter_config.get("lora_alpha", 8)),
        dropout=float(adapter_config.get("lora_dropout") or 0.0),
        rslora=bool(adapter_config.get("use_rslora", False)),
    )
    jax.eval_shape(lambda p, a: transform.merge(p, a, config), nn.unbox(params), adapters)  # against the params
    return adapters, config


def _targets(adapted: list[tuple[str, ...]], table: Mapping[tuple[str, ...], Linear]) -> str:
    """LoraConfig.targets for the adapted modules: their names when every module of each name is adapted, else
    their paths."""
    names = {module[-1] for module in adapted}
    if sorted(module for module in table if module[-1] in names) == sorted(adapted):
        return "|".join(sorted(names))
    return "|".join(re.escape("/".join(module)) for module in sorted(adapted))


def _in_layout(adapters: Any, params: Any, folder: str) -> Any:
    """Per-layer adapters stacked where `params` scan their layers; a scanned stack needs the same modules adapted
    in every layer."""
    scanned = [leaf for path, leaf in traverse_util.flatten_dict(params).items() if "layers" in path]
    if not scanned:
        return adapters
    per_layer: dict[str, set] = {}
    for path in traverse_util.flatten_dict(adapters):
        layer = next((part for part in path if re.fullmatch(r"layer_\d+", part)), None)
        if layer is not None:
            per_layer.setdefault(layer, set()).add(tuple(part for part in path if part != layer))
    num_layers = scanned[0].shape[0]
    if per_layer and (len(per_layer) != num_layers or len({frozenset(m) for m in per_layer.values()}) > 1):
        raise ValueError(
            f"PEFT adapter {folder} does not adapt the same modules in each of the {num_layers} layers; the model "
            "scans its layers (scan_layers=True), whose adapters are one stack: load it into a per-layer model "
            "(scan_layers=False)"
        )
    return mapping.materialize(mapping.to_layout(adapters, params))
