"""SST-2 for in-context evaluation: python scripts/sst2_icl_data.py --out=runs/sst2_icl/data

Writes, from ../shared/data/sst2 (GLUE format: `sentence<TAB>label`, header row):
  train.jsonl, dev.jsonl   few-shot tasks {"context", "choices", "gold"} (choices: the label words)
  corpus.txt               the train sentences, one per line, to train a decoder on movie-review text
"""

import csv
import json
import pathlib

from absl import app, flags

flags.DEFINE_string("out", "runs/sst2_icl/data", "Output folder.")
flags.DEFINE_string(
    "sst2", str(pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2"), "SST-2 folder."
)
flags.DEFINE_list("choices", ["terrible", "great"], "Words for label 0 and label 1 (each scored after a space).")
FLAGS = flags.FLAGS


def read_tsv(path: pathlib.Path) -> list[tuple[str, int]]:
    with path.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [(row["sentence"].strip(), int(row["label"])) for row in rows]


def main(argv):
    out, source = pathlib.Path(FLAGS.out), pathlib.Path(FLAGS.sst2)
    out.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train.tsv"), ("dev", "dev.tsv")):
        rows = read_tsv(source / name)
        with (out / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            for sentence, label in rows:
                f.write(
                    json.dumps({"context": sentence, "choices": [" " + word for word in FLAGS.choices], "gold": label})
                    + "\n"
                )
        if split == "train":
            (out / "corpus.txt").write_text("".join(sentence + "\n" for sentence, _ in rows), encoding="utf-8")
        print(f"{split}: {len(rows)} examples, label 1 share {sum(label for _, label in rows) / len(rows):.3f}")


if __name__ == "__main__":
    app.run(main)
