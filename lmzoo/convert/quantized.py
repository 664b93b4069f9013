"""Quantized HF weights dequantized as they are read: lazy leaves that show a quantized tensor as its dense float32
values, reading only the stored bytes behind the box asked for, so a quantized checkpoint streams like a dense one.

MXFP4 (gpt-oss's experts, `Mxfp4`): 32 FP4 E2M1 values a block, two codes a byte, times a power of two per block.

Fine-grained FP8 (quantization_config quant_method "fp8", fmt "e4m3": DeepSeek-V3 as released, Qwen3-*-FP8;
`Fp8Blocks`): a linear weight [out, in] stored as float8_e4m3fn beside weight_scale_inv [ceil(out / b0),
ceil(in / b1)] float32, one scale per b0 x b1 block (weight_block_size [b0, b1], the last blocks partial); the dense
weight is each block times its scale. Layers left unquantized (embeddings, norms, lm_head, routers) have no scale.

Exports are dense float32 without a quantization_config, as every lmzoo export.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from lmzoo.convert import tables
from lmzoo.convert.mapping import LazyLeaf, box_of, slices_of

# The value of each FP4 E2M1 code: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
MXFP4_BLOCK = 32  # values sharing one scale
FP8_SCALE = ".weight_scale_inv"  # X.weight_scale_inv scales X.weight


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 blocks [..., G, 16] uint8 and scales [..., G] uint8 -> float32 [..., G * 32]: byte j of a block holds
    values 2j (low nibble) and 2j + 1 (high nibble), each an E2M1 code times the block's 2 ** (scale - 127)."""
    blocks = np.asarray(blocks, np.uint8)
    values = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponents = np.asarray(scales, np.int32)[..., None] - 127
    return np.ldexp(values, exponents).reshape(*blocks.shape[:-2], -1)


class Mxfp4(LazyLeaf):
    """An expert kernel stored in MXFP4, as the dense HF tensor [E, C, R] (gate_up_proj [E, D, 2F], down_proj
    [E, F, D]): blocks [E, R, C / 32, 16] and scales [E, R, C / 32] of its transpose, dequantized (float32) on read,
    only the experts, rows and blocks of the box asked for."""

    def __init__(self, blocks: Any, scales: Any, name: str):
        e, r, g, width = blocks.shape
        if tuple(scales.shape) != (e, r, g) or width * 2 != MXFP4_BLOCK:
            raise ValueError(
                f"MXFP4 tensor {name}_blocks {tuple(blocks.shape)} and {name}_scales {tuple(scales.shape)} do not "
                f"pair: the blocks are [..., G, {MXFP4_BLOCK // 2}] bytes over scales [..., G]"
            )
        for part, tensor in (("blocks", blocks), ("scales", scales)):
            if np.dtype(tensor.dtype) != np.uint8:
                raise ValueError(f"MXFP4 tensor {name}_{part} has dtype {np.dtype(tensor.dtype)}; expected uint8")
        self.blocks, self.scales = blocks, scales
        self.shape, self.dtype = (e, g * MXFP4_BLOCK, r), np.dtype(np.float32)
        if getattr(blocks, "row_axis", None) == 0:
            self.row_axis = 0

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        (e0, e1), (c0, c1), (r0, r1) = box_of(index, self.shape)
        g0, g1 = c0 // MXFP4_BLOCK, math.ceil(c1 / MXFP4_BLOCK)
        blocks = self.blocks[slice(e0, e1), slice(r0, r1), slice(g0, g1)]
        scales = self.scales[slice(e0, e1), slice(r0, r1), slice(g0, g1)]
        dense = dequantize_mxfp4(blocks, scales)  # [e, r, c] of the transposed kernel
        start = c0 - g0 * MXFP4_BLOCK
        return np.swapaxes(dense, 1, 2)[:, start : start + c1 - c0]

    def from_bucket(self) -> bool:
        return isinstance(self.blocks, LazyLeaf) and self.blocks.from_bucket()


def dequantize_fp8_blocks(
    weight: np.ndarray, scale_inv: np.ndarray, block: Sequence[int], start: Sequence[int] = (0, 0)
) -> np.ndarray:
    """FP8 weight [R, C] (float8_e4m3fn) and its block scales [r, c] -> float32 [R, C]: each weight element times the
    scale of its block of block[0] rows x block[1] columns. `start`: the (row, column) of weight[0, 0] within the
    first block of scale_inv (a box of a larger weight that begins inside a block); (0, 0) for a whole weight, whose
    scale_inv is [ceil(R / block[0]), ceil(C / block[1])]."""
    rows, columns = np.shape(weight)
    row_blocks = (np.arange(rows) + start[0]) // block[0]
    column_blocks = (np.arange(columns) + start[1]) // block[1]
    scales = np.asarray(scale_inv, np.float32)[row_blocks][:, column_blocks]
    return np.asarray(weight).astype(np.float32) * scales


