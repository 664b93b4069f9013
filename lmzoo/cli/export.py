"""Export a train.py run's checkpoint to a HuggingFace folder that transformers' `from_pretrained` reads.

    python -m lmzoo.cli.export --workdir=runs/gpt2 --out=exported/gpt2 [--step=N]
    python -m lmzoo.cli.export --workdir=runs/sst2 --out=exported/sst2 --labels=negative,positive

What is exported, and how, is `lmzoo.convert.export`'s; this reads the run. --out must be a new or empty folder;
`--overwrite` replaces a folder's whole contents. A user error exits with status 2 and one `error:` line.
"""

import argparse
import json
from collections.abc import Sequence
from typing import Any

from lmzoo import storage
from lmzoo.convert import export
from lmzoo.models import heads
from lmzoo.train import run as run_lib


def export_workdir(
    workdir: str,
    out_dir: str,
    step: int | None = None,
    labels: Sequence[str] | None = None,
    *,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Exports a train.py run's latest (or `step`'s) checkpoint with its tokenizer; adds "step" to the summary.
    A run whose model is a SequenceClassifier exports as one (labels: its class names). `out_dir` is checked
    (`export.check_out_dir`) before the checkpoint is read; a bucket --workdir is read where it is, --out is local."""
    if storage.is_remote(out_dir):
        raise ValueError(
            f"--out={out_dir}: export writes a local folder; export to one, then copy it (gcloud storage cp -r)"
        )
    export.check_out_dir(out_dir, overwrite=overwrite, keep=None if storage.is_remote(workdir) else workdir)
    loaded = run_lib.load(workdir, step)
    params, classifier = export.exported_part(loaded.model, loaded.params)
    summary = export.export_hf(
        loaded.config.model_name,
        loaded.config.model.to_dict(),
        params,
        out_dir,
        loaded.tokenizer,
        classifier=classifier,
        labels=labels,
        overwrite=overwrite,
    )
    if isinstance(loaded.model, heads.LMWithValueHead | heads.LMWithValueModel):
        summary["left_out"] = "the value head or value network (PPO's value estimate)"
    return {**summary, "step": loaded.step}


def main() -> None:
    parser = argparse.ArgumentParser(description="Export a train.py run's checkpoint to an HF folder.")
    parser.add_argument("--workdir", required=True, help="Workdir of a train.py run.")
    parser.add_argument("--out", required=True, help="Folder to write the HF checkpoint to.")
    parser.add_argument("--step", type=int, default=None, help="Checkpoint step (default: the latest).")
    parser.add_argument("--labels", default=None, help="A classifier's class names, comma-separated (id2label).")
    parser.add_argument("--overwrite", action="store_true", help="Replace the contents of a non-empty --out folder.")
    args = parser.parse_args()
    with run_lib.user_errors():
        summary = export_workdir(
            args.workdir,
            args.out,
            args.step,
            args.labels.split(",") if args.labels else None,
            overwrite=args.overwrite,
        )
    print(json.dumps(summary))
    if not summary["tokenizer"]:
        print(
            "note: the run's tokenizer has no HF form (char, byte, word or sentencepiece); no tokenizer files written"
        )


if __name__ == "__main__":
    main()
