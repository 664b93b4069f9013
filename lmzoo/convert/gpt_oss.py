"""HF gpt-oss (model_type gpt_oss, GptOssForCausalLM) <-> lmzoo "llama": what `convert.llama` reads and writes
differently for it.

gpt-oss is the llama decoder with experts (`models.llama`): q/k/v/o biases, a sink logit per head (self_attn.sinks
[N] -> attn/sinks), sliding and full layers 1:1 rotating alike with YaRN, a biased router (mlp.router.weight [E, D],
bias [E] -> router kernel [D, E], bias) and biased experts with a clamped SwiGLU.

Its experts are stored stacked, [in, out] per expert (x @ W, no transpose): mlp.experts.gate_up_proj [E, D, 2F] with
the gate and up columns interleaved (gate = [..., 0::2], up = [..., 1::2]), gate_up_proj_bias [E, 2F], down_proj
[E, F, D], down_proj_bias [E, D]. `split_experts` shows each fused tensor as two (`Interleaved`: gate_proj, up_proj
[E, D, F], gate_proj_bias, up_proj_bias [E, F]) that the llama tables map to wi_0, wi_1 (and their biases) as they are;
`join_experts` interleaves them again for export.

Released checkpoints (openai/gpt-oss-20b, -120b) store the experts' kernels in MXFP4 (quantization_config quant_method
"mxfp4"): down_proj_blocks [E, D, F / 32, 16] uint8 (two FP4 E2M1 codes a byte, the low nibble first) with
down_proj_scales [E, D, F / 32] uint8 (E8M0: the block's power of two plus 127), gate_up_proj likewise [E, 2F, D / 32,
...]: the transposed kernel, 32 values a block. `quantized.Mxfp4` dequantizes them on read (the 16 values of E2M1
times 2 ** (scale - 127), as transformers' `integrations.mxfp4.convert_moe_packed_tensors` does), a range of experts at
a time, so the checkpoint is never held whole; exports are written dense (float32, as every lmzoo export).
"""

from collections.abc import Mapping
from typing import Any

import numpy as np

from lmzoo.convert import tables
from lmzoo.convert.mapping import LazyLeaf, box_of, slices_of
from lmzoo.convert.quantized import Mxfp4

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
# GptOssConfig's defaults for the keys a gpt_oss config.json may leave out.
DEFAULTS = {
    "head_dim": 64,
    "sliding_window": 128,
    "rope_theta": 150_000.0,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "swiglu_alpha": 1.702,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
}
# HF's yarn rope dict when config.json gives none (GptOssConfig.__post_init__).
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
SLIDING, FULL = "sliding_attention", "full_attention"
_FUSED = ("gate_up_proj", "gate_up_proj_bias")
_SPLIT = {"gate_up_proj": ("gate_proj", "up_proj"), "gate_up_proj_bias": ("gate_proj_bias", "up_proj_bias")}


def get(hf_config: Mapping[str, Any], key: str) -> Any:
    """config.json's value of `key`, GptOssConfig's default where it is left out (or null)."""
    value = hf_config.get(key)
    return DEFAULTS[key] if value is None else value


def layer_kinds(hf_config: Mapping[str, Any], num_layers: int) -> list[str]:
    """HF's layer_types, else GptOssConfig's: sliding, full, sliding, ... (layer i slides when i is even)."""
    kinds = list(hf_config.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)])
    unknown = sorted(set(kinds) - {SLIDING, FULL})
    if unknown:
        raise tables.ConfigError(
            f"HF gpt_oss config has layer_types {unknown[0]!r}; lmzoo's llama implements {SLIDING!r} and {FULL!r}"
        )
    if len(kinds) != num_layers:
        raise tables.ConfigError(f"HF gpt_oss config has {len(kinds)} layer_types for num_hidden_layers={num_layers}")
    return kinds


class Interleaved(LazyLeaf):
    """Every `count`-th column of the last axis of a tensor from column `index` on: gate = gate_up[..., 0::2],
    up = gate_up[..., 1::2]. Reads only the rows (and columns) of the box asked for."""

    def __init__(self, tensor: Any, index: int, count: int):
        self.tensor, self.index, self.count = tensor, index, count
        self.shape = (*tensor.shape[:-1], tensor.shape[-1] // count)
        self.dtype = np.dtype(tensor.dtype)
        if getattr(tensor, "row_axis", None) == 0 and len(self.shape) > 1:
            self.row_axis = 0

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        box = box_of(index, self.shape)
        start, stop = box[-1]
        columns = (start * self.count + self.index, max(start, stop - 1) * self.count + self.index + 1)
        block = np.asarray(self.tensor[slices_of((*box[:-1], columns))])
        return block[..., :: self.count][..., : stop - start]

    def from_bucket(self) -> bool:
        return isinstance(self.tensor, LazyLeaf) and self.tensor.from_bucket()


def split_experts(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict with each MXFP4 pair (*_blocks, *_scales) read as its dense tensor (`Mxfp4`) and each fused
    experts.gate_up_proj (and its bias) as gate_proj and up_proj (`Interleaved`); nothing is read."""
    tensors = dict(state_dict)
    for key in [key for key in tensors if key.endswith("_blocks")]:
        name = key.removesuffix("_blocks")
        if name + "_scales" not in tensors:
            raise ValueError(f"gpt-oss checkpoint has MXFP4 {key} without its {name}_scales")
        tensors[name] = Mxfp4(tensors.pop(key), tensors.pop(name + "_scales"), name)
    for key in [key for key in tensors if key.rsplit(".", 1)[-1] in _FUSED and ".experts." in key]:
        module, fused = key.rsplit(".", 1)
        tensor = tensors.pop(key)
        if tensor.shape[-1] % 2:
            raise ValueError(f"gpt-oss tensor {key} {tuple(tensor.shape)}: the gate and up columns need an even width")
        for index, name in enumerate(_SPLIT[fused]):
            tensors[f"{module}.{name}"] = Interleaved(tensor, index, 2)
    return tensors


def join_experts(state_dict: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reverse of `split_experts` on an exported state dict: gate_proj and up_proj interleaved into
    experts.gate_up_proj (and their biases), in the order HF's state dict lists them."""
    out = {}
    for key, value in state_dict.items():
        module, name = key.rsplit(".", 1)
        for fused, (gate, up) in _SPLIT.items():
            if name == gate and ".experts." in key:
                joined = np.empty((*value.shape[:-1], 2 * value.shape[-1]), value.dtype)
                joined[..., 0::2], joined[..., 1::2] = value, state_dict[f"{module}.{up}"]
                out[f"{module}.{fused}"] = joined
                break
            if name == up and ".experts." in key:
                break
        else:
            out[key] = value
    return out