class Fp8Blocks(LazyLeaf):
    """A linear weight stored in fine-grained FP8, as its dense float32 [out, in]: weight [out, in] float8_e4m3fn
    and weight_scale_inv [ceil(out / b0), ceil(in / b1)] (`block` [b0, b1]), dequantized on read, only the rows and
    columns of the box asked for and the scales of their blocks."""

    def __init__(self, weight: Any, scale_inv: Any, block: Sequence[int], name: str):
        expected = tuple(math.ceil(size / side) for size, side in zip(weight.shape, block, strict=True))
        if tuple(scale_inv.shape) != expected:
            raise ValueError(
                f"FP8 tensor {name}.weight {tuple(weight.shape)} and {name}{FP8_SCALE} "
                f"{tuple(scale_inv.shape)} do not pair: blocks of {list(block)} need scales of shape {expected}"
            )
        if np.dtype(weight.dtype) != np.dtype(ml_dtypes.float8_e4m3fn):
            raise ValueError(
                f"FP8 tensor {name}.weight has dtype {np.dtype(weight.dtype)} beside its {name}{FP8_SCALE}; "
                "expected float8_e4m3fn"
            )
        self.weight, self.scale_inv, self.block = weight, scale_inv, tuple(block)
        self.shape, self.dtype = tuple(weight.shape), np.dtype(np.float32)
        if getattr(weight, "row_axis", None) == 0:
            self.row_axis = 0

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        (r0, r1), (c0, c1) = box_of(index, self.shape)
        b0, b1 = self.block
        scale_box = ((r0 // b0, math.ceil(r1 / b0)), (c0 // b1, math.ceil(c1 / b1)))
        weight = self.weight[slice(r0, r1), slice(c0, c1)]
        scale_inv = self.scale_inv[slices_of(scale_box)]
        return dequantize_fp8_blocks(weight, scale_inv, self.block, start=(r0 % b0, c0 % b1))

    def from_bucket(self) -> bool:
        return isinstance(self.weight, LazyLeaf) and self.weight.from_bucket()


def read_fp8_blocks(state_dict: Mapping[str, Any], block: Sequence[int]) -> dict[str, Any]:
    """The state dict with each FP8 pair (X.weight, X.weight_scale_inv) read as X.weight, its dense tensor
    (`Fp8Blocks` of blocks [b0, b1]); nothing is read. A scale without its weight, or of a shape that does not fit
    the weight's blocks, is a ValueError naming the tensor."""
    tensors = dict(state_dict)
    for key in [key for key in tensors if key.endswith(FP8_SCALE)]:
        module = key.removesuffix(FP8_SCALE)
        if module + ".weight" not in tensors:
            raise ValueError(f"FP8 checkpoint has {key} without its {module}.weight")
        tensors[module + ".weight"] = Fp8Blocks(tensors[module + ".weight"], tensors.pop(key), block, module)
    return tensors


# The FP8 form lmzoo reads: quantization_config key -> the value it reads (the key may also be absent).
_FP8_FORM = {"fmt": "e4m3", "activation_scheme": "dynamic"}


def check_quantization(
    hf_config: Mapping[str, Any], model_type: str, methods: Sequence[str] = ("fp8",)
) -> tuple[int, int] | None:
    """Refuses a config.json whose quantization_config lmzoo does not dequantize on load: a quant_method not in
    `methods` (the ones this model type is read in), or FP8 in another form than e4m3 weights in [b0, b1] blocks
    with dynamic activations. Returns FP8's weight_block_size (b0, b1), None for an unquantized config or another
    method."""
    quantization = hf_config.get("quantization_config") or {}
    method = quantization.get("quant_method")
    if method is not None and method not in methods:
        raise tables.ConfigError(
            f"HF {model_type} config has quantization_config.quant_method={method!r}; lmzoo reads {model_type} "
            f"unquantized or with quant_method {' or '.join(map(repr, methods))} (dequantized on load)"
        )
    if method != "fp8":
        return None
    for key, supported in _FP8_FORM.items():
        if quantization.get(key) not in (None, supported):
            raise tables.ConfigError(
                f"HF {model_type} config has quantization_config.{key}={quantization[key]!r}; lmzoo reads FP8 with "
                f"{key} {supported!r}"
            )
    block = quantization.get("weight_block_size")
    if not (isinstance(block, Sequence) and len(block) == 2 and all(isinstance(n, int) and n > 0 for n in block)):
        raise tables.ConfigError(
            f"HF {model_type} config has quantization_config.weight_block_size={block!r}; lmzoo reads FP8 in blocks "
            "of [rows, columns] (e.g. [128, 128]), one scale each"
        )
    return (block[0], block[1])
