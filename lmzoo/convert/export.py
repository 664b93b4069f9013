"""lmzoo parameters -> HuggingFace folders (config.json, model.safetensors, tokenizer files) for transformers.

The command line, which reads a train.py run's checkpoint, is `python -m lmzoo.cli.export` (`lmzoo.cli.export`).

The families with an HF counterpart: gpt2 (GPT2LMHeadModel), bert (BERT / RoBERTa / ALBERT / DistilBERT
*ForMaskedLM, or *ForPreTraining with a sentence head; the model type follows from the config, see
`hf_model_type`), seq2seq (T5 with relative positions, BART with learned ones; *ForConditionalGeneration),
llama (LlamaForCausalLM; MistralForCausalLM with a sliding window; Qwen2ForCausalLM with q/k/v biases; with experts,
Qwen2MoeForCausalLM with a shared expert, else MixtralForCausalLM), deepseek (DeepseekV3ForCausalLM) and qwen3_5
(Qwen3_5ForCausalLM; Qwen3_5MoeForCausalLM with experts).
Sequence classifiers (`classify` runs, reward models) export to *ForSequenceClassification when their head
is the one HF builds: BERT/ALBERT "pooler", RoBERTa "dense_tanh" and DistilBERT "dense_relu" on the first
token, GPT-2 "linear" on the last real token (`pad_token_id` from the tokenizer); num_labels and
id2label (`--labels`, default LABEL_0, LABEL_1, ...) go to config.json. A PPO policy exports its decoder as
the language model (its value head or separate value network is left out).
The weights and config.json come from the per-family tables of gpt2.py, bert.py, seq2seq.py, llama.py, deepseek.py
and qwen3_5.py, which refuse a config HF cannot express. A run's HF tokenizer (GPT-2 BPE, WordPiece, tokenizer.json)
is written as tokenizer.json + tokenizer_config.json that `AutoTokenizer` reads, with the special tokens, chat
template and generation settings (generation_config.json: every eos id, pad) of the checkpoint it came from, so that
`apply_chat_template` and `generate` work on the export as on that checkpoint (`save_tokenizer`); others (char, byte,
word, sentencepiece) have no HF form and are left out, which `export_hf` reports. Tensors are written in float32
(config.json `torch_dtype` "float32") whatever the run's param_dtype: bfloat16 params are upcast exactly.

--out must be a new or empty folder; `--overwrite` replaces a folder's whole contents (no file of an earlier
export is left beside the new one). The folder is written beside --out and moved into place once complete, so
a failed export leaves --out as it was. A user error exits with status 2 and one `error:` line.
"""

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from lmzoo import storage, tokenizers
from lmzoo.convert import bert, deepseek, gpt2, llama, qwen3_5, seq2seq
from lmzoo.models import heads, make_config

EXPORTABLE = ("gpt2", "bert", "seq2seq", "llama", "deepseek", "qwen3_5")


def hf_model_type(model_name: str, cfg: Any, model_type: str | None = None) -> str:
    """The HF model_type of a family config: gpt2; bert, roberta, albert or distilbert; t5 or bart; llama,
    mistral, qwen2, mixtral or qwen2_moe; deepseek_v3; qwen3_5_text or qwen3_5_moe_text (qwen3_next: `model_type`,
    or experts whose weights are not renormalised). `model_type`: the one asked for, where the family writes more
    than one for this config (a Qwen3.5 as Qwen3-Next); any other than the config's own is refused."""
    if model_type is not None and model_name == "qwen3_5":
        return qwen3_5.hf_model_type(cfg, model_type)
    own = _own_model_type(model_name, cfg)
    if model_type not in (None, own):
        raise ValueError(f"a {model_name} of this config exports to HF model_type {own!r}, not {model_type!r}")
    return own


def _own_model_type(model_name: str, cfg: Any) -> str:
    if model_name == "gpt2":
        return "gpt2"
    if model_name == "llama":
        return llama.hf_model_type(cfg)
    if model_name == "deepseek":
        return deepseek.MODEL_TYPE
    if model_name == "qwen3_5":
        return qwen3_5.hf_model_type(cfg)
    if model_name == "seq2seq":
        return "t5" if cfg.positions == "relative" else "bart"
    if model_name == "bert":
        if cfg.share_layers or cfg.embed_projection:
            return "albert"
        if cfg.type_vocab_size == 0:
            return "distilbert"
        return "roberta" if cfg.position_offset > 0 else "bert"
    raise ValueError(f"model_name {model_name!r} has no HF counterpart to export to; exportable families: {EXPORTABLE}")


