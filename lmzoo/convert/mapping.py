"""The one mechanism behind every HF converter: declarative tensor tables, safetensors reading, one validator.

A family file (gpt2.py, bert.py, seq2seq.py, llama.py) lists, for a given lmzoo config, one `Entry` per lmzoo
leaf: which HF tensor it comes from and how its layout changes. Everything else -- reading a checkpoint
folder, stripping and adding key prefixes, folding tied copies, checking names and shapes both ways,
building the nested parameter tree, the scanned layer layout -- is written once here.

Layouts: Flax kernels are [in, out]. HF GPT-2 uses `Conv1D`, whose weights are already [in, out] and
copy directly (its fused c_attn [D, 3D] is split in three along the last axis). HF `nn.Linear` (BERT,
RoBERTa, ALBERT, DistilBERT, T5, BART, Llama, Mistral, Qwen2, and GPT-2's untied lm_head) stores [out, in] and
needs a transpose. A kernel then reshapes to its Einsum shape: query/key/value (D, N, H) (key/value (D, K, H) with
K kv heads), attention output (N, H, D).

Weights are read only from safetensors files (float32, float16 or bfloat16; converted to float32): pickled
`pytorch_model.bin` checkpoints are refused, because unpickling can run arbitrary code.
"""

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import safetensors

Params = dict[str, Any]

ACTIVATION_FROM_HF = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
}
ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}


class Entry(NamedTuple):
    """One HF tensor (or one part of it) <-> one lmzoo leaf.

    leaf = split(tensor.T if transpose else tensor, part)[...].reshape(shape), where part = (index, count)
    takes the index-th of `count` equal slices along the last axis (GPT-2's fused query/key/value).
    """

    hf: str  # HF name without the optional prefix
    path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    transpose: bool = False
    part: tuple[int, int] | None = None
    group: str = ""  # a head a checkpoint may lack as a whole ("mlm", "pooler", ...)


class Layout(NamedTuple):
    """How one HF model names its state dict around the entries."""

    name: str  # "HF gpt2", for messages
    family: str  # the lmzoo family ("gpt2", "bert", "seq2seq")
    prefix: str = ""  # optional prefix of the model body's keys ("transformer.", "bert.", "model.")
    heads: frozenset[str] = frozenset()  # names outside the body: never prefixed
    tied: Mapping[str, str] = {}  # HF copy -> the tensor it must equal (tied embeddings)
    skip: re.Pattern | None = None  # non-parameter buffers
    tie_hint: str = ""  # how to untie, shown when lm_head.weight differs from its source
    note: str = ""  # appended to validation errors


def linear(
    module: str,
    path: tuple[str, ...],
    n_in: int,
    n_out: int,
    *,
    in_shape: tuple[int, ...] | None = None,
    out_shape: tuple[int, ...] | None = None,
    bias: bool = True,
    group: str = "",
) -> list[Entry]:
    """HF nn.Linear weight [out, in] (and bias [out]) -> Einsum kernel (*in_shape, *out_shape) (and bias out_shape)."""
    in_shape, out_shape = in_shape or (n_in,), out_shape or (n_out,)
    entries = [Entry(f"{module}.weight", (*path, "kernel"), (n_out, n_in), (*in_shape, *out_shape), True, group=group)]
    if bias:
        entries.append(Entry(f"{module}.bias", (*path, "bias"), (n_out,), out_shape, group=group))
    return entries


def conv1d(
    module: str,
    path: tuple[str, ...],
    n_in: int,
    n_out: int,
    *,
    in_shape: tuple[int, ...] | None = None,
    out_shape: tuple[int, ...] | None = None,
    part: tuple[int, int] | None = None,
) -> list[Entry]:
    """HF GPT-2 Conv1D weight [in, out * count] (and bias) -> the `part` = (index, count) slice of it as an
    Einsum kernel (*in_shape, *out_shape) (and bias out_shape); no transpose."""
    in_shape, out_shape = in_shape or (n_in,), out_shape or (n_out,)
    count = part[1] if part else 1
    return [
        Entry(f"{module}.weight", (*path, "kernel"), (n_in, n_out * count), (*in_shape, *out_shape), part=part),
        Entry(f"{module}.bias", (*path, "bias"), (n_out * count,), out_shape, part=part),
    ]


def norm(module: str, path: tuple[str, ...], d: int, *, bias: bool = True, group: str = "") -> list[Entry]:
    """HF LayerNorm / T5 RMS norm weight (and bias) [d] -> scale (and bias)."""
    entries = [Entry(f"{module}.weight", (*path, "scale"), (d,), (d,), group=group)]
    if bias:
        entries.append(Entry(f"{module}.bias", (*path, "bias"), (d,), (d,), group=group))
    return entries


