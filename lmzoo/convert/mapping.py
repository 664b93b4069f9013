"""The one mechanism behind every HF converter: declarative tensor tables, lazy safetensors reading, one validator,
and the placement of each converted parameter in its target's sharding.

A family file (gpt2.py, bert.py, seq2seq.py, llama.py) lists, for a given lmzoo config, one `Entry` per lmzoo
leaf: which HF tensor it comes from and how its layout changes. Everything else -- reading a checkpoint
folder, stripping and adding key prefixes, folding tied copies, checking names, shapes and dtypes, building the
nested parameter tree, the scanned layer layout -- is written once here.

Layouts: Flax kernels are [in, out]. HF GPT-2 uses `Conv1D`, whose weights are already [in, out] and
copy directly (its fused c_attn [D, 3D] is split in three along the last axis). HF `nn.Linear` (BERT,
RoBERTa, ALBERT, DistilBERT, T5, BART, Llama, Mistral, Qwen2, and GPT-2's untied lm_head) stores [out, in] and
needs a transpose. A kernel then reshapes to its Einsum shape: query/key/value (D, N, H) (key/value (D, K, H) with
K kv heads), attention output (N, H, D).

Streaming: a checkpoint folder is opened by its headers alone (`read_safetensors_dir`); each tensor is a
`StoredTensor` read by byte ranges when sliced. The converted tree holds `Converted` leaves (an Entry's view of one
tensor) and `Stacked` ones (scanned layers), which compute any box of the leaf from the HF rows behind it. `place`
then builds each parameter in its target's dtype and sharding: the tensor is read once for all the shards this
process's devices hold, in pieces (a scanned leaf's layers, a large tensor's ranges of rows), each read on a thread of
its own while the one before is copied out. On CPU devices the pieces go straight into the shards' host blocks, which
the CPU client adopts as the device buffers; beyond the parameters, host memory holds two pieces being read and
copied (a layer's tensor, or about _ROWS_PIECE_BYTES of rows) and the blocks of the one parameter being built. On
accelerators each piece is put, as stored, on the devices whose blocks it meets, and transposed, reshaped, cast and
written into its place there (`Relayout`, the same steps a host read takes), so the host only reads, each byte once for
all its devices, and holds two pieces whatever the model's size.

Weights are read only from safetensors files (float32, float16 or bfloat16): pickled `pytorch_model.bin`
checkpoints are refused, because unpickling can run arbitrary code.
"""

import collections
import concurrent.futures
import fnmatch
import functools
import itertools
import json
import math
import mmap
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

from lmzoo import storage
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


# A box of an array: (start, stop) per axis.
Box = tuple[tuple[int, int], ...]


