"""PEFT's LoRA adapter folders (adapter_config.json + adapter_model.safetensors) <-> lmzoo adapters
(`lmzoo.lora`), for the families whose HF names `lmzoo.convert` tables: llama (Llama, Mistral, Qwen2, Qwen3, Gemma 3,
the MoE options' attention and shared experts, gpt-oss's attention), deepseek (DeepSeek-V3's MLA projections, dense
MLP and shared experts) and qwen3_5 (Qwen3.5's gated attention, Gated DeltaNet projections and MLPs).

PEFT keeps, per adapted nn.Linear of the HF model, lora_A [r, in] and lora_B [out, r] under
"base_model.model.<module>.lora_{A,B}.weight", and adds scale * lora_B @ lora_A to the weight [out, in]. lmzoo's
adapters are the transposes, reshaped to the kernel's axes: A [*inputs, r], B [r, *outputs] (q_proj: A [D, r],
B [r, N, H]; o_proj: A [N, H, r], B [r, D]). Which lmzoo kernel each HF module is comes from the family's tensor
table (`entries`), so the names live in one place. An HF linear that lmzoo holds as several kernels (Qwen3.5's q_proj:
query and gate; in_proj_qkv: query, key and value; `qwen3_5.fused_parts`) gives each of them PEFT's lora_A and its
columns of lora_B; written back, the kernels must share one A (or be adapted alone: the others' rows of lora_B are
zero).

Refused by name, with "merge and export instead": routers and experts, which transformers 5 holds as a TopKRouter's
weight and fused parameter tensors, no nn.Linear that PEFT's target_modules can adapt; an nn.Linear to one output
(a shared expert's gate), a vector [D] in lmzoo that its LoRA does not adapt; and, on writing only, the MLP linears
that PEFT (0.21, on transformers 5) retargets to the experts' tensors for some MoE model types (`PEFT_RETARGETS`), so
that PeftModel.from_pretrained would drop them. Only plain LoRA is read: DoRA, LoRA biases, PEFT's modules_to_save,
target_parameters and per-module ranks or alphas are refused by name.
"""

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from lmzoo import storage
from lmzoo.convert import deepseek, llama, mapping, qwen3_5
from lmzoo.lora import transform
from lmzoo.models import make_config

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel wraps the base model as .base_model.model
# model_name -> converter with entries(cfg) and layout(cfg) (and fused_parts(cfg) where one HF linear is several
# lmzoo kernels)
FAMILIES = {"llama": llama, "deepseek": deepseek, "qwen3_5": qwen3_5}
HF_NAMES = "HF Llama, Mistral, Qwen2, Qwen3, Gemma 3, gpt-oss, DeepSeek-V3, Qwen3.5"
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
# Model types whose MLP linears' names PEFT (0.21, on transformers >= 5) retargets to the fused experts' parameters
# when it makes or loads an adapter (`peft.utils.transformers_weight_conversion`): adapters of a dense MLP or a shared
# expert written under these names would not be loaded back by PeftModel.from_pretrained.
PEFT_RETARGETS = {
    model_type: ("gate_proj", "up_proj", "down_proj") for model_type in ("deepseek_v3", "qwen3_moe", "qwen2_moe")
}
_TENSOR = re.compile(r"(.+)\.lora_([AB])\.weight")


class Linear(NamedTuple):
    """One HF nn.Linear an adapter may target, as one lmzoo kernel sees it: its module key in the model
    ("model.layers.0.self_attn.q_proj"), its sizes, and the lmzoo kernel's shape [*inputs, *outputs] with `inputs` axes
    of inputs. A kernel that is one part of the HF linear's outputs (`fused_parts`) has `part` = (start, stop), the
    columns of the last axis of the fused kernel's outputs `fused` it takes."""

    key: str
    n_in: int
    n_out: int
    shape: tuple[int, ...]
    inputs: int
    part: tuple[int, int] | None = None
    fused: tuple[int, ...] = ()

    def lmzoo_b(self, b: np.ndarray) -> np.ndarray:
        """PEFT's lora_B [out, r] -> this kernel's B [r, *outputs]."""
        r = b.shape[-1]
        if self.part is None:
            return b.T.reshape(r, *self.shape[self.inputs :])
        return b.T.reshape(r, *self.fused)[..., slice(*self.part)].reshape(r, *self.shape[self.inputs :])


