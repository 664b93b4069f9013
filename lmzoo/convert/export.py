"""lmzoo checkpoints -> HuggingFace folders (config.json, model.safetensors, tokenizer files) for transformers.

    python -m lmzoo.convert.export --workdir=runs/gpt2 --out=exported/gpt2 [--step=N]

The families with an HF counterpart: gpt2 (GPT2LMHeadModel), bert (BERT / RoBERTa / ALBERT / DistilBERT
*ForMaskedLM, or *ForPreTraining with a sentence head; the model type follows from the config, see
`hf_model_type`) and seq2seq (T5 with relative positions, BART with learned ones; *ForConditionalGeneration).
The weights and config.json come from the per-family tables of gpt2.py, bert.py and seq2seq.py, which
refuse a config HF cannot express. A run's HF tokenizer (GPT-2 BPE, WordPiece, tokenizer.json) is written
as tokenizer.json + tokenizer_config.json that `AutoTokenizer` reads; others (char, byte, word,
sentencepiece) have no HF form and are left out, which `export_hf` reports.
"""

import argparse
import json
import pathlib
from typing import Any

import numpy as np

from lmzoo import tokenizers
from lmzoo.convert import bert, gpt2, seq2seq
from lmzoo.models import make_config

EXPORTABLE = ("gpt2", "bert", "seq2seq")


def hf_model_type(model_name: str, cfg: Any) -> str:
    """The HF model_type of a family config: gpt2; bert, roberta, albert or distilbert; t5 or bart."""
    if model_name == "gpt2":
        return "gpt2"
    if model_name == "seq2seq":
        return "t5" if cfg.positions == "relative" else "bart"
    if model_name == "bert":
        if cfg.share_layers or cfg.embed_projection:
            return "albert"
        if cfg.type_vocab_size == 0:
            return "distilbert"
        return "roberta" if cfg.position_offset > 0 else "bert"
    raise ValueError(f"model_name {model_name!r} has no HF counterpart to export to; exportable families: {EXPORTABLE}")


def to_hf(model_name: str, cfg: Any, params: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config.json dict, state dict) of lmzoo params; raises if the config has no HF equivalent."""
    model_type = hf_model_type(model_name, cfg)
    if "backbone" in params:
        raise ValueError(
            "a classifier checkpoint (params with a 'backbone') has no HF export here; export language-model runs"
        )
    if model_type == "gpt2":
        return gpt2.config_to_hf(cfg), gpt2.to_hf(params, cfg)
    if model_type == "t5":
        return seq2seq.t5_config_to_hf(cfg), seq2seq.t5_to_hf(params, cfg)
    if model_type == "bart":
        return seq2seq.bart_config_to_hf(cfg), seq2seq.bart_to_hf(params, cfg)
    return bert.config_to_hf(cfg, model_type=model_type), bert.to_hf(params, cfg, model_type=model_type)


def save_tokenizer(tokenizer: tokenizers.Tokenizer, out: pathlib.Path) -> bool:
    """Writes tokenizer.json + tokenizer_config.json for an HF tokenizer; False (nothing written) for others."""
    if not isinstance(tokenizer, tokenizers.HFTokenizer):
        return False
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    specials = {f"{role}_token": tokenizer.tokenizer.id_to_token(i) for role, i in tokenizer.special_ids.items()}
    if tokenizer.bos_id is None and tokenizer.eos_id is not None:
        specials["bos_token"] = specials["eos_token"]  # GPT-2: <|endoftext|> is both
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **specials}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return True


def export_hf(
    model_name: str, model_fields: Any, params: Any, out_dir: str, tokenizer: tokenizers.Tokenizer | None = None
) -> dict[str, Any]:
    """Writes an HF folder for `params` of family `model_name` (config.model fields or dataclass) to `out_dir`.

    Returns {"path", "model_type", "tensors", "tokenizer"} (tokenizer: whether tokenizer files were written)."""
    from safetensors.numpy import save_file

    cfg = make_config(model_name, model_fields) if not hasattr(model_fields, "__dataclass_fields__") else model_fields
    hf_config, state_dict = to_hf(model_name, cfg, params)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = {**hf_config, "torch_dtype": "float32"}
    if tokenizer is not None:
        hf_config.update(
            {f"{role}_token_id": i for role, i in tokenizer.special_ids.items() if role in ("eos", "pad", "bos")}
        )
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in state_dict.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    wrote_tokenizer = tokenizer is not None and save_tokenizer(tokenizer, out)
    return {
        "path": str(out),
        "model_type": hf_config["model_type"],
        "tensors": len(state_dict),
        "tokenizer": wrote_tokenizer,
    }


def export_workdir(workdir: str, out_dir: str, step: int | None = None) -> dict[str, Any]:
    """Exports a train.py run's latest (or `step`'s) checkpoint with its tokenizer; adds "step" to the summary."""
    from lmzoo.train import restore

    loaded = restore.load(workdir, step)
    summary = export_hf(
        loaded.config.model_name, loaded.config.model.to_dict(), loaded.params, out_dir, loaded.tokenizer
    )
    return {**summary, "step": loaded.step}


def main() -> None:
    parser = argparse.ArgumentParser(description="Export a train.py run's checkpoint to an HF folder.")
    parser.add_argument("--workdir", required=True, help="Workdir of a train.py run.")
    parser.add_argument("--out", required=True, help="Folder to write the HF checkpoint to.")
    parser.add_argument("--step", type=int, default=None, help="Checkpoint step (default: the latest).")
    args = parser.parse_args()
    try:
        summary = export_workdir(args.workdir, args.out, args.step)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(summary))
    if not summary["tokenizer"]:
        print(
            "note: the run's tokenizer has no HF form (char, byte, word or sentencepiece); no tokenizer files written"
        )


if __name__ == "__main__":
    main()
