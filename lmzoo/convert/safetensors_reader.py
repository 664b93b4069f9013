"""HF checkpoint folders read lazily: config.json, and each tensor of the safetensors files a `StoredTensor` read by
byte ranges when sliced; opening a folder reads the files' headers alone (`read_safetensors_dir`), on a bucket all in
one round of requests.

Weights are read only from safetensors files (float32, float16 or bfloat16; FP8 E4M3 with its block scales, which
`convert.quantized.Fp8Blocks` dequantizes): pickled `pytorch_model.bin` checkpoints are refused, because unpickling
can run arbitrary code.
"""

import fnmatch
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from lmzoo import storage
from lmzoo.convert.mapping import LazyLeaf, ReadBuffer, box_of, fresh_empty, slices_of

# safetensors dtype -> numpy; bfloat16 (most released Llama, Mistral and Qwen2 weights) and float8 E4M3 (fine-grained
# FP8 weights: DeepSeek-V3, Qwen3-*-FP8), which numpy lacks, through ml_dtypes.
_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
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

    def read(self, index: tuple[slice, ...], buffer: ReadBuffer | None = None) -> np.ndarray:
        if not self.shape:
            return self._read(0, 1, buffer).reshape(())
        box = box_of(index, self.shape)
        (start, stop), row = box[0], math.prod(self.shape[1:])
        rows = self._read(start * row, (stop - start) * row, buffer).reshape(stop - start, *self.shape[1:])
        return rows[(slice(None), *slices_of(box[1:]))]

    def from_bucket(self) -> bool:
        return storage.is_remote(self.file)

    def _read(self, first: int, count: int, buffer: ReadBuffer | None) -> np.ndarray:
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
        out = buffer.take(count, self.dtype) if buffer is not None else fresh_empty((count,), self.dtype)
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
