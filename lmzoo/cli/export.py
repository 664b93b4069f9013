"""Export a train.py run's checkpoint to a HuggingFace folder that transformers' `from_pretrained` reads.

    python -m lmzoo.cli.export --workdir=runs/gpt2 --out=exported/gpt2 [--step=N]
    python -m lmzoo.cli.export --workdir=runs/sst2 --out=exported/sst2 --labels=negative,positive
    python -m lmzoo.cli.export --workdir=gs://BUCKET/runs/llama --out=gs://BUCKET/exported/llama
    python -m lmzoo.cli.export --workdir=runs/llama_lora --out=exported/adapter --adapters_only   # PEFT's format
    python -m lmzoo.cli.export --workdir=runs/qwen3_next --out=exported/qwen3_next --model_type=qwen3_next

What is exported, and how, is `lmzoo.convert.export`'s; this reads the run. --out must be a new or empty folder;
`--overwrite` replaces a folder's whole contents. A user error exits with status 2 and one `error:` line.
"""

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

import jax

from lmzoo import lora, storage, tokenizers
from lmzoo.convert import export
from lmzoo.data import chat
from lmzoo.lora import peft
from lmzoo.models import heads, make_config
from lmzoo.train import run as run_lib


def export_workdir(
    workdir: str,
    out_dir: str,
    step: int | None = None,
    labels: Sequence[str] | None = None,
    *,
    overwrite: bool = False,
    model_type: str | None = None,
) -> dict[str, Any]:
    """Exports a train.py run's latest (or `step`'s) checkpoint with its tokenizer (an HF tokenizer with its special
    tokens, generation settings and the run's chat template: `export.save_tokenizer`); adds "step" to the summary.
    model_type: the HF model_type to write where the family writes more than one (`export.hf_model_type`).
    A run whose model is a SequenceClassifier exports as one (labels: its class names). `out_dir` is checked
    (`export.check_out_dir`) before the checkpoint is read. Either may be local or in a bucket (gs://, s3://)."""
    export.check_out_dir(
        out_dir, overwrite=overwrite, keep=os.fspath(storage.path(workdir)) if storage.is_remote(workdir) else workdir
    )
    if model_type is not None:  # a model_type the run cannot be written as: said before its params are read
        saved = run_lib.load_saved(workdir)
        export.hf_model_type(saved.model_name, make_config(saved.model_name, saved.model.to_dict()), model_type)
    loaded = run_lib.load(workdir, step)
    params, classifier = export.exported_part(loaded.model, loaded.params)
    template = None  # an HF tokenizer's own template is written with it; a run's own template replaces it
    if isinstance(loaded.tokenizer, tokenizers.HFTokenizer) and loaded.config.objective.get("chat_template"):
        template = chat.run_template(loaded.config, loaded.tokenizer).text
    summary = export.export_hf(
        loaded.config.model_name,
        loaded.config.model.to_dict(),
        params,
        out_dir,
        loaded.tokenizer,
        classifier=classifier,
        labels=labels,
        overwrite=overwrite,
        chat_template=template,
        model_type=model_type,
    )
    if isinstance(loaded.model, heads.LMWithValueHead | heads.LMWithValueModel):
        summary["left_out"] = "the value head or value network (PPO's value estimate)"
    return {**summary, "step": loaded.step}


def export_adapters(workdir: str, out_dir: str, step: int | None = None, *, overwrite: bool = False) -> dict[str, Any]:
    """Writes a LoRA run's adapters alone (config.lora; the latest or `step`'s checkpoint) as a PEFT adapter folder,
    which `peft.PeftModel.from_pretrained` loads onto the HF export of the run's base (`config.init_from`)."""
    export.check_out_dir(out_dir, overwrite=overwrite)
    run = run_lib.open_run(os.fspath(storage.path(workdir)), batches=False)
    try:
        adapted = lora.from_config(run.config)
        if adapted is None:
            raise ValueError(
                f"--adapters_only: {workdir} is not a LoRA run (config.lora.targets is empty); export the model whole"
            )
        step, state = run_lib.restore_step(run, step, frozen=False)
        adapters = jax.device_get(state.params)
    finally:
        run.close()
    base = run.config.init_from.removeprefix("hf:") if run.config.init_from.startswith("hf:") else None
    summary = peft.save_peft(
        out_dir, adapters, adapted, run.config.model_name, run.config.model.to_dict(), base_model_name_or_path=base
    )
    return {**summary, "step": step}


def main() -> None:
    parser = argparse.ArgumentParser(description="Export a train.py run's checkpoint to an HF folder.")
    parser.add_argument("--workdir", required=True, help="Workdir of a train.py run.")
    parser.add_argument("--out", required=True, help="Folder to write the HF checkpoint to.")
    parser.add_argument("--step", type=int, default=None, help="Checkpoint step (default: the latest).")
    parser.add_argument("--labels", default=None, help="A classifier's class names, comma-separated (id2label).")
    parser.add_argument("--overwrite", action="store_true", help="Replace the contents of a non-empty --out folder.")
    parser.add_argument(
        "--model_type",
        default=None,
        help="The HF model_type to write where the run's family writes more than one (qwen3_next for a Qwen3.5).",
    )
    parser.add_argument(
        "--adapters_only",
        action="store_true",
        help="A LoRA run's adapters alone, in PEFT's format (adapter_config.json).",
    )
    args = parser.parse_args()
    if args.adapters_only:
        with run_lib.user_errors():
            print(json.dumps(export_adapters(args.workdir, args.out, args.step, overwrite=args.overwrite)))
        return
    with run_lib.user_errors():
        summary = export_workdir(
            args.workdir,
            args.out,
            args.step,
            args.labels.split(",") if args.labels else None,
            overwrite=args.overwrite,
            model_type=args.model_type,
        )
    print(json.dumps(summary))
    if not summary["tokenizer"]:
        print(
            "note: the run's tokenizer has no HF form (char, byte, word or sentencepiece); no tokenizer files written"
        )


if __name__ == "__main__":
    main()
