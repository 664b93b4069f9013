"""Converted parameters onto the target model: its layer layout, and each leaf placed in the target's dtype and
sharding.

The leaves of a converted tree are numpy arrays or `LazyLeaf`s, which compute any box of the leaf from the stored rows
behind it: an HF tensor as an lmzoo leaf (`tables.Converted`), one tensor of a safetensors file
(`safetensors_reader.StoredTensor`), or leaves stacked along a new leading axis (`Stacked`: the scanned layer layout,
which `to_layout` gives a per-layer tree where the target scans its layers, and a MoE layer's experts). `to_layout`
also splits a scanned stack into its layers (`unstack_layers`) where the target has them one by one, so a tree of
either layout (HF's per-layer tensors, a checkpoint of either `scan_layers`) takes the target's. What placement needs
of a leaf it asks the leaf (`LazyLeaf.stacked_layers`, `relayout_leaf`, `from_bucket`), so this module knows no
concrete kind of leaf.

`place` builds each parameter in its target's dtype and sharding: the tensor is read once for all the shards this
process's devices hold, in pieces (a scanned leaf's layers, a large tensor's ranges of rows), each read on a thread of
its own while the one before is copied out. On CPU devices the pieces go straight into the shards' host blocks, which
the CPU client adopts as the device buffers; beyond the parameters, host memory holds two pieces being read and
copied (a layer's tensor, or about _ROWS_PIECE_BYTES of rows) and the blocks of the one parameter being built. On
accelerators each piece is put, as stored, on the devices whose blocks it meets, and transposed, reshaped, cast and
written into its place there (`Relayout`, the same steps a host read takes), so the host only reads, each byte once for
all its devices, and holds two pieces whatever the model's size.
"""

import collections
import concurrent.futures
import functools
import itertools
import math
import mmap
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

# A box of an array: (start, stop) per axis.
Box = tuple[tuple[int, int], ...]


