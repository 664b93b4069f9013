"""Kneser-Ney and add-k n-gram models on Penn Treebank (Mikolov's split): valid/test perplexity and wall time.

    python scripts/ngram_ptb.py --data_dir=../shared/data/ptb

Perplexity counts every word and every `<eos>` (929,589 / 73,760 / 82,430 tokens+eos). Mikolov et al. (2011)
report KN 5-gram test perplexity 141.2.
"""

import argparse
import os
import pathlib
import platform
import time

import numpy as np

from lmzoo.models import ngram
from lmzoo.tokenizers import WordTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data_dir", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "ptb")
    )
    parser.add_argument("--kn_orders", default="3,4,5")
    parser.add_argument("--add_k_orders", default="2,3")
    parser.add_argument("--add_k_values", default="1,0.1,0.01")
    parser.add_argument("--sample_tokens", type=int, default=40)
    args = parser.parse_args()

    texts = {}
    for split in ("train", "valid", "test"):
        with open(os.path.join(args.data_dir, f"ptb.{split}.txt"), encoding="utf-8") as f:
            texts[split] = f.read()
    tokenizer = WordTokenizer.from_corpus([texts["train"]])
    ids = {split: np.array(tokenizer.encode(text)) for split, text in texts.items()}
    print(
        f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; vocab {tokenizer.vocab_size}; "
        + ", ".join(f"{split} {len(x)} tokens+eos" for split, x in ids.items())
    )

    kn_orders = [int(order) for order in args.kn_orders.split(",")]
    runs = [(f"kn{order}", order, "kneser_ney", 0.0) for order in kn_orders]
    runs += [
        (f"add{k}_{order}gram", order, "add_k", k)
        for order in map(int, args.add_k_orders.split(","))
        for k in map(float, args.add_k_values.split(","))
    ]
    print(f"{'model':<16} {'valid ppl':>10} {'test ppl':>10} {'fit s':>7} {'score s':>8}")
    states = {}
    for name, order, smoothing, add_k in runs:
        start = time.perf_counter()
        state = ngram.fit(
            ids["train"],
            order=order,
            vocab_size=tokenizer.vocab_size,
            eos_id=tokenizer.eos_id,
            smoothing=smoothing,
            add_k=add_k,
        )
        fitted = time.perf_counter()
        valid, test = ngram.perplexity(state, ids["valid"]), ngram.perplexity(state, ids["test"])
        scored = time.perf_counter()
        print(f"{name:<16} {valid:>10.2f} {test:>10.2f} {fitted - start:>7.2f} {scored - fitted:>8.2f}", flush=True)
        states[name] = state
    drawn = ngram.sample(states[f"kn{max(kn_orders)}"], np.random.default_rng(0), [], args.sample_tokens)
    print(f"sample from kn{max(kn_orders)}:\n{tokenizer.decode(drawn)}")


if __name__ == "__main__":
    main()
