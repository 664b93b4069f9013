"""HH-RLHF's dialogues as chat rows: python scripts/hh_chat.py --out=runs/hh_chat

Writes, from ../shared/data/hh_rlhf/harmless-base_test.jsonl.gz ("\\n\\nHuman: ...\\n\\nAssistant: ..." strings; pairs
whose dialogues differ before the last reply are skipped, as every HH stage skips them):
  conversations.jsonl   {"messages": [...]}: the prompt's turns and the chosen reply (SFT: configs/llama_sft.py)
  pairs.jsonl           {"prompt": [...], "chosen": [reply], "rejected": [reply]} (DPO: configs/llama_sft.py:dpo)
one row per comparison, in file order (`lmzoo.data.chat.hh_rows`), so both files hold out the same prompts.
"""

import json
import pathlib

from absl import app, flags

from lmzoo import storage
from lmzoo.data import chat, comparisons

HH_PATH = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "hh_rlhf" / "harmless-base_test.jsonl.gz"

flags.DEFINE_string("out", "runs/hh_chat", "Output folder.")
flags.DEFINE_string("hh", str(HH_PATH), "HH-RLHF comparisons (.jsonl or .jsonl.gz).")
FLAGS = flags.FLAGS


def main(argv):
    rows = [chat.hh_rows(c) for c in comparisons.read_comparisons(FLAGS.hh)]
    for name, column in (("conversations.jsonl", 0), ("pairs.jsonl", 1)):
        lines = "".join(json.dumps(row[column], ensure_ascii=False) + "\n" for row in rows)
        storage.write_text(f"{FLAGS.out}/{name}", lines)
    turns = sum(len(conversation["messages"]) for conversation, _ in rows)
    print(f"{len(rows)} conversations ({turns} messages) and {len(rows)} pairs -> {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