def _family(model_name: str, model_fields: Any) -> tuple[Any, Any]:
    if model_name not in FAMILIES:
        raise ValueError(
            f"PEFT adapters are read and written for {sorted(FAMILIES)} ({HF_NAMES}); model_name {model_name!r} has "
            "none: merge its adapters (lmzoo.lora.merge) and export the merged params"
        )
    cfg = model_fields if hasattr(model_fields, "__dataclass_fields__") else make_config(model_name, model_fields)
    return FAMILIES[model_name], cfg


def _not_linear(entry: Any) -> tuple[str, str] | None:
    """(HF module, why) of a table entry that has no PEFT adapter in lmzoo: a router (the weight of a TopKRouter) or
    an experts' tensor (fused in transformers 5, however checkpoints store them), which are no nn.Linear, or an
    nn.Linear to one output that lmzoo holds as a vector [D] (a shared expert's gate), which lmzoo's LoRA does not
    adapt; None for any other entry."""
    if ".experts." in entry.hf:
        module = entry.hf[: entry.hf.index(".experts.") + len(".experts")]
        return module, "experts are fused parameter tensors, not an nn.Linear, and cannot be adapted by PEFT"
    if entry.path[-2:] == ("router", "kernel"):
        return entry.hf.removesuffix(".weight"), "a TopKRouter's weight, not an nn.Linear, cannot be adapted by PEFT"
    if entry.transpose and entry.path[-1] == "kernel" and len(entry.shape) == 1:
        return entry.hf.removesuffix(
            ".weight"
        ), "an nn.Linear to one output, a vector [D] in lmzoo: lmzoo's LoRA does not adapt it"
    return None


def _inputs(shape: tuple[int, ...], n_in: int) -> int:
    """How many leading axes of a kernel `shape` are its n_in inputs."""
    return next(k for k in range(1, len(shape) + 1) if math.prod(shape[:k]) == n_in)


def _tables(model_name: str, model_fields: Any) -> tuple[dict, dict, dict]:
    """(`linears`, {lmzoo module path: (HF module key, why)} of what has no PEFT adapter (`_not_linear`),
    {lmzoo module path: model type} of the linears PEFT retargets to the experts: `PEFT_RETARGETS`)."""
    converter, cfg = _family(model_name, model_fields)
    layout = converter.layout(cfg)
    model_type = converter.hf_model_type(cfg) if hasattr(converter, "hf_model_type") else converter.MODEL_TYPE
    fused = converter.fused_parts(cfg) if hasattr(converter, "fused_parts") else {}
    found, refused, retargeted = {}, {}, {}
    for entry in converter.entries(cfg):
        other = _not_linear(entry)
        if other is not None:
            module = entry.path[:-1] if entry.path[-1] == "kernel" or entry.path[-1].isdigit() else entry.path
            refused[module] = (layout.prefix + other[0], other[1])
            continue
        if not (
            entry.transpose and entry.hf.endswith(".weight") and (entry.path[-1] == "kernel" or entry.path in fused)
        ):
            continue
        module = entry.hf.removesuffix(".weight")
        key = module if entry.hf in layout.heads else layout.prefix + module
        n_out, n_in = entry.hf_shape
        inputs = _inputs(entry.shape, n_in)
        if entry.path in fused:
            for path, start, stop, shape in fused[entry.path]:
                part = (start, stop)
                found[path[:-1]] = Linear(key, n_in, n_out, shape, _inputs(shape, n_in), part, entry.shape[inputs:])
        else:
            found[entry.path[:-1]] = Linear(key, n_in, n_out, tuple(entry.shape), inputs)
        if module.rsplit(".", 1)[-1] in PEFT_RETARGETS.get(model_type, ()):
            retargeted[entry.path[:-1]] = model_type
    return found, refused, retargeted