def table(module: str, path: tuple[str, ...], rows: int, d: int, *, group: str = "") -> list[Entry]:
    """HF nn.Embedding weight [rows, d] -> embedding [rows, d]."""
    return [Entry(f"{module}.weight", (*path, "embedding"), (rows, d), (rows, d), group=group)]


class TensorDiff(NamedTuple):
    """Names `found` has and `expected` lacks, the reverse, and names whose shapes differ."""

    unexpected: list[str]
    missing: list[str]
    misshapen: list[str]

    def describe(self, found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> str:
        parts = [f"unexpected keys {self.unexpected}"] * bool(self.unexpected)
        parts += [f"missing keys {self.missing}"] * bool(self.missing)
        if self.misshapen:
            shapes = (f"{name}: {tuple(found[name])} (expected {tuple(expected[name])})" for name in self.misshapen)
            parts.append("misshapen " + "; ".join(shapes))
        return ", ".join(parts)


def diff_tensors(
    found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], duplicates: Sequence[str] = ()
) -> TensorDiff:
    """Compares name -> shape maps; `duplicates` (keys that occurred twice) count as unexpected."""
    return TensorDiff(
        unexpected=[*duplicates, *sorted(set(found) - set(expected))],
        missing=[name for name in expected if name not in found],
        misshapen=[name for name in expected if name in found and tuple(found[name]) != tuple(expected[name])],
    )


def check_tensors(
    found: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    *,
    what: str,
    note: str = "",
    duplicates: Sequence[str] = (),
) -> None:
    """The validator of every conversion, both directions: raises listing unexpected, missing and misshapen names."""
    diff = diff_tensors(found, expected, duplicates)
    if any(diff):
        raise ValueError(f"{what} does not match the config: {diff.describe(found, expected)}{note}")


def read_hf(
    state_dict: Mapping[str, Any], layout: Layout, entries: Sequence[Entry], *, optional: Sequence[str] = ()
) -> tuple[dict[str, np.ndarray], list[Entry]]:
    """(float32 tensors by name without the prefix, the entries the checkpoint has).

    Buffers are skipped; each tied copy folds into its source after checking both hold the same values;
    groups in `optional` may be absent as a whole. Every other difference is an error.
    """
    tensors, duplicates = {}, []
    for key, value in state_dict.items():
        name = key.removeprefix(layout.prefix)
        if layout.skip is not None and layout.skip.fullmatch(name):
            continue
        if name in tensors:
            duplicates.append(key)
        tensors[name] = np.array(value, dtype=np.float32)
    for copy, source in layout.tied.items():
        if copy not in tensors:
            continue
        value = tensors.pop(copy)
        if source not in tensors:
            tensors[source] = value
        elif value.shape != tensors[source].shape:  # a wrong size, not a tie problem: name the shapes
            want = next((tuple(e.hf_shape) for e in entries if e.hf == source), None)
            raise ValueError(
                f"checkpoint has {source} of shape {tensors[source].shape} and its tied copy {copy} of shape "
                f"{value.shape}; the configured {layout.family} model expects {want}"
            )
        elif not np.array_equal(value, tensors[source]):
            hint = layout.tie_hint if copy == "lm_head.weight" else ""
            raise ValueError(f"checkpoint has {copy} different from {source}; lmzoo's {layout.family} ties them{hint}")
    absent = {group for group in optional if not any(e.hf in tensors for e in entries if e.group == group)}
    present = [entry for entry in entries if entry.group not in absent]
    expected = {entry.hf: entry.hf_shape for entry in present}
    found = {name: tensor.shape for name, tensor in tensors.items()}
    check_tensors(found, expected, what=f"{layout.name} state dict", note=layout.note, duplicates=duplicates)
    return tensors, present


def to_params(tensors: Mapping[str, np.ndarray], entries: Sequence[Entry]) -> Params:
    """Nested lmzoo params (per-layer layout) from the HF tensors of `entries`."""
    params: Params = {}
    for entry in entries:
        *parents, leaf = entry.path
        node = params
        for name in parents:
            node = node.setdefault(name, {})
        tensor = tensors[entry.hf]
        tensor = tensor.T if entry.transpose else tensor
        if entry.part is not None:
            index, count = entry.part
            tensor = np.split(tensor, count, axis=-1)[index]
        node[leaf] = np.ascontiguousarray(tensor).reshape(entry.shape)
    return params


