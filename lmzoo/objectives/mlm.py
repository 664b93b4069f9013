"""Masked language modelling for encoders: MLM on packed windows (RoBERTa) or on sentence pairs with
next-sentence prediction (BERT) or sentence-order prediction (ALBERT)."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lmzoo import tokenizers
from lmzoo.data import pipeline, transforms
from lmzoo.objectives import base, losses
from lmzoo.trainers.state import Task


@dataclasses.dataclass(frozen=True)
class MaskedLMConfig:
    """Attributes:
    mask_rate: fraction of candidate tokens selected for prediction (80% [MASK], 10% random, 10% kept).
    whole_word_masking: WordPiece: mask all "##" pieces of a selected word together.
    static_masking: True: one mask per example (BERT); False: a fresh mask every epoch (RoBERTa).
    """

    mask_rate: float = 0.15
    whole_word_masking: bool = False
    static_masking: bool = False

    def __post_init__(self):
        if not 0.0 < self.mask_rate < 1.0:
            raise ValueError(f"config.objective.mask_rate={self.mask_rate} must lie in (0, 1)")


@dataclasses.dataclass(frozen=True)
class SentencePairConfig(MaskedLMConfig):
    """Attributes (besides MaskedLMConfig's):
    num_pair_examples / num_eval_pairs: sentence pairs an epoch of training / evaluated, spread evenly over the
        split's sentences (`transforms.SentencePairs`); num_pair_examples 0: every sentence that has a successor.
    sentence_loss_weight: weight of the NSP / SOP loss added to the MLM loss.
    """

    num_pair_examples: int = 0
    num_eval_pairs: int = 2_000
    sentence_loss_weight: float = 1.0


def num_predictions(length: int, mask_rate: float) -> int:
    """Positions per row that hold every masked position: ceil(mask_rate * T) + 1 (masking selects
    round(mask_rate * candidates) <= that), at most T."""
    return min(length, math.ceil(mask_rate * length) + 1)


def gather_predictions(batch: dict[str, jax.Array], mask_rate: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The highest-weight positions [B, M] of each row and the targets / weights there [B, M]."""
    positions = jax.lax.top_k(batch["weights"], num_predictions(batch["inputs"].shape[1], mask_rate))[1]
    return positions, {k: jnp.take_along_axis(batch[k], positions, axis=1) for k in ("targets", "weights")}


def masked_lm_task(model, *, mask_rate: float, sentence_loss_weight: float = 1.0) -> Task:
    """MLM for encoders with `pretraining_logits`; adds NSP/SOP when the batch has sentence labels.
    Logits are computed only at the `num_predictions` highest-weight positions of each row."""

    def init(rng, batch):
        params = model.init({"params": rng, "dropout": rng}, batch["inputs"], token_types=batch.get("token_types"))[
            "params"
        ]
        return params, {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        positions, gathered = gather_predictions(batch, mask_rate)
        logits, sentence_logits = model.apply(
            {"params": params},
            batch["inputs"],
            positions,
            token_types=batch.get("token_types"),
            segment_ids=batch.get("segment_ids"),
            deterministic=not train,
            rngs={"dropout": rng},
            method=model.pretraining_logits,
        )
        value, metrics = losses.token_loss(logits, gathered)
        if sentence_logits is not None and "sentence_labels" in batch:
            weights = batch.get("example_weights", jnp.ones(batch["sentence_labels"].shape, jnp.float32))
            sentence_value, sentence_metrics = losses.weighted_loss(
                sentence_logits, batch["sentence_labels"], weights, "sentence_"
            )
            value = value + sentence_loss_weight * sentence_value
            metrics = {**metrics, **sentence_metrics}
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


def mask_settings(tokenizer: tokenizers.Tokenizer, fields: MaskedLMConfig, seed: int) -> dict:
    """Keyword arguments of `transforms.mask_rows` for the run's tokenizer."""
    missing = [name for name in ("cls_id", "sep_id", "mask_id", "pad_id") if getattr(tokenizer, name) is None]
    if missing:
        raise ValueError(
            f"masked-LM objectives need a tokenizer with [CLS]/[SEP]/[MASK]/[PAD]; this one lacks {missing} "
            "(use data.tokenizer.kind='wordpiece', or sentencepiece with user_defined_symbols)"
        )
    specials = sorted({i for i in tokenizer.special_ids.values() if i is not None})
    settings = dict(
        mask_id=tokenizer.mask_id,
        vocab_size=tokenizer.vocab_size,
        special_ids=specials,
        rate=fields.mask_rate,
        seed=seed,
        static=fields.static_masking,
    )
    if fields.whole_word_masking:
        pieces = [tokenizer.decode([i]) if i not in specials else "" for i in range(tokenizer.vocab_size)]
        settings["continuation_mask"] = transforms.continuation_mask_from_vocab(pieces)
    return settings


def window_transform(config, tokenizer: tokenizers.Tokenizer, fields: MaskedLMConfig):
    """LMLoader transform: packed windows of T-2 tokens -> masked `[CLS] window [SEP]` rows of T tokens."""
    return functools.partial(
        transforms.mlm_from_windows,
        cls_id=tokenizer.cls_id,
        sep_id=tokenizer.sep_id,
        pad_id=tokenizer.pad_id,
        **mask_settings(tokenizer, fields, config.train.seed),
    )


class MaskedLM(base.Objective):
    """MLM on packed windows `[CLS] window [SEP]` of the run's documents (RoBERTa's full-sentences input)."""

    name = "mlm"
    Config = MaskedLMConfig

    def task(self, model):
        return masked_lm_task(model, mask_rate=self.fields.mask_rate)

    def train_loader(self, tokenizer, raw, shard):
        transform = window_transform(self.config, tokenizer, self.fields)
        return self.window_loader(tokenizer, raw, shard, self.config.data.seq_len - 2, transform)

    def eval_batches(self, tokenizer, raw, shard):
        transform = window_transform(self.config, tokenizer, self.fields)
        return self.window_eval_batches(tokenizer, raw, shard, self.config.data.seq_len - 2, transform)


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
        return masked_lm_task(model, mask_rate=o.mask_rate, sentence_loss_weight=o.sentence_loss_weight)

    def _loader(self, tokenizer, raw, shard, *, train: bool) -> pipeline.ExampleLoader:
        fields = self.fields
        settings = mask_settings(tokenizer, fields, self.config.train.seed)
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
