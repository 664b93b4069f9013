"""Masked language modelling for encoders: MLM on packed windows (RoBERTa) or on sentence pairs with
next-sentence prediction (BERT) or sentence-order prediction (ALBERT)."""

import dataclasses
import functools

import numpy as np

from lmzoo import tokenizers
from lmzoo.data import pipeline, transforms
from lmzoo.objectives import base, masking, tasks


@dataclasses.dataclass(frozen=True)
class SentencePairConfig(masking.MaskedLMConfig):
    """Attributes (besides MaskedLMConfig's):
    num_pair_examples / num_eval_pairs: sentence pairs an epoch of training / evaluated, spread evenly over the
        split's sentences (`transforms.SentencePairs`); num_pair_examples 0: every sentence that has a successor.
    sentence_loss_weight: weight of the NSP / SOP loss added to the MLM loss.
    """

    num_pair_examples: int = 0
    num_eval_pairs: int = 2_000
    sentence_loss_weight: float = 1.0


class MaskedLM(masking.MaskedWindows):
    """MLM on packed windows `[CLS] window [SEP]` of the run's documents (RoBERTa's full-sentences input)."""

    name = "mlm"
    Config = masking.MaskedLMConfig

    def task(self, model):
        return tasks.masked_lm_task(model, mask_rate=self.fields.mask_rate)


class PairRows:
    """`transforms.SentencePairs` as `pipeline.ExampleLoader` rows, built when read: `rows(ids)` gives tokens,
    token_types, segment_ids [len(ids), max_len] and sentence_labels [len(ids)] (HF conventions)."""

    def __init__(self, pairs: transforms.SentencePairs, tokenizer: tokenizers.Tokenizer, max_len: int):
        self.pairs, self.tokenizer, self.max_len = pairs, tokenizer, max_len

    def __len__(self) -> int:
        return len(self.pairs)

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        t = self.tokenizer
        pairs = [self.pairs[k] for k in ids]
        built = [
            transforms.pair_example(a, b, cls_id=t.cls_id, sep_id=t.sep_id, max_len=self.max_len, pad_id=t.pad_id)
            for a, b, _ in pairs
        ]
        return {
            "tokens": np.stack([r["tokens"] for r in built]),
            "token_types": np.stack([r["token_type_ids"] for r in built]),
            "segment_ids": np.stack([r["segment_ids"] for r in built]),
            "sentence_labels": np.array([label for _, _, label in pairs], np.int32),
        }


def masked_pairs(rows: dict[str, np.ndarray], ids: np.ndarray, epochs: np.ndarray, *, mask) -> dict[str, np.ndarray]:
    """ExampleLoader transform for NSP/SOP pairs: masks "tokens", keeps the rest."""
    return {**mask(rows["tokens"], ids, epochs), **{k: v for k, v in rows.items() if k != "tokens"}}


class SentencePairMLM(base.Objective):
    """MLM plus a sentence-level task on `[CLS] A [SEP] B [SEP]` pairs: next-sentence prediction ("nsp",
    BERT) or sentence-order prediction ("sop", ALBERT). Each pair is a function of (seed, its id), drawn when a batch
    reads it, so an epoch can span every sentence of a store of any size."""

    Config = SentencePairConfig
    loss_is_token_nll = False  # MLM plus the sentence-level loss
    kind: str = ""

    def task(self, model):
        o = self.fields
        return tasks.masked_lm_task(model, mask_rate=o.mask_rate, sentence_loss_weight=o.sentence_loss_weight)

    def _loader(self, tokenizer, raw, shard, *, train: bool) -> pipeline.ExampleLoader:
        fields = self.fields
        settings = masking.mask_settings(tokenizer, fields, self.config.train.seed)
        pairs = transforms.SentencePairs(
            raw.sentences(tokenizer),
            kind=self.kind,
            seed=self.config.train.seed + (0 if train else 1),
            size=(fields.num_pair_examples or None) if train else fields.num_eval_pairs,
        )
        transform = functools.partial(masked_pairs, mask=functools.partial(transforms.mask_rows, **settings))
        batch_size = self.config.train.batch_size if train else self.config.eval.batch_size
        return pipeline.ExampleLoader(
            PairRows(pairs, tokenizer, self.config.data.seq_len),
            batch_size,
            seed=self.config.train.seed,
            transform=transform,
            **dataclasses.asdict(shard),
        )

    def train_loader(self, tokenizer, raw, shard):
        return self._loader(tokenizer, raw, shard, train=True)

    def eval_batches(self, tokenizer, raw, shard):
        return self._loader(tokenizer, raw, shard, train=False).eval_batches()


class NextSentenceMLM(SentencePairMLM):
    """BERT's pretraining: MLM + next-sentence prediction."""

    name, kind = "mlm_nsp", "nsp"


class SentenceOrderMLM(SentencePairMLM):
    """ALBERT's pretraining: MLM + sentence-order prediction."""

    name, kind = "mlm_sop", "sop"