def classifier_to_hf(
    model_type: str, cfg: Any, params: Any, classifier: heads.SequenceClassifier
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config.json dict without labels, state dict) of a SequenceClassifier's params; raises unless its head and
    pooling are those of the HF *ForSequenceClassification of `model_type`."""
    hf_heads = {"gpt2": ("linear", "last"), **{kind: (head, "first") for kind, head in bert.CLASSIFIER_HEADS.items()}}
    hf_head = hf_heads.get(model_type)
    ours = (classifier.head, "first" if classifier.head == "pooler" else classifier.pooling)
    if hf_head is None or ours != hf_head:
        supported = "none" if hf_head is None else f"head={hf_head[0]!r}, pooling={hf_head[1]!r}"
        raise ValueError(
            f"a {model_type} classifier with head={ours[0]!r}, pooling={ours[1]!r} has no HF "
            f"*ForSequenceClassification equivalent; that class reads {supported}"
        )
    if model_type == "gpt2":
        return gpt2.classifier_to_hf(params, cfg)
    return bert.classifier_to_hf(params, cfg, model_type=model_type)


def to_hf(
    model_name: str,
    cfg: Any,
    params: Any,
    classifier: heads.SequenceClassifier | None = None,
    model_type: str | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config.json dict, state dict) of lmzoo params, of a language model or, given the SequenceClassifier they
    belong to, of that classifier; raises if the config has no HF equivalent. model_type: `hf_model_type`'s."""
    model_type = hf_model_type(model_name, cfg, model_type)
    if classifier is not None:
        return classifier_to_hf(model_type, cfg, params, classifier)
    if "backbone" in params:
        raise ValueError("params with a 'backbone' belong to a task head: pass the SequenceClassifier they belong to")
    if model_type == "gpt2":
        return gpt2.config_to_hf(cfg), gpt2.to_hf(params, cfg)
    if model_type in llama.ARCHITECTURES:
        return llama.config_to_hf(cfg), llama.to_hf(params, cfg)
    if model_type == deepseek.MODEL_TYPE:
        return deepseek.config_to_hf(cfg), deepseek.to_hf(params, cfg)
    if model_type in qwen3_5.ARCHITECTURES:
        return qwen3_5.config_to_hf(cfg, model_type), qwen3_5.to_hf(params, cfg, model_type)
    if model_type == "t5":
        return seq2seq.t5_config_to_hf(cfg), seq2seq.t5_to_hf(params, cfg)
    if model_type == "bart":
        return seq2seq.bart_config_to_hf(cfg), seq2seq.bart_to_hf(params, cfg)
    return bert.config_to_hf(cfg, model_type=model_type), bert.to_hf(params, cfg, model_type=model_type)


def check_out_dir(out_dir: str, *, overwrite: bool = False, keep: str | None = None) -> pathlib.Path | str:
    """The absolute --out folder (a bucket prefix as it is); raises unless it is new or empty (any folder with
    `overwrite`), its parent writable, and it does not hold `keep` (the run being exported), which replacing it would
    delete."""
    if storage.is_remote(out_dir):
        out = os.fspath(storage.path(out_dir)).rstrip("/")
        try:
            entries = storage.list_dir(out)
        except FileNotFoundError:
            entries = []
        if entries and not overwrite:
            raise FileExistsError(
                f"--out={out_dir} is not empty ({len(entries)} entries: {', '.join(entries[:3])}"
                f"{', ...' if len(entries) > 3 else ''}); pass --overwrite to replace its contents, or a new prefix"
            )
        if keep is not None and (os.fspath(keep).rstrip("/") + "/").startswith(out + "/"):
            raise ValueError(f"--out={out_dir} holds the run's workdir {keep}; export to a prefix outside it")
        return out
    out = pathlib.Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out={out_dir} is a file, not a folder; pass a new folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not overwrite:
        raise FileExistsError(
            f"--out={out_dir} is not empty ({len(entries)} entries: {', '.join(entries[:3])}"
            f"{', ...' if len(entries) > 3 else ''}); pass --overwrite to replace its contents, or a new folder"
        )
    if keep is not None and pathlib.Path(keep).expanduser().absolute().is_relative_to(out):
        raise ValueError(f"--out={out_dir} holds the run's workdir {keep}; export to a folder outside it")
    parent = next(p for p in out.parents if p.exists())
    if not os.access(parent, os.W_OK) or (out.is_dir() and not os.access(out, os.W_OK)):
        raise PermissionError(f"--out={out_dir}: {parent if not os.access(parent, os.W_OK) else out} is read-only")
    return out


