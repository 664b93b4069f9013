"""Denoising pretraining of encoder-decoders on windows of the run's documents: T5 span corruption and BART
noising (text infilling, sentence permutation, ...), both trained by next-token loss on the targets."""

import dataclasses
import functools
import inspect
from typing import Any

import numpy as np

from lmzoo import tokenizers
from lmzoo.data import noising, transforms
from lmzoo.objectives import base, tasks


@dataclasses.dataclass(frozen=True)
class SpanCorruptionConfig:
    """T5: noise_density of the tokens, in spans of mean length mean_noise_span_length, become sentinels."""

    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0


@dataclasses.dataclass(frozen=True)
class DenoisingConfig:
    """BART: noising steps applied in order, (name, kwargs) pairs of `lmzoo.data.noising.NOISING`."""

    noising: Any = (("text_infilling", {"mask_ratio": 0.3, "poisson_lambda": 3.0}),)

    def __post_init__(self):
        unknown = [name for name, _ in self.noising if name not in noising.NOISING]
        if unknown:
            raise ValueError(f"unknown config.objective.noising steps {unknown}; choose from {sorted(noising.NOISING)}")


def sentence_end_ids(tokenizer: tokenizers.Tokenizer) -> list[int]:
    """Ids whose text ends a sentence (".", "!", "?", with or without a leading space marker)."""
    return [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).strip() in (".", "!", "?")]


class WindowDenoising(base.Objective):
    """Shared by span corruption and BART denoising: windows of `window` tokens noised row by row from
    (seed, example, epoch), inputs padded to data.seq_len and targets to `targets_length`."""

    evaluators = ("loss", "reconstruction")

    def task(self, model):
        return tasks.seq2seq_task(model)

    def lengths(self) -> tuple[int, int]:
        """(window of original tokens, targets length)."""
        raise NotImplementedError

    def noise(self, tokenizer: tokenizers.Tokenizer):
        """(tokens [w], rng) -> {"inputs", "targets"}, both ending in EOS."""
        raise NotImplementedError

    def input_shapes(self, batch_size):
        return {
            "inputs": base.int_inputs((batch_size, self.config.data.seq_len)),
            "decoder_inputs": base.int_inputs((batch_size, self.lengths()[1])),
        }

    def real_tokens(self, batch):
        return tasks.seq2seq_real_tokens(batch)

    def _transform(self, tokenizer):
        return functools.partial(
            transforms.seq2seq_from_windows,
            noise=self.noise(tokenizer),
            seed=self.config.train.seed,
            inputs_length=self.config.data.seq_len,
            targets_length=self.lengths()[1],
            pad_id=tokenizer.pad_id,
            decoder_start_id=self.config.model.decoder_start_id,
        )

    def train_loader(self, tokenizer, raw, shard):
        return self.window_loader(tokenizer, raw, shard, self.lengths()[0], self._transform(tokenizer))

    def eval_batches(self, tokenizer, raw, shard):
        return self.window_eval_batches(tokenizer, raw, shard, self.lengths()[0], self._transform(tokenizer))


class SpanCorruption(WindowDenoising):
    """T5: random spans replaced by sentinels in the input; the targets list the spans after their sentinels."""

    name = "span_corruption"
    Config = SpanCorruptionConfig

    def lengths(self):
        o = self.fields
        window, targets_length = noising.span_corruption_lengths(
            self.config.data.seq_len, o.noise_density, o.mean_noise_span_length
        )
        return window - 1, targets_length  # span_corruption_lengths counts the EOS that span_corruption appends

    def noise(self, tokenizer):
        if not getattr(tokenizer, "extra_ids", 0):
            raise ValueError(
                "span_corruption needs sentinel tokens: use a sentencepiece tokenizer with extra_ids (e.g. 100)"
            )
        o = self.fields
        return functools.partial(
            noising.span_corruption,
            sentinel_ids=[tokenizer.sentinel_id(i) for i in range(tokenizer.extra_ids)],
            noise_density=o.noise_density,
            mean_noise_span_length=o.mean_noise_span_length,
            eos_id=tokenizer.eos_id,
        )


def bart_noise(tokens: np.ndarray, rng: np.random.Generator, *, steps: list, eos_id: int) -> dict[str, np.ndarray]:
    """BART example: the noised window and the original window, each followed by EOS."""
    return {
        "inputs": np.append(noising.apply_noising(tokens, steps, rng=rng), eos_id),
        "targets": np.append(tokens, eos_id),
    }


class Denoising(WindowDenoising):
    """BART: the decoder restores the original window from its noised version."""

    name = "denoising"
    Config = DenoisingConfig

    def lengths(self):
        return self.config.data.seq_len - 1, self.config.data.seq_len

    def noise(self, tokenizer):
        if tokenizer.mask_id is None:
            raise ValueError(
                "BART denoising needs a mask token: e.g. sentencepiece with user_defined_symbols=['[MASK]']"
            )
        steps = [(name, dict(kwargs)) for name, kwargs in self.fields.noising]
        specials = [i for i in tokenizer.special_ids.values() if i is not None]
        for name, kwargs in steps:
            accepted = inspect.signature(noising.NOISING[name]).parameters
            if "mask_id" in accepted:
                kwargs.setdefault("mask_id", tokenizer.mask_id)
            if "special_ids" in accepted:
                kwargs.setdefault("special_ids", specials)
            if kwargs.get("sentence_end_ids") == "auto":
                kwargs["sentence_end_ids"] = sentence_end_ids(tokenizer)
        return functools.partial(bart_noise, steps=steps, eos_id=tokenizer.eos_id)
