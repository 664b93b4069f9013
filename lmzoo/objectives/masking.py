"""The masking recipe masked-LM pretraining and distillation share: its fields, the settings of
`transforms.mask_rows` for a tokenizer, and objectives on masked `[CLS] window [SEP]` rows."""

import dataclasses
import functools

from lmzoo import tokenizers
from lmzoo.data import transforms
from lmzoo.objectives import base


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


class MaskedWindows(base.Objective):
    """An encoder objective on packed windows of the run's documents, masked as `[CLS] window [SEP]` rows of
    data.seq_len tokens; subclasses give the task."""

    def train_loader(self, tokenizer, raw, shard):
        transform = window_transform(self.config, tokenizer, self.fields)
        return self.window_loader(tokenizer, raw, shard, self.config.data.seq_len - 2, transform)

    def eval_batches(self, tokenizer, raw, shard):
        transform = window_transform(self.config, tokenizer, self.fields)
        return self.window_eval_batches(tokenizer, raw, shard, self.config.data.seq_len - 2, transform)
