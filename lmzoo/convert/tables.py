"""The declarative tensor tables every HF converter is written in, and the one validator.

A family file (gpt2.py, bert.py, seq2seq.py, llama.py) lists, for a given lmzoo config, one `Entry` per lmzoo
leaf: which HF tensor it comes from and how its layout changes. Everything else -- stripping and adding key prefixes,
folding tied copies, checking names, shapes and dtypes, building the nested parameter tree of lazy `Converted` leaves
(`to_sources`) and the HF state dict of lmzoo params (`to_hf`) -- is written once here. Reading a checkpoint folder is
`safetensors_reader`'s, fitting the tree to the target's layer layout and sharding `mapping`'s.

Layouts: Flax kernels are [in, out]. HF GPT-2 uses `Conv1D`, whose weights are already [in, out] and
copy directly (its fused c_attn [D, 3D] is split in three along the last axis). HF `nn.Linear` (BERT,
RoBERTa, ALBERT, DistilBERT, T5, BART, Llama, Mistral, Qwen2, and GPT-2's untied lm_head) stores [out, in] and
needs a transpose. A kernel then reshapes to its Einsum shape: query/key/value (D, N, H) (key/value (D, K, H) with
K kv heads), attention output (N, H, D).
"""

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from lmzoo.convert.mapping import Box, LazyLeaf, ReadBuffer, Relayout, box_of, flatten, slices_of, unstack_layers
from lmzoo.convert.safetensors_reader import StoredTensor
from lmzoo.models import make_config

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

    leaf = split(tensor.T if transpose else tensor, part)[...].reshape(shape) + offset, where part = (index, count)
    takes the index-th of `count` equal slices along the last axis (GPT-2's fused query/key/value) and offset is added
    in float32 (Gemma's RMSNorm weights w, which HF applies as 1 + w: lmzoo's scale is the factor itself).
    """

    hf: str  # HF name without the optional prefix
    path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    transpose: bool = False
    part: tuple[int, int] | None = None
    group: str = ""  # a head a checkpoint may lack as a whole ("mlm", "pooler", ...)
    offset: float = 0.0


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


def norm(
    module: str, path: tuple[str, ...], d: int, *, bias: bool = True, group: str = "", offset: float = 0.0
) -> list[Entry]:
    """HF LayerNorm / T5 RMS norm weight (and bias) [d] -> scale (and bias); `offset` is added to the weight (1 for
    Gemma's RMSNorm, which multiplies by 1 + weight)."""
    entries = [Entry(f"{module}.weight", (*path, "scale"), (d,), (d,), group=group, offset=offset)]
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


class ConfigError(ValueError):
    """An HF config.json value lmzoo cannot read (unsupported or inconsistent); `hf.py` names the file."""


def checkpoint_config(family: str, fields: Mapping[str, Any]) -> Any:
    """The family's config dataclass of the config.model fields an HF config.json gave; a value it refuses is a
    ConfigError (the checkpoint's config.json is at fault, not the run's config.model)."""
    try:
        return make_config(family, fields)
    except ValueError as e:
        raise ConfigError(f"it gives config.model fields lmzoo's {family} refuses: {e}") from None


# Weights are floats; an integer or boolean tensor where one belongs is a damaged or foreign file, not a cast.
_FLOAT_DTYPES = tuple(np.dtype(t) for t in (ml_dtypes.bfloat16, np.float16, np.float32, np.float64))
_COMPARE_BYTES = 64 << 20  # tied copies are compared this much at a time


def read_hf(
    state_dict: Mapping[str, Any], layout: Layout, entries: Sequence[Entry], *, optional: Sequence[str] = ()
) -> tuple[dict[str, Any], list[Entry]]:
    """(tensors by name without the prefix, the entries the checkpoint has); the tensors are the state dict's own
    (numpy arrays or lazy `StoredTensor`s), not read.

    Buffers are skipped; each tied copy folds into its source after checking both hold the same values;
    groups in `optional` may be absent as a whole. Every other difference is an error, and so is a weight whose
    dtype is not a float.
    """
    tensors, keys, duplicates = {}, {}, []
    for key, value in state_dict.items():
        name = key.removeprefix(layout.prefix)
        if layout.skip is not None and layout.skip.fullmatch(name):
            continue
        if name in tensors:
            duplicates.append(key)
        tensors[name], keys[name] = value, key
    for copy, source in layout.tied.items():
        if copy not in tensors:
            continue
        value = tensors.pop(copy)
        if source not in tensors:
            tensors[source], keys[source] = value, keys[copy]
        elif tuple(value.shape) != tuple(tensors[source].shape):  # a wrong size, not a tie problem: name the shapes
            want = next((tuple(e.hf_shape) for e in entries if e.hf == source), None)
            raise ValueError(
                f"checkpoint has {source} of shape {tuple(tensors[source].shape)} and its tied copy {copy} of shape "
                f"{tuple(value.shape)}; the configured {layout.family} model expects {want}"
            )
        elif not _same_values(value, tensors[source]):
            hint = layout.tie_hint if copy == "lm_head.weight" else ""
            raise ValueError(f"checkpoint has {copy} different from {source}; lmzoo's {layout.family} ties them{hint}")
    absent = {group for group in optional if not any(e.hf in tensors for e in entries if e.group == group)}
    present = [entry for entry in entries if entry.group not in absent]
    expected = {entry.hf: entry.hf_shape for entry in present}
    found = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    check_tensors(found, expected, what=f"{layout.name} state dict", note=layout.note, duplicates=duplicates)
    for name in expected:
        dtype = np.dtype(tensors[name].dtype)
        if dtype not in _FLOAT_DTYPES:
            where = tensors[name].file if isinstance(tensors[name], StoredTensor) else "the state dict"
            raise ValueError(
                f"{layout.name} tensor {keys[name]} in {where} has dtype {dtype} where a float weight belongs "
                "(expected bfloat16, float16 or float32): the checkpoint is damaged or not this model's; "
                "export or download it again"
            )
    return tensors, present


def _same_values(a: Any, b: Any) -> bool:
    """Whether two tensors of one shape hold the same values, compared a block of rows at a time."""
    if not a.shape:
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    row_bytes = math.prod(a.shape[1:]) * max(np.dtype(a.dtype).itemsize, np.dtype(b.dtype).itemsize)
    step = max(1, _COMPARE_BYTES // max(1, row_bytes))
    return all(np.array_equal(a[(slice(i, i + step),)], b[(slice(i, i + step),)]) for i in range(0, a.shape[0], step))


class Converted(LazyLeaf):
    """The lmzoo leaf an `Entry` makes of one HF tensor (transposed, one part of a fused tensor, reshaped), for any
    box of the leaf reading only the HF rows behind it.

    The reshape only splits axes: each axis of the (transposed, part-sliced) HF tensor becomes a run of leaf axes
    (D*H -> (N, H)), or vanishes when it has size 1 (BART's [1, V] final_logits_bias).
    """

    def __init__(self, tensor: Any, entry: Entry):
        self.tensor, self.entry = tensor, entry
        self.shape, self.dtype = tuple(entry.shape), np.dtype(tensor.dtype)
        view = entry.hf_shape[::-1] if entry.transpose else entry.hf_shape
        count = entry.part[1] if entry.part else 1
        self.view = (*view[:-1], view[-1] // count)  # the HF tensor as this leaf sees it, before the reshape
        self.groups = _split_axes(self.view, self.shape)
        rows = self.groups[-1 if entry.transpose else 0] if self.groups else ()  # the leaf axes of the HF rows
        if getattr(tensor, "row_axis", None) == 0 and rows and not (entry.part and len(self.view) == 1):
            self.row_axis = rows[0]

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        return self.read(index)

    def read(self, index: tuple[slice, ...], buffer: ReadBuffer | None = None) -> np.ndarray:
        stored, relayout = self.locate(box_of(index, self.shape))
        return relayout.apply(self.read_stored(stored, buffer))

    def locate(self, box: Box) -> tuple[Box, Relayout]:
        """(the box of the HF tensor behind `box` of this leaf, the relayout that turns that box of the tensor into
        `box` of the leaf)."""
        # Each HF axis is read over the range of the outer leaf axis of its run; the inner ones are sliced after.
        view_box = []
        for size, axes in zip(self.view, self.groups, strict=True):
            inner = math.prod(self.shape[axis] for axis in axes[1:])
            start, stop = box[axes[0]] if axes else (0, size)
            view_box.append((start * inner, stop * inner))
        if self.entry.part:
            offset = self.entry.part[0] * self.view[-1]
            view_box[-1] = (view_box[-1][0] + offset, view_box[-1][1] + offset)
        outer = {axes[0] for axes in self.groups if axes}
        # [.., outer range, inner axes whole, ..]: splitting an axis needs no copy
        shape = tuple(box[axis][1] - box[axis][0] if axis in outer else n for axis, n in enumerate(self.shape))
        inner = tuple(None if axis in outer else box[axis] for axis in range(len(self.shape)))
        stored = tuple(view_box[::-1] if self.entry.transpose else view_box)
        return stored, Relayout(self.entry.transpose, shape, inner, self.entry.offset)

    def read_stored(self, stored: Box, buffer: ReadBuffer | None = None) -> np.ndarray:
        """The `stored` box of the HF tensor, as stored (into `buffer` when the tensor is read from a file)."""
        if isinstance(self.tensor, LazyLeaf):
            return self.tensor.read(slices_of(stored), buffer)
        return self.tensor[slices_of(stored)]

    def relayout_leaf(self, box: Box) -> "tuple[Converted, Box]":
        return self, box

    def from_bucket(self) -> bool:
        return isinstance(self.tensor, LazyLeaf) and self.tensor.from_bucket()


def _split_axes(view: Sequence[int], shape: Sequence[int]) -> list[tuple[int, ...]]:
    """For each axis of `view`, the consecutive axes of `shape` that reshaping `view` to `shape` splits it into."""
    groups, axis = [], 0
    for size in view:
        group, product = [], 1
        while axis < len(shape) and product * shape[axis] <= size and (product < size or shape[axis] == 1):
            group.append(axis)
            product *= shape[axis]
            axis += 1
        if product != size:
            raise ValueError(f"an HF tensor viewed as {tuple(view)} does not split axis by axis into {tuple(shape)}")
        groups.append(tuple(group))
    if axis != len(shape):
        raise ValueError(f"an HF tensor viewed as {tuple(view)} does not split axis by axis into {tuple(shape)}")
    return groups


def to_sources(tensors: Mapping[str, Any], entries: Sequence[Entry]) -> Params:
    """Nested lmzoo params (per-layer layout) of `Converted` leaves over the HF tensors of `entries`; nothing is read."""
    params: Params = {}
    for entry in entries:
        *parents, leaf = entry.path
        node = params
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = Converted(tensors[entry.hf], entry)
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
        arrays = [_hf_value(flat["/".join(e.path)], e).reshape(view) for e in sorted(parts, key=_part_index)]
        tensor = np.concatenate(arrays, axis=-1) if len(arrays) > 1 else arrays[0]
        state_dict[key(name)] = np.ascontiguousarray(tensor.T if first.transpose else tensor)
    for copy, source in layout.tied.items():
        state_dict[key(copy)] = state_dict[key(source)].copy()
    return state_dict


def _hf_value(leaf: Any, entry: Entry) -> np.ndarray:
    """An lmzoo leaf as float32 with the entry's offset taken off again (the HF tensor's values, before its layout)."""
    value = np.asarray(leaf, np.float32)
    return value - np.float32(entry.offset) if entry.offset else value


def _part_index(entry: Entry) -> int:
    return entry.part[0] if entry.part else 0
