"""Supervised encoder-decoders on (source, target) text pairs: translation, summarisation, dialogue responses."""

import functools

import numpy as np

from lmzoo import tokenizers
from lmzoo.data import readers, transforms
from lmzoo.objectives import base, tasks


def text_pair_examples(
    pairs: list[tuple[str, str]], tokenizer: tokenizers.Tokenizer, inputs_length: int, targets_length: int
) -> dict[str, np.ndarray]:
    """Tokenized pairs, each side ending in EOS and padded: inputs [N, inputs_length] (a long source keeps
    its end, where a prompt's question is), targets [N, targets_length] (a long target keeps its start)."""
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    if pad is None or eos is None:
        raise ValueError("text_to_text needs a tokenizer with <pad> and <eos> ids (sentencepiece has both)")
    sources = tokenizer.encode_batch([s for s, _ in pairs])
    targets = tokenizer.encode_batch([t for _, t in pairs])
    out = {
        "inputs": np.full((len(pairs), inputs_length), pad, np.int32),
        "targets": np.full((len(pairs), targets_length), pad, np.int32),
    }
    for i, (source, target) in enumerate(zip(sources, targets, strict=True)):
        source = source[len(source) - (inputs_length - 1) :] if len(source) >= inputs_length else source
        target = target[: targets_length - 1]
        out["inputs"][i, : len(source) + 1] = [*source, eos]
        out["targets"][i, : len(target) + 1] = [*target, eos]
    return out


def text_pair_rows(
    rows: dict[str, np.ndarray], ids: np.ndarray, epochs: np.ndarray, *, pad_id: int, decoder_start_id: int
) -> dict[str, np.ndarray]:
    """ExampleLoader transform for (inputs, targets) rows: encoder segment ids, decoder inputs, weights."""
    targets = rows["targets"]
    return {
        "inputs": rows["inputs"],
        "encoder_segment_ids": (rows["inputs"] != pad_id).astype(np.int32),
        "targets": targets,
        "decoder_inputs": transforms.shift_right(targets, decoder_start_id),
        "weights": (targets != pad_id).astype(np.float32),
    }


class TextToText(base.ExampleObjective):
    """Pairs from a .jsonl/.tsv file (`data.source='pairs'`): two `data.text_fields`, or one split at
    `data.split_marker` (HH-RLHF: the conversation so far -> the final response). The last
    `data.validation_fraction` of the pairs are held out."""

    name = "text_to_text"
    reader = readers.TEXT_PAIRS
    evaluators = ("loss", "generation")

    def check(self):
        if self.config.data.source != "pairs":
            raise ValueError("text_to_text trains on (source, target) pairs: set config.data.source='pairs'")
        base.check_length(self.config, "seq_len", self.config.data.seq_len)
        base.check_length(self.config, "target_seq_len", self.config.data.target_seq_len)

    def value_problems(self, *, data_parallel_size, batches):
        if self.config.data.target_seq_len >= 1:
            return []
        return [
            f"config.data.target_seq_len={self.config.data.target_seq_len!r}: must be a positive integer; "
            "set --config.data.target_seq_len=N"
        ]

    def task(self, model):
        return tasks.seq2seq_task(model)

    def input_shapes(self, batch_size):
        return {
            "inputs": base.int_inputs((batch_size, self.config.data.seq_len)),
            "decoder_inputs": base.int_inputs((batch_size, self.config.data.target_seq_len)),
        }

    def real_tokens(self, batch):
        return tasks.seq2seq_real_tokens(batch)

    def examples(self, tokenizer, raw, where):
        examples = text_pair_examples(raw, tokenizer, self.config.data.seq_len, self.config.data.target_seq_len)
        for key in ("inputs", "targets"):
            transforms.check_token_ids(examples[key], self.config.model.vocab_size, where=f"{where} {key}")
        return examples

    def example_transform(self, tokenizer):
        return functools.partial(
            text_pair_rows, pad_id=tokenizer.pad_id, decoder_start_id=self.config.model.decoder_start_id
        )
