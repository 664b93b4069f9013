"""Importing HuggingFace checkpoints ("hf:PATH") into a configured lmzoo model; the entry point of the loop.

A checkpoint folder (config.json + safetensors) is opened by its headers and handed to its family's converter
(`FAMILIES`), which gives the config.model fields the checkpoint describes and its parameters as lazy leaves
(nothing read yet). `convert_pretrained` then compares those fields with the target model's config and the
parameters' shapes with the target's tree: any difference is an error naming every differing field and its fix,
unless the caller asks for a partial load, which is reported (loaded, dropped, newly initialised) and printed. A
pretraining head the target does not have (the MLM head of a classifier's backbone) is dropped and reported
without an error. Only then is each parameter read, tensor by tensor, converted once to the target's dtype and
built in the target's sharding (`mapping.place`): host memory never holds the checkpoint whole.

The per-family tables live in gpt2.py, bert.py, seq2seq.py, llama.py, deepseek.py and qwen3_5.py; the mechanism in
tables.py (entries, the validator), safetensors_reader.py (the folder's files) and mapping.py (layer layout and
placement).
"""

import dataclasses
import re
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import flax.linen as nn
import jax

from lmzoo import storage
from lmzoo.convert import bert, deepseek, gpt2, llama, mapping, qwen3_5, safetensors_reader, seq2seq, tables
from lmzoo.convert.seq2seq import t5_config_to_hf, t5_from_hf  # noqa: F401  (used by bench/seq2seq_bench.py)
from lmzoo.convert.tables import Params
from lmzoo.models import make_config

# model_name -> converter module with checkpoint_sources(hf_config, state_dict) -> (config.model fields, lazy params).
FAMILIES: dict[str, ModuleType] = {
    "gpt2": gpt2,
    "bert": bert,
    "seq2seq": seq2seq,
    "llama": llama,
    "deepseek": deepseek,
    "qwen3_5": qwen3_5,
}
# Fields a checkpoint does not fix: regularisation and initialisation (and the weight of an MoE's load-balancing loss)
# do not change a loaded model's function, and head presence (pooler, sentence_head) is checked tensor by tensor (a
# missing head is newly initialised).
UNCOMPARED_FIELDS = frozenset(
    {
        "dropout_rate",
        "attention_dropout_rate",
        "embedding_init_std",
        "init_std",
        "init_scheme",
        "pooler",
        "sentence_head",
        "load_balance_coef",
    }
)


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What an import did, by lmzoo parameter path ("blocks/layer_0/attn/query/kernel")."""

    loaded: tuple[str, ...]  # target parameters taken from the checkpoint
    dropped: tuple[str, ...]  # checkpoint parameters the target does not use (or cannot: other shape)
    initialised: tuple[str, ...]  # target parameters the checkpoint cannot fill: they keep their fresh values
    config_differences: tuple[str, ...]  # "field: checkpoint X, model Y"

    def __str__(self) -> str:
        """One line; paths grouped by their first two components ("blocks/layer_1/* (16)")."""
        return (
            f"loaded {len(self.loaded)} parameters; dropped from the checkpoint: {_summarize(self.dropped)}; "
            f"newly initialised: {_summarize(self.initialised)}; "
            f"config differences: {list(self.config_differences) or 'none'}"
        )


def _summarize(paths: tuple[str, ...]) -> str:
    groups: dict[str, list[str]] = {}
    for path in paths:
        groups.setdefault("/".join(path.split("/")[:2]), []).append(path)
    parts = [members[0] if len(members) == 1 else f"{group}/* ({len(members)})" for group, members in groups.items()]
    return ", ".join(parts) or "none"


def differing_fields(fields: Mapping[str, Any], target_config: Any) -> list[str]:
    """The fields the checkpoint's config fixes (`fields`) that the target config sets otherwise."""

    def comparable(value: Any) -> Any:
        return tuple(value) if isinstance(value, list | tuple) else value

    return [
        field
        for field, value in fields.items()
        if field not in UNCOMPARED_FIELDS and comparable(value) != comparable(getattr(target_config, field))
    ]


# A Hugging Face Hub repository id, ORG/NAME, with an optional @revision (a branch, tag or commit).
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