def _replace_prefix(out: str, write) -> None:
    """Calls `write(folder)` on a local staging folder, then uploads its files below the bucket prefix `out`, the
    weights first and config.json last (a reader that finds config.json finds the rest), and deletes what `out` held
    besides them. A bucket has no folder rename: a reader during an --overwrite may see old and new files together."""
    with tempfile.TemporaryDirectory(prefix="lmzoo-export-") as local:
        write(pathlib.Path(local))
        names = sorted(os.listdir(local), key=lambda name: (name == "config.json", name))
        for name in names:
            storage.upload(os.path.join(local, name), f"{out}/{name}")
    files = storage.file_sizes(out)
    for name in set(storage.list_dir(out)) - set(names):
        storage.delete(f"{out}/{name}") if name in files else storage.delete_tree(f"{out}/{name}")


def _replace_folder(out: pathlib.Path, write) -> None:
    """Calls `write(folder)` on a new folder beside `out`, then puts it in place of `out` (whose old contents go)."""
    staging, replaced = out.with_name(f".{out.name}.partial"), out.with_name(f".{out.name}.replaced")
    for leftover in (staging, replaced):
        if leftover.exists():
            shutil.rmtree(leftover)
    staging.mkdir(parents=True)
    try:
        write(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        out.rename(replaced)
        staging.rename(out)
        shutil.rmtree(replaced)
    else:
        staging.rename(out)


def _file_mode() -> int:
    """The mode a new file gets under this process's umask (0644 under the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def generation_ids(tokenizer: tokenizers.Tokenizer) -> dict[str, Any]:
    """bos_token_id, eos_token_id (a list where the tokenizer ends a generation at several ids) and pad_token_id, as
    generation_config.json holds them (a role the tokenizer lacks is left out)."""
    eos = list(tokenizer.eos_ids)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos if len(eos) > 1 else tokenizer.eos_id}
    return {key: value for key, value in {**ids, "pad_token_id": tokenizer.pad_id}.items() if value is not None}


def save_tokenizer(tokenizer: tokenizers.Tokenizer, out: pathlib.Path, chat_template: str | None = None) -> bool:
    """Writes an HF tokenizer as transformers' `AutoTokenizer` and `generate` read it: tokenizer.json,
    tokenizer_config.json (the checkpoint's, when the tokenizer came with one, with its special tokens: bos, eos, pad,
    ...), special_tokens_map.json, generation_config.json (the checkpoint's settings, its eos ids, all of them, and pad)
    and the chat template (`chat_template`, the run's, else the one the tokenizer came with) as chat_template.jinja.
    False (nothing written) for other tokenizers."""
    if not isinstance(tokenizer, tokenizers.HFTokenizer):
        return False
    files = tokenizer.files
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    specials = {f"{role}_token": tokenizer.tokenizer.id_to_token(i) for role, i in tokenizer.special_ids.items()}
    if tokenizer.bos_id is None and tokenizer.eos_id is not None and not files:
        specials["bos_token"] = specials["eos_token"]  # GPT-2 built here: <|endoftext|> is both
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **(files.get(tokenizers.TOKENIZER_CONFIG) or {}),
        **specials,
    }
    template = chat_template or tokenizer.chat_template
    if template is not None:
        config.pop("chat_template", None)  # chat_template.jinja holds it, as transformers 5 saves it
        (out / tokenizers.CHAT_TEMPLATE).write_text(template)
    (out / tokenizers.TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / tokenizers.SPECIAL_TOKENS_MAP).write_text(json.dumps(specials, indent=2, ensure_ascii=False) + "\n")
    generation = {**(files.get(tokenizers.GENERATION_CONFIG) or {}), **generation_ids(tokenizer)}
    (out / tokenizers.GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    return True


def export_hf(
    model_name: str,
    model_fields: Any,
    params: Any,
    out_dir: str,
    tokenizer: tokenizers.Tokenizer | None = None,
    *,
    classifier: heads.SequenceClassifier | None = None,
    labels: Sequence[str] | None = None,
    overwrite: bool = False,
    chat_template: str | None = None,
    model_type: str | None = None,
) -> dict[str, Any]:
    """Writes an HF folder for `params` of family `model_name` (config.model fields or dataclass) to `out_dir`,
    a new or empty folder (with `overwrite`, any folder: its contents are replaced; see `check_out_dir`).

    classifier: the SequenceClassifier `params` belong to (a *ForSequenceClassification export); labels: its
    class names (default LABEL_0, LABEL_1, ...). chat_template: the run's (written with an HF tokenizer; default the
    one the tokenizer came with, `save_tokenizer`). model_type: the HF model_type to write where the family writes
    more than one for this config (`hf_model_type`: a Qwen3.5 as qwen3_next). Returns {"path", "model_type", "architecture", "tensors",
    "tokenizer"} (tokenizer: whether tokenizer files were written), plus "labels" for a classifier."""
    from safetensors.numpy import save_file

    cfg = make_config(model_name, model_fields) if not hasattr(model_fields, "__dataclass_fields__") else model_fields
    if labels is not None and (classifier is None or len(labels) != classifier.num_classes):
        raise ValueError(
            f"--labels gives {len(labels)} names; the run's classifier has "
            f"{'no' if classifier is None else classifier.num_classes} classes"
        )
    hf_model_type(model_name, cfg, model_type)  # a model_type the config cannot be written as: before the folder
    out = check_out_dir(out_dir, overwrite=overwrite)
    hf_config, state_dict = to_hf(model_name, cfg, params, classifier, model_type)
    hf_config = {**hf_config, "torch_dtype": "float32"}
    if classifier is not None:
        labels = list(labels or (f"LABEL_{i}" for i in range(classifier.num_classes)))
        hf_config |= {"id2label": dict(enumerate(labels)), "label2id": {name: i for i, name in enumerate(labels)}}
    if tokenizer is not None:
        hf_config.update(
            {f"{role}_token_id": i for role, i in tokenizer.special_ids.items() if role in ("eos", "pad", "bos")}
        )
        if tokenizer.bos_id is None and tokenizer.eos_id is not None and not getattr(tokenizer, "files", None):
            hf_config["bos_token_id"] = tokenizer.eos_id  # as save_tokenizer's bos_token (GPT-2: <|endoftext|>)
    wrote_tokenizer = False

    def write(folder: pathlib.Path) -> None:
        nonlocal wrote_tokenizer
        (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        weights = folder / "model.safetensors"
        save_file(
            {k: np.ascontiguousarray(v, np.float32) for k, v in state_dict.items()},
            str(weights),
            metadata={"format": "pt"},
        )
        weights.chmod(_file_mode())  # safetensors creates it 0600
        wrote_tokenizer = tokenizer is not None and save_tokenizer(tokenizer, folder, chat_template)

    _replace_prefix(out, write) if isinstance(out, str) else _replace_folder(out, write)
    summary = {
        "path": str(out),
        "model_type": hf_config["model_type"],
        "architecture": hf_config["architectures"][0],
        "tensors": len(state_dict),
        "tokenizer": wrote_tokenizer,
    }
    return summary if classifier is None else {**summary, "labels": labels}


def exported_part(model: Any, params: Any) -> tuple[Any, heads.SequenceClassifier | None]:
    """(params to export, the SequenceClassifier they belong to or None) of a run's model: a classifier as
    itself, a PPO policy (LMWithValueHead, LMWithValueModel) as its decoder language model, a family model as it is."""
    if isinstance(model, heads.SequenceClassifier):
        return params, model
    if isinstance(model, heads.LMWithValueHead | heads.LMWithValueModel):
        return params["decoder"], None
    return params, None