def _box(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
    """The box a tuple of step-1 slices (a shard's index, shorter than `shape` for whole trailing axes) selects."""
    index = (*index, *[slice(None)] * (len(shape) - len(index)))
    return tuple(part.indices(size)[:2] for part, size in zip(index, shape, strict=True))


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


class LazyLeaf:
    """A parameter read on demand: `shape`, `dtype` as stored, and `leaf[index]` (a tuple of step-1 slices) reading
    only what that box needs. Numpy arrays serve in the same places; `np.asarray(leaf)` reads it whole."""

    shape: tuple[int, ...]
    dtype: np.dtype
    # The axis a range of which reads a range of the stored tensor's rows and no others (None: reads are not by rows).
    row_axis: int | None = None

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return _host(self, np.dtype(self.dtype if dtype is None else dtype))

    def read(self, index: tuple[slice, ...], buffer: "ReadBuffer | None" = None) -> np.ndarray:
        """`self[index]`, the bytes read from a file landing in `buffer` when one is given (the result is then valid
        until the buffer's next read)."""
        return self[index]


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

    def read(self, index: tuple[slice, ...], buffer: "ReadBuffer | None" = None) -> np.ndarray:
        stored, relayout = self.locate(_box(index, self.shape))
        return relayout.apply(self.read_stored(stored, buffer))

    def locate(self, box: Box) -> tuple[Box, "Relayout"]:
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
        return stored, Relayout(self.entry.transpose, shape, inner)

    def read_stored(self, stored: Box, buffer: "ReadBuffer | None" = None) -> np.ndarray:
        """The `stored` box of the HF tensor, as stored (into `buffer` when the tensor is read from a file)."""
        if isinstance(self.tensor, LazyLeaf):
            return self.tensor.read(_slices(stored), buffer)
        return self.tensor[_slices(stored)]


class Relayout(NamedTuple):
    """How a block of an HF tensor becomes a box of an lmzoo leaf: transposed (every axis reversed, for [out, in]
    kernels), reshaped to `shape` (splitting axes), then sliced to `inner` ((start, stop) of each axis; None keeps
    one whole). Numpy and jax arrays take it alike: a view on the host, or on an accelerator a computation there."""

    transpose: bool
    shape: tuple[int, ...]
    inner: tuple[tuple[int, int] | None, ...]

    def apply(self, block: Any) -> Any:
        block = block.T if self.transpose else block
        return block.reshape(self.shape)[tuple(slice(None) if part is None else slice(*part) for part in self.inner)]


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


class Stacked(LazyLeaf):
    """One leaf of every layer stacked along a new leading [L] axis (a scanned layer stack), read layer by layer."""

    def __init__(self, layers: Sequence[Any]):
        self.layers = list(layers)
        self.shape, self.dtype = (len(self.layers), *layers[0].shape), np.dtype(layers[0].dtype)

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        box = _box(index, self.shape)
        return np.stack([layer[_slices(box[1:])] for layer in self.layers[slice(*box[0])]])


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


def materialize(tree: Any, dtype: Any = np.float32) -> Any:
    """Nested leaves (lazy or arrays) -> nested host numpy arrays of `dtype`, read one leaf at a time."""
    return jax.tree.map(lambda leaf: _host(leaf, np.dtype(dtype)), tree)


def place(source: Any, like: Any) -> np.ndarray | jax.Array:
    """`source` (a lazy leaf or an array) as a parameter of `like`'s dtype, converted once: in `like`'s sharding
    when it has one (a jax.Array, or a ShapeDtypeStruct given a sharding), this process filling only the shards its
    devices hold; else a host numpy array. A source already so placed is returned as it is."""
    dtype, sharding = np.dtype(like.dtype), getattr(like, "sharding", None)
    if sharding is None:
        return source if isinstance(source, np.ndarray) and source.dtype == dtype else _host(source, dtype)
    if isinstance(source, jax.Array) and source.dtype == dtype and source.sharding == sharding:
        return source
    shape = tuple(source.shape)
    if _assembled_on_devices(sharding):
        return _place_in_pieces(source, shape, dtype, sharding)
    boxes = {_box(index, shape) for index in sharding.addressable_devices_indices_map(shape).values()}
    blocks = {box: _fresh_empty(_sizes(box), dtype) for box in boxes}
    _fill(source, list(blocks.items()), ReadBuffer())
    return jax.make_array_from_callback(shape, sharding, lambda index: blocks[_box(index, shape)])


def _assembled_on_devices(sharding: jax.sharding.Sharding) -> bool:
    """Whether `place` builds each device's block on the device from pieces: where any device is an accelerator. A
    CPU device adopts a host block as its buffer instead, so there the blocks are filled in place."""
    return any(device.platform != "cpu" for device in sharding.device_set)


# Stored dtypes an accelerator converts itself. Others (float64, which jax holds as float32 unless x64 is on, so a
# cast to bfloat16 would round twice) are converted on the host.
_DEVICE_CAST_DTYPES = tuple(np.dtype(t) for t in (ml_dtypes.bfloat16, np.float16, np.float32))


def _place_in_pieces(source: Any, shape: tuple[int, ...], dtype: np.dtype, sharding: Any) -> jax.Array:
    """`source` in `sharding`, each addressable device's block assembled on the device. The box that bounds the
    blocks is cut into pieces (`_piece_boxes`: a layer, ~_ROWS_PIECE_BYTES of rows), each read once, as stored, for
    every block it meets; each block's part of it is put on the block's devices as read (the stored dtype and
    layout) and transposed, reshaped and cast there (`_insert`), so the host neither copies nor converts the bytes.
    The next piece is read while the current one is put on the devices (`_read_ahead`). Host memory holds two pieces
    (from a bucket, the pieces in flight), never a parameter or a block whole (an accelerator's block of a scanned
    leaf is many times the largest tensor)."""
    holders: dict[Box, list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        holders.setdefault(_box(index, shape), []).append(device)
    blocks = {box: [jax.numpy.zeros(_sizes(box), dtype, device=d) for d in devices] for box, devices in holders.items()}
    bounds = tuple(
        (min(box[axis][0] for box in holders), max(box[axis][1] for box in holders)) for axis in range(len(shape))
    )
    reads = []
    for piece in _piece_boxes(source, bounds, dtype):
        overlaps = [(box, _overlap(piece, box)) for box in holders]
        reads.append((piece, [(box, overlap) for box, overlap in overlaps if overlap is not None]))

    def parts(index: int, buffers: tuple[ReadBuffer, ReadBuffer]) -> list[tuple[Box, Box, np.ndarray, Relayout | None]]:
        return _piece_parts(source, *reads[index], dtype, *buffers)

    def written() -> None:  # the pieces put so far are in their blocks: their buffers may be read into again
        jax.block_until_ready(list(itertools.chain.from_iterable(blocks.values())))

    # ahead on reader threads only when reading is all they do (a host conversion reads on the reader itself)
    ahead = all(_converted_leaf(source, piece) is not None for piece, _ in reads)
    for current in _read_ahead(
        len(reads),
        parts,
        lambda: (ReadBuffer(), ReadBuffer()),
        nbytes=lambda index: math.prod(_sizes(reads[index][0])) * np.dtype(source.dtype).itemsize,
        from_bucket=_from_bucket(source),
        before_reuse=written,
        ahead=ahead,
    ):
        for box, overlap, host, relayout in current:
            starts = np.array([start for start, _ in _within(overlap, box)], np.int32)
            blocks[box] = [
                _insert(block, jax.device_put(host, block.device), starts, relayout, _sizes(overlap))
                for block in blocks[box]
            ]
    placed = {
        device: block for box, devices in holders.items() for device, block in zip(devices, blocks[box], strict=True)
    }
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [placed[device] for device in sharding.addressable_devices_indices_map(shape)]
    )


def _piece_parts(
    source: Any,
    piece: Box,
    overlaps: Sequence[tuple[Box, Box]],
    dtype: np.dtype,
    buffer: "ReadBuffer",
    staging: "ReadBuffer",
) -> list[tuple[Box, Box, np.ndarray, Relayout | None]]:
    """(block box, overlap, host array, relayout) of each (block box, overlap) of `overlaps` (the blocks `piece` of
    `source` meets): the stored box of the HF tensor behind the overlap, read once for the whole piece into
    `buffer`, and the relayout that makes it the overlap there. A piece of any other source (an array, a float64
    tensor) is converted on the host into `staging`, to `dtype`, its relayout None."""
    behind = _converted_leaf(source, piece)
    if behind is None:
        host = staging.take(math.prod(_sizes(piece)), dtype).reshape(_sizes(piece))
        _fill(source, [(piece, host)], buffer)
        return [(box, overlap, host[_slices(_within(overlap, piece))], None) for box, overlap in overlaps]
    leaf, leaf_piece = behind
    stored_piece, _ = leaf.locate(leaf_piece)
    raw = leaf.read_stored(stored_piece, buffer)
    parts = []
    for box, overlap in overlaps:
        stored, relayout = leaf.locate(_converted_leaf(source, overlap)[1])
        parts.append((box, overlap, raw[_slices(_within(stored, stored_piece))], relayout))
    return parts


def _converted_leaf(source: Any, box: Box) -> "tuple[Converted, Box] | None":
    """(the `Converted` leaf `box` of `source` lies in, the box within it): `source` itself, or one layer of a
    scanned stack (`box` one layer long); None for any other source or a tensor the accelerator does not cast."""
    while isinstance(source, Stacked) and box[0][1] - box[0][0] == 1:
        source, box = source.layers[box[0][0]], box[1:]
    if isinstance(source, Converted) and source.dtype in _DEVICE_CAST_DTYPES:
        return source, box
    return None


def _piece_boxes(source: Any, box: Box, dtype: np.dtype) -> list[Box]:
    """`box` cut into the pieces an accelerator's blocks are put together from: a scanned leaf's layers one by one,
    each cut as its layer's leaf is; a tensor of more than _ROWS_PIECE_BYTES (as `dtype`) in ranges of its rows of
    about that many bytes, else whole."""
    if isinstance(source, Stacked):
        return [
            ((layer, layer + 1), *inner)
            for layer in range(*box[0])
            for inner in _piece_boxes(source.layers[layer], box[1:], dtype)
        ]
    axis = getattr(source, "row_axis", None)
    count = math.ceil(math.prod(_sizes(box)) * dtype.itemsize / _ROWS_PIECE_BYTES)
    if axis is None or count < 2:
        return [box]
    return [(*box[:axis], rows, *box[axis + 1 :]) for rows in _ranges(*box[axis], count)]


def _sizes(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def _overlap(a: Box, b: Box) -> Box | None:
    """The box two boxes share, or None when they share nothing."""
    shared = tuple(
        (max(low_a, low_b), min(high_a, high_b)) for (low_a, high_a), (low_b, high_b) in zip(a, b, strict=True)
    )
    return shared if all(start < stop for start, stop in shared) else None


def _within(inner: Box, outer: Box) -> Box:
    """`inner` relative to the start of `outer`, which holds it."""
    return tuple((start - low, stop - low) for (start, stop), (low, _) in zip(inner, outer, strict=True))


@functools.partial(jax.jit, donate_argnums=0, static_argnums=(3, 4))
def _insert(
    block: jax.Array, piece: jax.Array, starts: jax.Array, relayout: Relayout | None, shape: tuple[int, ...]
) -> jax.Array:
    """`block` with `piece` (a box of a stored HF tensor, or of the leaf when `relayout` is None) taken through it,
    reshaped to `shape` (a scanned leaf's layer axis) and cast to the block's dtype, written at `starts` ([ndim]
    int32), in place (the block is donated)."""
    piece = relayout.apply(piece) if relayout is not None else piece
    return jax.lax.dynamic_update_slice(block, piece.reshape(shape).astype(block.dtype), tuple(starts))


def _host(source: Any, dtype: np.dtype) -> np.ndarray:
    out = _fresh_empty(tuple(source.shape), dtype)
    _fill(source, [(_box((), out.shape), out)], ReadBuffer())
    return out


class ReadBuffer:
    """The buffer the file reads of one parameter land in, one after another (a stacked leaf's layers), grown to the
    largest: each read is copied out before the next, so its pages are written into fresh memory once rather than
    once per layer."""

    def __init__(self):
        self.pages = np.zeros(0, np.uint8)

    def take(self, count: int, dtype: np.dtype) -> np.ndarray:
        """An uninitialised [count] array of `dtype` over the buffer's first bytes."""
        nbytes = count * dtype.itemsize
        if len(self.pages) < nbytes:
            self.pages = _fresh_empty((nbytes,), np.dtype(np.uint8))
        return self.pages[:nbytes].view(dtype)


def _fill(source: Any, parts: Sequence[tuple[Box, np.ndarray]], buffer: ReadBuffer) -> None:
    """Writes into each (box, out) of `parts` that box of `source`, converted to out's dtype; `source` is read once
    (into `buffer`) for all of them over the box that bounds theirs, in pieces each read while the one before is
    copied out: a stacked leaf layer by layer, a large tensor by ranges of its rows."""
    if not isinstance(source, Stacked):
        _read_while_copying([(source, piece) for piece in _row_pieces(source, parts)], buffer)
        return
    layers = []
    for layer, layer_source in enumerate(source.layers):
        inside = [(box[1:], out[layer - box[0][0]]) for box, out in parts if box[0][0] <= layer < box[0][1]]
        if inside:
            layers.append((layer_source, inside))
    if any(isinstance(layer_source, Stacked) for layer_source, _ in layers):  # stacked twice (experts): in turn
        for layer_source, inside in layers:
            _fill(layer_source, inside, buffer)
        return
    _read_while_copying(layers, buffer)


# A tensor whose parts come to more than this is read in pieces of about this many bytes of rows.
_ROWS_PIECE_BYTES = 32 << 20


def _row_pieces(source: Any, parts: Sequence[tuple[Box, np.ndarray]]) -> list[list[tuple[Box, np.ndarray]]]:
    """`parts` cut along `source.row_axis` into pieces of about _ROWS_PIECE_BYTES (each a range of the stored
    tensor's rows); `[parts]` when it is smaller or is not read by rows."""
    axis = getattr(source, "row_axis", None)
    count = math.ceil(sum(out.nbytes for _, out in parts) / _ROWS_PIECE_BYTES)
    if axis is None or count < 2:
        return [list(parts)]
    low, high = min(box[axis][0] for box, _ in parts), max(box[axis][1] for box, _ in parts)
    pieces = []
    for first, last in _ranges(low, high, count):
        piece = []
        for box, out in parts:
            start, stop = max(first, box[axis][0]), min(last, box[axis][1])
            if start < stop:
                inner = [slice(None)] * out.ndim
                inner[axis] = slice(start - box[axis][0], stop - box[axis][0])
                piece.append(((*box[:axis], (start, stop), *box[axis + 1 :]), out[tuple(inner)]))
        if piece:
            pieces.append(piece)
    return pieces


def _ranges(low: int, high: int, count: int) -> list[tuple[int, int]]:
    """[low, high) cut into `count` (at most high - low) consecutive ranges of about equal length."""
    edges = np.linspace(low, high, min(count, high - low) + 1).astype(int).tolist()
    return list(zip(edges[:-1], edges[1:], strict=True))


def _read_while_copying(reads: Sequence[tuple[Any, Sequence[tuple[Box, np.ndarray]]]], buffer: ReadBuffer) -> None:
    """`_read_for` and then `_copy_all` of each (source, parts) of `reads`, the next read (`_read_ahead`) while the
    current one is copied out."""
    spare = [buffer]  # the caller's buffer first, reused across its parameters
    for pairs in _read_ahead(
        len(reads),
        lambda index, read_into: _read_for(*reads[index], read_into),
        lambda: spare.pop() if spare else ReadBuffer(),
        nbytes=lambda index: sum(out.nbytes for _, out in reads[index][1]),
        from_bucket=bool(reads) and _from_bucket(reads[0][0]),
    ):
        _copy_all(pairs)


# From a bucket, where each ranged GET waits a round trip, reads are kept in flight ahead of their use: at most this
# many, holding at most this many bytes (one more, however large, when none is).
_BUCKET_READS_AHEAD = 16
_BUCKET_BYTES_AHEAD = 256 << 20


def _read_ahead(
    count: int,
    read: Callable[[int, Any], Any],
    new_buffer: Callable[[], Any],
    *,
    nbytes: Callable[[int], int],
    from_bucket: bool,
    before_reuse: Callable[[], None] = lambda: None,
    ahead: bool = True,
) -> Iterator[Any]:
    """`read(index, buffer)` of each index in range(count), yielded in order, read ahead of their use on reader
    threads: from local files (the page cache, or a disk read in large requests) one read ahead, into two buffers of
    `new_buffer()` in turn, `before_reuse()` called before a buffer is read into again; from a bucket as many as
    _BUCKET_READS_AHEAD and _BUCKET_BYTES_AHEAD allow, each into a buffer of its own (the bytes arrive in memory of
    their own anyway). `ahead` False (or fewer than two reads): each read in turn on the calling thread."""
    if not ahead or count < 2:
        buffer = new_buffer()
        for index in range(count):
            yield read(index, buffer)
        return
    if not from_bucket:
        buffers = (new_buffer(), new_buffer())
        reading = _reader().submit(read, 0, buffers[0])
        for index in range(count):
            current = reading.result()
            if index + 1 < count:
                before_reuse()
                reading = _reader().submit(read, index + 1, buffers[(index + 1) % 2])
            yield current
        return
    pending: collections.deque = collections.deque()
    submitted, in_flight = 0, 0
    for _ in range(count):
        while submitted < count and (
            not pending or (len(pending) < _BUCKET_READS_AHEAD and in_flight + nbytes(submitted) <= _BUCKET_BYTES_AHEAD)
        ):
            pending.append((_bucket_readers().submit(read, submitted, new_buffer()), nbytes(submitted)))
            in_flight += nbytes(submitted)
            submitted += 1
        reading, size = pending.popleft()
        in_flight -= size
        yield reading.result()


def _from_bucket(source: Any) -> bool:
    """Whether `source` (a converted, stacked or stored tensor) is read from a bucket (gs://, s3://)."""
    while isinstance(source, Stacked | Converted):
        source = source.layers[0] if isinstance(source, Stacked) else source.tensor
    return isinstance(source, StoredTensor) and storage.is_remote(source.file)


def _read_for(
    source: Any, parts: Sequence[tuple[Box, np.ndarray]], buffer: ReadBuffer
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(out, source's block for out's box) of each (box, out) of `parts`, `source` read once (into `buffer`) over the
    box that bounds theirs."""
    bounds = tuple(
        (min(box[axis][0] for box, _ in parts), max(box[axis][1] for box, _ in parts))
        for axis in range(len(source.shape))
    )
    block = source.read(_slices(bounds), buffer) if isinstance(source, LazyLeaf) else source[_slices(bounds)]
    pairs = []
    for box, out in parts:
        pairs.append((out, block[_slices(_within(box, bounds))]))
    return pairs


@functools.cache
def _reader() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that reads a parameter's next piece from local files while the current one is used."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmzoo-read")


@functools.cache
def _bucket_readers() -> concurrent.futures.ThreadPoolExecutor:
    """The threads whose ranged GETs from a bucket are in flight together, ahead of their use."""
    return concurrent.futures.ThreadPoolExecutor(_BUCKET_READS_AHEAD, thread_name_prefix="lmzoo-bucket-read")


# Tile sides (elements) for copying a transposed view: along the axis the source is contiguous in, and over the others.
# Long runs of the source with few of them: each source row is read as whole cache lines, and the 16 output lines a
# column of the tile writes stay in the L1 cache between rows.
_TILE_FAST, _TILE = 1024, 16


# Copies of this many bytes or more together are spread over threads (numpy's copies release the GIL): loading
# writes the whole model into fresh memory, and each thread faults in and fills its own part.
_PARALLEL_BYTES = 8 << 20
_MAX_COPY_THREADS = 16
# Threads a tiled copy is split over: a tile's Python work (its slices, the call) holds the GIL for about a tenth of
# its time, so beyond a few threads they queue for the GIL and the copy slows down rather than speeding up.
_TILED_COPY_THREADS = 4


@functools.cache
def _copy_threads() -> tuple[concurrent.futures.ThreadPoolExecutor | None, int]:
    """(the pool that large copies are split over, its threads): one per core this process may run on, at most
    _MAX_COPY_THREADS; no pool on one core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    count = min(cores, _MAX_COPY_THREADS)
    return (concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="lmzoo-load") if count > 1 else None), count


def _copy_all(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """np.copyto(out, src) of each (out, src), converting to out's dtype; when they come to `_PARALLEL_BYTES` or more,
    on the copy threads, each pair split into as many parts as there are threads along `_split_axis`."""
    pool, count = _copy_threads()
    if pool is None or sum(out.nbytes for out, _ in pairs) < _PARALLEL_BYTES:
        for out, src in pairs:
            _copy(out, src)
        return
    jobs = []
    for out, src in pairs:
        axis = _split_axis(src)
        if axis is None or out.nbytes < _PARALLEL_BYTES // count:
            jobs.append((out, src))
            continue
        threads = min(count, _TILED_COPY_THREADS) if _tiled(src) else count
        for start, stop in _ranges(0, out.shape[axis], threads):
            part = (slice(None),) * axis + (slice(start, stop),)
            jobs.append((out[part], src[part]))
    for done in [pool.submit(_copy, out, src) for out, src in jobs]:
        done.result()


def _split_axis(src: np.ndarray) -> int | None:
    """The axis to cut a copy from `src` along for the copy threads: the first of length 2 or more that is not the
    one `src` is contiguous in when it is copied in tiles. Cutting that one would leave each thread's tiles short runs
    of it, so many more of them, each a Python call under the GIL."""
    kept_whole = _contiguous_axis(src) if _tiled(src) else None
    return next((axis for axis in range(src.ndim) if src.shape[axis] > 1 and axis != kept_whole), None)


def _contiguous_axis(src: np.ndarray) -> int:
    return int(np.argmin(np.abs(src.strides))) if src.ndim else 0


def _tiled(src: np.ndarray) -> bool:
    """Whether `_copy` copies from `src` in tiles: a source laid out transposed (HF's [out, in] kernels)."""
    return src.ndim >= 2 and _contiguous_axis(src) != src.ndim - 1


def _copy(out: np.ndarray, src: np.ndarray) -> None:
    """np.copyto(out, src), converting to out's dtype; a source laid out transposed is copied in tiles that fit the
    cache, several times faster than one pass that touches a new cache line of one array per element."""
    if not _tiled(src):
        np.copyto(out, src, casting="unsafe")
        return
    fast = _contiguous_axis(src)
    sides, product = [_TILE_FAST] * src.ndim, 1
    for axis in reversed(range(src.ndim)):
        if axis != fast:
            sides[axis] = max(1, min(src.shape[axis], _TILE // product))
            product *= sides[axis]
    for starts in itertools.product(*(range(0, n, side) for n, side in zip(src.shape, sides, strict=True))):
        tile = tuple(slice(start, start + side) for start, side in zip(starts, sides, strict=True))
        np.copyto(out[tile], src[tile], casting="unsafe")


def _fresh_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array in pages of its own, page-aligned: jax's CPU client adopts a buffer aligned to 64 bytes
    as the device's instead of copying it, so host memory holds each loaded parameter once.

    Mapped directly rather than through np.empty: numpy asks the kernel for transparent huge pages for arrays of 4 MB
    and more, and where THP's defrag setting is "madvise" (a common default) the kernel then compacts memory to serve
    each fault, several times the cost of plain pages.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _NUMPY_HUGE_PAGE_BYTES:  # numpy's own, 64-byte aligned
        raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
        start = -raw.ctypes.data % _ALIGNMENT
        return raw[start : start + nbytes].view(dtype).reshape(shape)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, dtype).reshape(shape)


_ALIGNMENT = 64  # bytes
_NUMPY_HUGE_PAGE_BYTES = 4 << 20  # numpy advises huge pages for arrays from this size on


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


# safetensors dtype -> numpy; bfloat16 (most released Llama, Mistral and Qwen2 weights), which numpy lacks, through
# ml_dtypes.
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


class StoredTensor(LazyLeaf):
    """One tensor of a safetensors file, read when sliced: `tensor[index]` reads the bytes of the rows (outer-axis
    range) of the index and no others.

    Read by byte ranges rather than through safetensors' `safe_open`: its numpy reader has no bfloat16, the dtype
    of most released weights, and it maps the whole file, whose touched pages count as the process's memory until
    the file is closed.
    """

    def __init__(self, file: str, name: str, dtype: np.dtype, shape: tuple[int, ...], offset: int):
        self.file, self.name, self.dtype, self.shape, self.offset = file, name, dtype, shape, offset
        self.row_axis = 0 if shape else None

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        return self.read(index)

    def read(self, index: tuple[slice, ...], buffer: "ReadBuffer | None" = None) -> np.ndarray:
        if not self.shape:
            return self._read(0, 1, buffer).reshape(())
        box = _box(index, self.shape)
        (start, stop), row = box[0], math.prod(self.shape[1:])
        rows = self._read(start * row, (stop - start) * row, buffer).reshape(stop - start, *self.shape[1:])
        return rows[(slice(None), *_slices(box[1:]))]

    def _read(self, first: int, count: int, buffer: "ReadBuffer | None") -> np.ndarray:
        """`count` elements from element `first` on, read from the file (one ranged read of an object in a bucket)
        into `buffer`, or a new array."""
        if storage.is_remote(self.file):
            try:
                data = storage.read_range(
                    self.file, self.offset + first * self.dtype.itemsize, count * self.dtype.itemsize
                )
            except EOFError:
                raise ValueError(
                    f"{self.file} ends inside tensor {self.name}: truncated; download or export it again"
                ) from None
            return np.frombuffer(data, self.dtype)  # read-only: it is only ever copied out
        out = buffer.take(count, self.dtype) if buffer is not None else _fresh_empty((count,), self.dtype)
        view, done = memoryview(out.view(np.uint8)), 0
        with open(self.file, "rb", buffering=0) as f:
            f.seek(self.offset + first * self.dtype.itemsize)
            while done < len(view):
                got = f.readinto(view[done:])
                if not got:
                    raise ValueError(
                        f"{self.file} ends inside tensor {self.name}: truncated; download or export it again"
                    )
                done += got
        return out


# Bytes read from the start of every safetensors file at once: its 8-byte header length and, in the same request, a
# header of up to this size (an HF shard's is tens of KB); a longer header takes a second request, also for all files
# at once (on a bucket each round of requests waits a round trip).
_HEADER_BYTES = 256 << 10


def _read_headers(sizes: Mapping[str, int]) -> dict[str, StoredTensor]:
    """The tensors of the safetensors files or objects of `sizes` ({file: bytes}; 8-byte little-endian header length,
    JSON header, data), from their headers alone, read for all of them together; a truncated or foreign file is a
    ValueError naming it."""
    files, nonempty = list(sizes), [f for f in sizes if sizes[f] > 0]
    first = dict.fromkeys(files, b"")
    starts = storage.read_ranges_of([(f, 0, min(sizes[f], 8 + _HEADER_BYTES)) for f in nonempty])
    first |= zip(nonempty, starts, strict=True)
    lengths = {f: int.from_bytes(first[f][:8], "little") if len(first[f]) >= 8 else 0 for f in files}
    for f in files:
        if not 0 < lengths[f] <= sizes[f] - 8:
            raise _unreadable(f, f"a header of {lengths[f]} bytes in a file of {sizes[f]}")
    longer = [f for f in files if 8 + lengths[f] > len(first[f])]
    rest = {}
    if longer:
        rest = storage.read_ranges_of([(f, len(first[f]), 8 + lengths[f] - len(first[f])) for f in longer])
        rest = dict(zip(longer, rest, strict=True))
    tensors = {}
    for f in files:
        tensors |= _parse_header(f, sizes[f], first[f][8 : 8 + lengths[f]] + rest.get(f, b""))
    return tensors


def _parse_header(file: str, size: int, header_bytes: bytes) -> dict[str, StoredTensor]:
    """The tensors a safetensors header (the JSON after the 8-byte length) of a file of `size` bytes describes."""
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _unreadable(file, f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise _unreadable(file, "its header is not a JSON object")
    header.pop("__metadata__", None)
    unknown = sorted({str(info.get("dtype")) for info in header.values() if isinstance(info, dict)} - set(_DTYPES))
    if unknown:
        raise ValueError(f"{file} holds tensors of dtype {unknown}; lmzoo reads {sorted(_DTYPES)}")
    data_start, tensors = 8 + len(header_bytes), {}
    for name, info in header.items():
        try:
            dtype, shape = np.dtype(_DTYPES[info["dtype"]]), tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise _unreadable(file, f"tensor {name}: {e!r}") from None
        if not (0 <= begin and end - begin == math.prod(shape) * dtype.itemsize and data_start + end <= size):
            raise _unreadable(file, f"tensor {name} of shape {shape} at bytes {begin}..{end} of {size - data_start}")
        tensors[name] = StoredTensor(file, name, dtype, shape, data_start + begin)
    return tensors


def _unreadable(file: str, why: str) -> ValueError:
    return ValueError(
        f"{file} is not a readable safetensors file ({why}): truncated, or another format under that name; "
        "download or export it again"
    )


def _read_json(file: str) -> Any:
    try:
        return json.loads(storage.read_text(file))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); download or export it again") from None


def read_safetensors_dir(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, StoredTensor]]:
    """(config.json dict, state dict of lazy `StoredTensor`s) of an HF checkpoint folder (local, or a bucket prefix:
    gs://, s3://) with single or sharded safetensors weights; only the files' headers are read."""
    folder = os.fspath(storage.path(path))
    files = storage.file_sizes(folder)
    if not files:
        raise FileNotFoundError(f"HF checkpoint folder {folder} does not exist")
    if "config.json" not in files:
        raise FileNotFoundError(
            f"{folder}/config.json not found; an HF checkpoint folder needs config.json next to the weights"
        )
    hf_config = _read_json(f"{folder}/config.json")
    if "model.safetensors" in files:
        return hf_config, _read_headers({f"{folder}/model.safetensors": files["model.safetensors"][0]})
    if "model.safetensors.index.json" in files:
        index = f"{folder}/model.safetensors.index.json"
        weight_map = _read_json(index)["weight_map"]
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if shard not in files:
                raise FileNotFoundError(f"shard {folder}/{shard} listed in {index} not found")
        state_dict = _read_headers({f"{folder}/{shard}": files[shard][0] for shard in shards})
        absent = sorted(set(weight_map) - set(state_dict))
        if absent:
            raise ValueError(f"tensors {absent} listed in {index} are not in their shards")
        return hf_config, state_dict
    pickled = sorted(name for name in files if fnmatch.fnmatch(name, "pytorch_model*.bin"))
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
    return Stacked(subtrees)


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
    """`tree` (per-layer) with every per-layer subtree stacked (lazily: `Stacked` leaves) where `target` holds a
    scanned `layers` subtree."""
    if not isinstance(tree, Mapping) or not isinstance(target, Mapping):
        return tree
    if set(target) == {"layers"} and _is_per_layer(tree):
        tree = {"layers": _stack(*(tree[f"layer_{i}"] for i in range(len(tree))))}
    return {key: to_layout(value, target[key]) if key in target else value for key, value in tree.items()}