def resolve_folder(name: str) -> str:
    """The checkpoint folder that `hf:NAME` names: a local folder or bucket prefix as it is; else, for a Hub id
    ORG/NAME[@revision], its snapshot in the local Hugging Face cache (HF_HOME / HF_HUB_CACHE), which is never
    downloaded here. FileNotFoundError, saying how to fetch it, when the id is not cached."""
    if storage.is_remote(name) or storage.exists(name) or not HUB_NAME.fullmatch(name):
        return name
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, _, revision = name.partition("@")
    try:
        return snapshot_download(repo, revision=revision or None, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        fetch = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
        raise FileNotFoundError(
            f"hf:{name} is neither a folder nor in the Hugging Face cache ({constants.HF_HUB_CACHE}); lmzoo does not "
            f"download: fetch it once where there is network (`{fetch} --include '*.json' '*.safetensors'`, then copy "
            "the cache here or set HF_HOME), or pass a folder"
        ) from None


def family_of(model_type: str) -> str | None:
    """The lmzoo family (a key of `FAMILIES`) whose converter reads HF checkpoints of config.json's `model_type`
    (each converter's MODEL_TYPES), or None where none does."""
    return next((family for family, module in FAMILIES.items() if model_type in module.MODEL_TYPES), None)


def _read(spec: str, model_name: str) -> tuple[dict[str, Any], Params]:
    if not spec.startswith("hf:") or spec == "hf:":
        raise ValueError(
            f"unsupported pretrained spec {spec!r}; expected 'hf:PATH' (a folder with config.json and safetensors)"
        )
    if model_name not in FAMILIES:
        raise ValueError(f"no HF converter for model_name {model_name!r}; available: {sorted(FAMILIES)}")
    folder = resolve_folder(spec.removeprefix("hf:"))
    hf_config, tensors = safetensors_reader.read_safetensors_dir(folder)
    model_type = str(hf_config.get("model_type", ""))
    # The architecture names the model type without its underscores (qwen2_moe: Qwen2MoeForCausalLM, qwen3_5_text:
    # Qwen3_5ForCausalLM) and a text model's "_text" (gemma3_text: Gemma3ForCausalLM).
    stem = model_type.lower().removesuffix("_text").replace("_", "")
    disagreeing = [a for a in hf_config.get("architectures") or () if not a.lower().replace("_", "").startswith(stem)]
    if model_type and disagreeing:
        raise ValueError(
            f"{folder}/config.json: architectures {disagreeing} disagree with model_type "
            f"{model_type!r}; correct whichever is wrong (the architecture of a {model_type!r} model starts with {model_type!r})"
        )
    try:
        return FAMILIES[model_name].checkpoint_sources(hf_config, tensors)
    except tables.ConfigError as e:
        raise tables.ConfigError(f"{folder}/config.json: {e}") from None


def checkpoint_fields(spec: str, model_name: str) -> dict[str, Any]:
    """The config.model fields of family `model_name` that checkpoint "hf:PATH" fixes (its config.json, and the heads
    its tensors hold), without UNCOMPARED_FIELDS (regularisation, initialisation, heads: the run's choice). Reads
    config.json and the safetensors headers, no tensor."""
    fields, _ = _read(spec, model_name)
    return {field: value for field, value in fields.items() if field not in UNCOMPARED_FIELDS}


def convert_pretrained(
    spec: str, model_name: str, model_config: Any, target_params: Any, *, allow_partial: bool = False
) -> tuple[Params, LoadReport]:
    """The parameters of checkpoint "hf:PATH" that fit the target, in its layer layout, dtypes and placement, and the
    report.

    model_config: the target's config.model (family dataclass or mapping); target_params: its (boxed or
    unboxed) parameter tree, arrays or ShapeDtypeStructs -- a classifier passes its backbone. A target leaf with a
    sharding (a jax.Array, or a ShapeDtypeStruct given one) gets a jax.Array in that sharding, of which this
    process reads only the shards its devices hold; the others get host numpy arrays. Without
    allow_partial, a config difference or a target parameter the checkpoint cannot fill is an error that
    lists them all; with it, only the parameters that fit are returned (the rest keep their fresh values).
    The report is printed (process 0) and returned.
    """
    fields, params = _read(spec, model_name)
    target_config = model_config if dataclasses.is_dataclass(model_config) else make_config(model_name, model_config)
    target = nn.unbox(target_params)
    found, wanted = mapping.flatten(mapping.to_layout(params, target)), mapping.flatten(target)
    diff = tables.diff_tensors({k: v.shape for k, v in found.items()}, {k: v.shape for k, v in wanted.items()})
    initialised = [*diff.missing, *diff.misshapen]
    differing = differing_fields(fields, target_config)
    report = LoadReport(
        loaded=tuple(path for path in wanted if path not in initialised),
        dropped=tuple([*diff.unexpected, *diff.misshapen]),
        initialised=tuple(initialised),
        config_differences=tuple(
            f"{field}: checkpoint {fields[field]!r}, model {getattr(target_config, field)!r}" for field in differing
        ),
    )
    if not allow_partial and (report.config_differences or report.initialised):
        fix = ", ".join(f"{field}={fields[field]!r}" for field in differing)
        raise ValueError(_mismatch_message(spec, model_name, fields, fix, report, found, wanted))
    if jax.process_index() == 0:
        print(f"{spec} -> {model_name}: {report}")
    loaded = {path: mapping.place(found[path], wanted[path]) for path in report.loaded}
    return _unflatten(loaded), report


def _mismatch_message(
    spec: str,
    model_name: str,
    fields: Mapping[str, Any],
    fix: str,
    report: LoadReport,
    found: Mapping[str, Any],
    wanted: Mapping[str, Any],
) -> str:
    lines = [f"checkpoint {spec!r} does not fit the configured {model_name} model:"]
    for path in report.initialised:
        if path in found:
            lines.append(f"  {path}: checkpoint {tuple(found[path].shape)} vs model {tuple(wanted[path].shape)}")
        else:
            lines.append(f"  {path}: not in the checkpoint (model expects {tuple(wanted[path].shape)})")
    lines += [f"  {difference}" for difference in report.config_differences]
    suggestion = ", ".join(f"{key}: {value!r}" for key, value in fields.items())
    lines.append(f"the checkpoint's HF config corresponds to config.model = {{{suggestion}}}")
    if fix:
        lines.append(f"fix: set config.model {fix}")
    lines.append(
        "or load only what fits with --config.init_from_partial=True (the rest keeps its fresh initialisation)"
    )
    return "\n".join(lines)


def _unflatten(flat: Mapping[str, Any]) -> Params:
    """{"a/b/c": leaf} -> nested dicts."""
    tree: Params = {}
    for path, leaf in flat.items():
        *parents, name = path.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = leaf
    return tree