def box_of(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
    """The box a tuple of step-1 slices (a shard's index, shorter than `shape` for whole trailing axes) selects."""
    index = (*index, *[slice(None)] * (len(shape) - len(index)))
    return tuple(part.indices(size)[:2] for part, size in zip(index, shape, strict=True))


def slices_of(box: Box) -> tuple[slice, ...]:
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

    def stacked_layers(self) -> Sequence[Any] | None:
        """The leaves (lazy or arrays) this one stacks along a new leading axis, read one at a time (`Stacked`: a
        scanned layer stack, a layer's experts); None for a leaf read as one tensor."""
        return None

    def relayout_leaf(self, box: Box) -> "tuple[LazyLeaf, Box] | None":
        """(the leaf `box` of this one lies in that reads it as a `Relayout` of a box of one stored tensor, which
        `locate` names and `read_stored` reads (`tables.Converted`); the box within that leaf), or None where none
        does."""
        return None

    def from_bucket(self) -> bool:
        """Whether the bytes behind this leaf are read from a bucket (gs://, s3://)."""
        return False


class Relayout(NamedTuple):
    """How a block of an HF tensor becomes a box of an lmzoo leaf: transposed (every axis reversed, for [out, in]
    kernels), reshaped to `shape` (splitting axes), then sliced to `inner` ((start, stop) of each axis; None keeps
    one whole), and `offset` added in float32 (Gemma's norm weights, which HF applies as 1 + w). Numpy and jax arrays
    take it alike: a view on the host (a float32 copy with an offset), or on an accelerator a computation there."""

    transpose: bool
    shape: tuple[int, ...]
    inner: tuple[tuple[int, int] | None, ...]
    offset: float = 0.0

    def apply(self, block: Any) -> Any:
        block = block.T if self.transpose else block
        block = block.reshape(self.shape)[tuple(slice(None) if part is None else slice(*part) for part in self.inner)]
        return block.astype(np.float32) + np.float32(self.offset) if self.offset else block


class Stacked(LazyLeaf):
    """One leaf of every layer stacked along a new leading [L] axis (a scanned layer stack), read layer by layer."""

    def __init__(self, layers: Sequence[Any]):
        self.layers = list(layers)
        self.shape, self.dtype = (len(self.layers), *layers[0].shape), np.dtype(layers[0].dtype)

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        box = box_of(index, self.shape)
        return np.stack([layer[slices_of(box[1:])] for layer in self.layers[slice(*box[0])]])

    def stacked_layers(self) -> Sequence[Any]:
        return self.layers

    def relayout_leaf(self, box: Box) -> "tuple[LazyLeaf, Box] | None":
        """One layer's (`box` one layer long, the layer a lazy leaf), else None."""
        start, stop = box[0]
        if stop - start != 1:
            return None
        layer = self.layers[start]
        return layer.relayout_leaf(box[1:]) if isinstance(layer, LazyLeaf) else None

    def from_bucket(self) -> bool:
        return isinstance(self.layers[0], LazyLeaf) and self.layers[0].from_bucket()


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


def unstack_layers(tree: Any, take: Callable[[Any, int], Any] | None = None) -> Any:
    """`tree` with every scanned {"layers": [L, ...] leaves} subtree split into {"layer_0": ..., ...}: layer i of a
    leaf is `take(leaf, i)`, by default leaf[i] read into a numpy array."""
    if not isinstance(tree, Mapping):
        return tree
    if set(tree) == {"layers"}:
        stacked = tree["layers"]
        num_layers = len(next(iter(flatten(stacked).values())))
        return {f"layer_{i}": _layer(stacked, i, take or _host_layer) for i in range(num_layers)}
    return {key: unstack_layers(value, take) for key, value in tree.items()}


def _host_layer(leaf: Any, i: int) -> np.ndarray:
    return np.asarray(leaf[i])


def _layer(stacked: Any, i: int, take: Callable[[Any, int], Any]) -> Any:
    """Layer `i` of a tree whose leaves have a leading [L] axis."""
    if isinstance(stacked, Mapping):
        return {key: _layer(value, i, take) for key, value in stacked.items()}
    return take(stacked, i)


def to_layout(tree: Any, target: Any) -> Any:
    """`tree` in `target`'s layer layout: every per-layer subtree stacked (lazily: `Stacked` leaves) where `target`
    holds a scanned `layers` subtree, and every scanned subtree split into its layers (`unstack_layers`) where
    `target` holds them one by one; the rest as it is."""
    if not isinstance(tree, Mapping) or not isinstance(target, Mapping):
        return tree
    if set(target) == {"layers"} and _is_per_layer(tree):
        tree = {"layers": _stack(*(tree[f"layer_{i}"] for i in range(len(tree))))}
    elif set(tree) == {"layers"} and _is_per_layer(target):
        tree = unstack_layers(tree)
    return {key: to_layout(value, target[key]) if key in target else value for key, value in tree.items()}


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
    boxes = {box_of(index, shape) for index in sharding.addressable_devices_indices_map(shape).values()}
    blocks = {box: fresh_empty(_sizes(box), dtype) for box in boxes}
    _fill(source, list(blocks.items()), ReadBuffer())
    return jax.make_array_from_callback(shape, sharding, lambda index: blocks[box_of(index, shape)])


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
        holders.setdefault(box_of(index, shape), []).append(device)
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
    ahead = all(_relayout_leaf(source, piece) is not None for piece, _ in reads)
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
    behind = _relayout_leaf(source, piece)
    if behind is None:
        host = staging.take(math.prod(_sizes(piece)), dtype).reshape(_sizes(piece))
        _fill(source, [(piece, host)], buffer)
        return [(box, overlap, host[slices_of(_within(overlap, piece))], None) for box, overlap in overlaps]
    leaf, leaf_piece = behind
    stored_piece, _ = leaf.locate(leaf_piece)
    raw = leaf.read_stored(stored_piece, buffer)
    parts = []
    for box, overlap in overlaps:
        stored, relayout = leaf.locate(_relayout_leaf(source, overlap)[1])
        parts.append((box, overlap, raw[slices_of(_within(stored, stored_piece))], relayout))
    return parts


def _relayout_leaf(source: Any, box: Box) -> tuple[LazyLeaf, Box] | None:
    """(the leaf `box` of `source` lies in that reads it as a relayout of a stored box, the box within it:
    `LazyLeaf.relayout_leaf`); None for an array, any other leaf, or a tensor the accelerator does not cast."""
    found = source.relayout_leaf(box) if isinstance(source, LazyLeaf) else None
    return found if found is not None and found[0].dtype in _DEVICE_CAST_DTYPES else None


def _layers(source: Any) -> Sequence[Any] | None:
    """The leaves `source` stacks, read one at a time (`LazyLeaf.stacked_layers`); None for an array or a leaf read
    as one tensor."""
    return source.stacked_layers() if isinstance(source, LazyLeaf) else None


def _piece_boxes(source: Any, box: Box, dtype: np.dtype) -> list[Box]:
    """`box` cut into the pieces an accelerator's blocks are put together from: a scanned leaf's layers one by one,
    each cut as its layer's leaf is; a tensor of more than _ROWS_PIECE_BYTES (as `dtype`) in ranges of its rows of
    about that many bytes, else whole."""
    layers = _layers(source)
    if layers is not None:
        return [
            ((layer, layer + 1), *inner)
            for layer in range(*box[0])
            for inner in _piece_boxes(layers[layer], box[1:], dtype)
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
    out = fresh_empty(tuple(source.shape), dtype)
    _fill(source, [(box_of((), out.shape), out)], ReadBuffer())
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
            self.pages = fresh_empty((nbytes,), np.dtype(np.uint8))
        return self.pages[:nbytes].view(dtype)


def _fill(source: Any, parts: Sequence[tuple[Box, np.ndarray]], buffer: ReadBuffer) -> None:
    """Writes into each (box, out) of `parts` that box of `source`, converted to out's dtype; `source` is read once
    (into `buffer`) for all of them over the box that bounds theirs, in pieces each read while the one before is
    copied out: a stacked leaf layer by layer, a large tensor by ranges of its rows."""
    layers = _layers(source)
    if layers is None:
        _read_while_copying([(source, piece) for piece in _row_pieces(source, parts)], buffer)
        return
    reads = []
    for layer, layer_source in enumerate(layers):
        inside = [(box[1:], out[layer - box[0][0]]) for box, out in parts if box[0][0] <= layer < box[0][1]]
        if inside:
            reads.append((layer_source, inside))
    if any(_layers(layer_source) is not None for layer_source, _ in reads):  # stacked twice (experts): in turn
        for layer_source, inside in reads:
            _fill(layer_source, inside, buffer)
        return
    _read_while_copying(reads, buffer)


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
    """Whether `source` is a lazy leaf read from a bucket (gs://, s3://: `LazyLeaf.from_bucket`)."""
    return isinstance(source, LazyLeaf) and source.from_bucket()


def _read_for(
    source: Any, parts: Sequence[tuple[Box, np.ndarray]], buffer: ReadBuffer
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(out, source's block for out's box) of each (box, out) of `parts`, `source` read once (into `buffer`) over the
    box that bounds theirs."""
    bounds = tuple(
        (min(box[axis][0] for box, _ in parts), max(box[axis][1] for box, _ in parts))
        for axis in range(len(source.shape))
    )
    block = source.read(slices_of(bounds), buffer) if isinstance(source, LazyLeaf) else source[slices_of(bounds)]
    pairs = []
    for box, out in parts:
        pairs.append((out, block[slices_of(_within(box, bounds))]))
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


def fresh_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
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