def linears(model_name: str, model_fields: Any) -> dict[tuple[str, ...], Linear]:
    """{lmzoo module path (per-layer): Linear} of every kernel of an HF nn.Linear in the family's tensor table for
    this config (several kernels may share one HF linear: `fused_parts`)."""
    return _tables(model_name, model_fields)[0]


def _not_adaptable(where: str, hf_module: str, why: str) -> str:
    return (
        f"{where}: HF's {hf_module} ({why}): merge the adapters (lmzoo.lora.merge) and export the merged model instead"
    )


def _target_modules(adapted: list[tuple[str, ...]], table: Mapping[tuple[str, ...], Linear]) -> list[str]:
    """PEFT's target_modules: the modules' short names ("q_proj") when every module of each name is adapted, else
    their full keys (PEFT matches a list entry against a module key or its dotted suffix)."""
    keys = {table[module].key for module in adapted}
    names = {key.rsplit(".", 1)[-1] for key in keys}
    if {linear.key for linear in table.values() if linear.key.rsplit(".", 1)[-1] in names} == keys:
        return sorted(names)
    return sorted(keys)


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
    table, refused, retargeted = _tables(model_name, model_fields)
    pairs = transform.adapter_pairs(mapping.unstack_layers(jax.device_get(nn.unbox(adapters))))
    by_key: dict[str, list[tuple[tuple[str, ...], np.ndarray, np.ndarray]]] = {}
    problems = []
    for module, (a, b) in pairs.items():
        where = "/".join(module)
        if module in refused:
            problems.append(_not_adaptable(where, *refused[module]))
            continue
        if module not in table:
            problems.append(f"{where}: not a linear of the HF model (PEFT can name: {_short_names(table)})")
            continue
        if module in retargeted:
            problems.append(
                f"{where}: PEFT (0.21, on transformers 5) retargets {table[module].key.rsplit('.', 1)[-1]} of a "
                f"{retargeted[module]} model to its experts' fused tensors, so PeftModel.from_pretrained would not load "
                f"this adapter of {table[module].key}: merge the adapters (lmzoo.lora.merge) and export the merged model"
            )
            continue
        linear, r = table[module], a.shape[-1]
        if tuple(a.shape[:-1]) + tuple(b.shape[1:]) != linear.shape or b.shape[0] != r:
            problems.append(f"{where}: kernel {linear.shape}, adapters {tuple(a.shape)} and {tuple(b.shape)}")
            continue
        if r != config.rank:
            problems.append(f"{where}: rank {r}, config.rank {config.rank}")
            continue
        by_key.setdefault(linear.key, []).append((module, np.asarray(a, np.float32), np.asarray(b, np.float32)))
    tensors = {}
    for key, parts in by_key.items():
        r, first = config.rank, table[parts[0][0]]
        lora_a = parts[0][1].reshape(first.n_in, r).T
        if any(not np.array_equal(a.reshape(first.n_in, r).T, lora_a) for _, a, _ in parts[1:]):
            names = " and ".join("/".join(module) for module, _, _ in parts)
            problems.append(
                f"{names}: HF's {key} is one nn.Linear, which PEFT adapts with one lora_A, and these adapters have an "
                "A each: adapt one of them only, or merge the adapters (lmzoo.lora.merge) and export the merged model"
            )
            continue
        if first.part is None:
            lora_b = parts[0][2].reshape(r, first.n_out)
        else:  # each kernel's B in its columns of the fused outputs; a kernel not adapted adds nothing (zero rows)
            lora_b = np.zeros((r, *first.fused), np.float32)
            for module, _, b in parts:
                linear = table[module]
                lora_b[..., slice(*linear.part)] = b.reshape(r, *first.fused[:-1], -1)
            lora_b = lora_b.reshape(r, first.n_out)
        tensors[f"{PREFIX}{key}.lora_A.weight"] = lora_a
        tensors[f"{PREFIX}{key}.lora_B.weight"] = lora_b.T
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
    table, refused, _ = _tables(model_name, model_fields)
    by_key: dict[str, list[tuple[str, ...]]] = {}
    for module, linear in table.items():
        by_key.setdefault(linear.key, []).append(module)
    not_linear = dict(refused.values())  # HF module -> why
    r = int(adapter_config["r"])
    found: dict[str, dict[str, np.ndarray]] = {}
    problems = []
    for name, tensor in tensors.items():
        match = _TENSOR.fullmatch(name.removeprefix(PREFIX))
        if not name.startswith(PREFIX) or match is None:
            problems.append(f"{name}: not a LoRA weight of a linear layer (lmzoo reads lora_A / lora_B)")
            continue
        key, which = match.groups()
        if key not in by_key:
            other = next((k for k in not_linear if key == k or key.startswith(k + ".")), None)
            problems.append(
                _not_adaptable(name, other, not_linear[other]) if other else f"{name}: the model has no linear {key}"
            )
            continue
        linear = table[by_key[key][0]]
        want = (r, linear.n_in) if which == "A" else (linear.n_out, r)
        if tuple(tensor.shape) != want:
            problems.append(f"{name}: adapter {tuple(tensor.shape)}, model expects {want}")
            continue
        found.setdefault(key, {})[which] = tensor
    problems += [
        f"{PREFIX}{key}.lora_{'B' if 'A' in pair else 'A'}.weight: missing"
        for key, pair in found.items()
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
    for key, pair in found.items():
        for module in by_key[key]:  # a fused linear's kernels share its A, each takes its columns of B
            linear = table[module]
            a = pair["A"].T.reshape(*linear.shape[: linear.inputs], r)
            shaped[(*module, transform.LORA_A)], shaped[(*module, transform.LORA_B)] = a, linear.lmzoo_b(pair["B"])
    adapted = [module for key in found for module in by_key[key]]
    adapters = _in_layout(traverse_util.unflatten_dict(shaped), nn.unbox(params), folder)
    config = transform.LoraConfig(
        targets=_targets(adapted, [*table, *refused]),
        rank=r,
        alpha=float(adapter_config.get("lora_alpha", 8)),
        dropout=float(adapter_config.get("lora_dropout") or 0.0),
        rslora=bool(adapter_config.get("use_rslora", False)),
    )
    jax.eval_shape(lambda p, a: transform.merge(p, a, config), nn.unbox(params), adapters)  # against the params
    return adapters, config


def _targets(adapted: list[tuple[str, ...]], table: Sequence[tuple[str, ...]]) -> str:
    """LoraConfig.targets for the adapted modules: their names when every module of each name in `table` (the
    model's, experts included) is adapted, else their paths."""
    names = {module[-1] for module in adapted}
    if sorted(module for module in table if module[-1] in names) == sorted(adapted):
        return "|".join(sorted(names))
    return "|".join(re.escape("/".join(module)) for module in sorted(adapted))


def _in_layout(adapters: Any, params: Any, folder: str) -> Any:
    """Per-layer adapters stacked where `params` scan their layers; a scanned stack needs the same modules adapted
    in every layer (each stack on its own: DeepSeek's dense and MoE layers)."""
    stacks = {
        path[: path.index("layers")]: leaf.shape[0]
        for path, leaf in traverse_util.flatten_dict(params).items()
        if "layers" in path
    }
    if not stacks:
        return adapters
    adapted = list(traverse_util.flatten_dict(adapters))
    for stack, num_layers in stacks.items():
        per_layer: dict[str, set] = {}
        for path in adapted:
            layer = path[len(stack)] if len(path) > len(stack) and path[: len(stack)] == stack else ""
            if re.fullmatch(r"layer_\d+", layer):
                per_layer.setdefault(layer, set()).add(path[len(stack) + 1 :])
        if per_layer and (len(per_layer) != num_layers or len({frozenset(m) for m in per_layer.values()}) > 1):
            raise ValueError(
                f"PEFT adapter {folder} does not adapt the same modules in each of the {num_layers} layers of "
                f"{'/'.join(stack)}; the model scans its layers (scan_layers=True), whose adapters are one stack: load "
                "it into a per-layer model (scan_layers=False)"
            )
    return mapping.materialize(mapping.to_layout(adapters, params))
