"""Compare an lmzoo run with its HF export: logits, and lm-eval samples of both backends (scripts/sst2_icl.sh).

    python scripts/sst2_icl_compare.py --workdir=runs/sst2_icl/lm --hf=runs/sst2_icl/hf --lm_eval=runs/sst2_icl/lm_eval

Prints one JSON line: max |logit difference| on a few dev sentences, and per k the number of lm-eval samples,
the max |log-likelihood difference| between the lmzoo and HF backends over every choice, and both accuracies.
"""

import json
import pathlib

import numpy as np
from absl import app, flags

flags.DEFINE_string("workdir", "runs/sst2_icl/lm", "The lmzoo run.")
flags.DEFINE_string("hf", "runs/sst2_icl/hf", "Its HF export.")
flags.DEFINE_string(
    "lm_eval", "runs/sst2_icl/lm_eval", "lm-eval output folders lmzoo_k<K>/ and hf_k<K>/ (--log_samples)."
)
FLAGS = flags.FLAGS
SENTENCES = [
    "it 's a charming and often affecting journey .",
    "unflinchingly bleak and desperate",
    "the acting is terrible",
]


def samples(folder: pathlib.Path) -> dict[int, list]:
    """doc_id -> [(log-likelihood, is greedy), ...] per choice from lm-eval's samples_*.jsonl."""
    path = next(folder.rglob("samples_*.jsonl"))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["doc_id"]: [(float(ll), bool(g)) for ll, g in r["filtered_resps"]] for r in rows}


def accuracy(folder: pathlib.Path) -> float:
    path = next(folder.rglob("results_*.json"))
    return json.loads(path.read_text())["results"]["sst2_icl"]["acc,none"]


def main(argv):
    del argv
    import jax.numpy as jnp
    import torch
    import transformers

    import lmzoo

    loaded = lmzoo.load(FLAGS.workdir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(FLAGS.hf).eval()
    diffs = []
    for sentence in SENTENCES:
        ids = loaded.tokenizer.encode(sentence)
        ours = np.asarray(loaded.model.apply({"params": loaded.params}, jnp.asarray([ids])))
        with torch.no_grad():
            theirs = hf_model(input_ids=torch.tensor([ids])).logits.numpy()
        diffs.append(float(np.abs(ours - theirs).max()))
    result = {"step": loaded.step, "max_abs_logit_diff": max(diffs), "lm_eval": []}
    root = pathlib.Path(FLAGS.lm_eval)
    for ours_dir in sorted(root.glob("lmzoo_k*")):
        k = ours_dir.name.removeprefix("lmzoo_k")
        theirs_dir = root / f"hf_k{k}"
        a, b = samples(ours_dir), samples(theirs_dir)
        lls = [(x[0], y[0]) for doc in a for x, y in zip(a[doc], b[doc], strict=True)]
        result["lm_eval"].append(
            {
                "k": int(k),
                "docs": len(a),
                "max_abs_loglikelihood_diff": max(abs(x - y) for x, y in lls),
                "acc_lmzoo": accuracy(ours_dir),
                "acc_hf": accuracy(theirs_dir),
            }
        )
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