def to_hf(params: Params, layout: Layout, entries: Sequence[Entry], *, prefixed: bool = True) -> dict[str, np.ndarray]:
    """HF state dict (float32 numpy, tied copies included) from lmzoo params in any layer layout.

    prefixed: whether body names carry layout.prefix (a *ForX model) or not (the bare model).
    """
    flat = flatten(unstack_layers(params))
    expected = {"/".join(entry.path): entry.shape for entry in entries}
    check_tensors(
        {path: np.shape(leaf) for path, leaf in flat.items()}, expected, what=f"lmzoo params for {layout.name}"
    )

    def key(name: str) -> str:
        return name if name in layout.heads or not prefixed else layout.prefix + name

    pieces: dict[str, list[Entry]] = {}
    for entry in entries:
        pieces.setdefault(entry.hf, []).append(entry)
    state_dict = {}
    for name, parts in pieces.items():
        first = parts[0]
        view = list(first.hf_shape[::-1] if first.transpose else first.hf_shape)
        view[-1] //= len(parts)
        arrays = [np.asarray(flat["/".join(e.path)], np.float32).reshape(view) for e in sorted(parts, key=_part_index)]
        tensor = np.concatenate(arrays, axis=-1) if len(arrays) > 1 else arrays[0]
        state_dict[key(name)] = np.ascontiguousarray(tensor.T if first.transpose else tensor)
    for copy, source in layout.tied.items():
        state_dict[key(copy)] = state_dict[key(source)].copy()
    return state_dict


def _part_index(entry: Entry) -> int:
    return entry.part[0] if entry.part else 0


# safetensors dtype -> numpy; bfloat16 (most released Llama, Mistral and Qwen2 weights), which numpy lacks and
# safetensors.numpy refuses, through ml_dtypes.
_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _load_safetensors(file: Path) -> dict[str, np.ndarray]:
    """The tensors of one safetensors file; a truncated or foreign file is a ValueError naming it."""
    try:
        tensors = safetensors.deserialize(file.read_bytes())
    except safetensors.SafetensorError as e:
        raise ValueError(
            f"{file} is not a readable safetensors file ({e}): truncated, or another format under that name; "
            "download or export it again"
        ) from None
    unknown = sorted({info["dtype"] for _, info in tensors} - set(_DTYPES))
    if unknown:
        raise ValueError(f"{file} holds tensors of dtype {unknown}; lmzoo reads {sorted(_DTYPES)}")
    return {name: np.frombuffer(info["data"], _DTYPES[info["dtype"]]).reshape(info["shape"]) for name, info in tensors}


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); download or export it again") from None


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
    hf_config = _read_json(config_file)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return hf_config, _load_safetensors(single)
    if index.is_file():
        weight_map = _read_json(index)["weight_map"]
        state_dict = {}
        for shard in sorted(set(weight_map.values())):
            shard_file = folder / shard
            if not shard_file.is_file():
                raise FileNotFoundError(f"shard {shard_file} listed in {index} not found")
            state_dict |= _load_safetensors(shard_file)
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


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> {"a/b/c": leaf}."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat |= flatten(value, f"{prefix}/{key}" if prefix else str(key))
    return flat


def _is_per_layer(tree: Any) -> bool:
    """Whether `tree` is exactly {"layer_0": ..., ..., "layer_{L-1}": ...} (BlockStack without scan)."""
    return isinstance(tree, Mapping) and bool(tree) and set(tree) == {f"layer_{i}" for i in range(len(tree))}


def _stack(*subtrees: Any) -> Any:
    if isinstance(subtrees[0], Mapping):
        return {key: _stack(*(tree[key] for tree in subtrees)) for key in subtrees[0]}
    return np.stack([np.asarray(tree) for tree in subtrees])


def unstack_layers(tree: Any) -> Any:
    """`tree` with every scanned {"layers": [L, ...] leaves} subtree split into {"layer_0": ..., ...}."""
    if not isinstance(tree, Mapping):
        return tree
    if set(tree) == {"layers"}:
        stacked = tree["layers"]
        num_layers = len(next(iter(flatten(stacked).values())))
        return {f"layer_{i}": _layer(stacked, i) for i in range(num_layers)}
    return {key: unstack_layers(value) for key, value in tree.items()}


def _layer(stacked: Any, i: int) -> Any:
    """Layer `i` of a tree whose leaves have a leading [L] axis."""
    if isinstance(stacked, Mapping):
        return {key: _layer(value, i) for key, value in stacked.items()}
    return np.asarray(stacked[i])


def to_layout(tree: Any, target: Any) -> Any:
    """`tree` (per-layer) with every per-layer subtree stacked where `target` holds a scanned `layers` subtree."""
    if not isinstance(tree, Mapping) or not isinstance(target, Mapping):
        return tree
    if set(target) == {"layers"} and _is_per_layer(tree):
        tree = {"layers": _stack(*(tree[f"layer_{i}"] for i in range(len(tree))))}
    return {key: to_layout(value, target[key]) if key in target else value for key, value in tree.items()}
