"""Supervised fine-tuning on demonstrations (InstructGPT's first stage): prompt -> response, loss on the response only.

The demonstrations are the chosen dialogues of preference comparisons (`lmzoo.data.comparisons`,
HH-RLHF format): each becomes prompt ⊕ chosen reply ⊕ EOS, weighted only on the reply and its EOS,
and the examples are packed into rows of `data.seq_len` (attention and positions restart per
example). The loss is the decoder's own causal-LM path (`causal_lm.causal_lm_task`). Every
alignment stage splits the file the same way (`heldout_fraction`, `split_seed`), so no stage
trains on the held-out prompts.
"""

import dataclasses

import numpy as np

from lmzoo import tokenizers
from lmzoo.data import comparisons, readers, transforms
from lmzoo.objectives import base, causal_lm


@dataclasses.dataclass(frozen=True)
class ComparisonSplitConfig:
    """Attributes:
    heldout_fraction: share of the prompts of config.data.path held out (by a hash of the prompt) and never trained on.
    split_seed: seed of that hash; keep it equal across SFT, reward model and PPO.
    """

    heldout_fraction: float = 0.1
    split_seed: int = 0

    def __post_init__(self):
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"config.objective.heldout_fraction={self.heldout_fraction} must lie in (0, 1), e.g. 0.1")


def fixed_tokenizer(config) -> tokenizers.Tokenizer:
    """The run's tokenizer when it needs no corpus (byte, or a file given by path): the reward model and PPO read
    its special ids while building their task, before any data is read."""
    spec = config.data.tokenizer.to_dict()
    kind = spec.pop("kind")
    if kind != "byte" and not spec.get("path"):
        raise ValueError(
            f"objective {config.objective.name!r} needs a tokenizer fixed before reading data: "
            "set config.data.tokenizer.kind='byte' or give config.data.tokenizer.path"
        )
    tokenizer = tokenizers.build_tokenizer(kind, **spec)
    if tokenizer.pad_id is None:
        raise ValueError(f"objective {config.objective.name!r} needs a tokenizer with a <pad> id (e.g. kind='byte')")
    return tokenizer


def end_id(tokenizer: tokenizers.Tokenizer) -> int:
    """The token closing every prompt ⊕ response: <eos>, or an encoder vocabulary's [SEP]."""
    end = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.sep_id
    if end is None or end == tokenizer.pad_id:
        raise ValueError("the tokenizer needs an <eos> (or [SEP]) id distinct from <pad> to close each response")
    return end


def sft_examples(raw: list[comparisons.Comparison], tokenizer, config, where: str) -> dict[str, np.ndarray]:
    """Packed rows [M, seq_len] of prompt -> chosen reply examples ("inputs", "targets", "weights", "segment_ids", "positions")."""
    if tokenizer.eos_id is None or tokenizer.pad_id is None or tokenizer.pad_id == tokenizer.eos_id:
        raise ValueError(
            "SFT needs a tokenizer with distinct <eos> and <pad> ids (e.g. config.data.tokenizer.kind='byte')"
        )
    examples = comparisons.sft_arrays(
        raw, tokenizer.encode, max_len=config.data.seq_len, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id
    )
    transforms.check_token_ids(examples["inputs"], config.model.vocab_size, where=where)
    return comparisons.pack_examples(examples, tokenizer.pad_id)


class SFT(base.ExampleObjective):
    """A decoder fine-tuned on prompt -> chosen reply, packed, with the loss on reply tokens only."""

    name = "sft"
    Config = ComparisonSplitConfig
    reader = readers.COMPARISONS

    def task(self, model):
        return causal_lm.causal_lm_task(model)

    def input_shapes(self, batch_size):
        shape = (batch_size, self.config.data.seq_len)
        return {
            "inputs": base.int_inputs(shape),
            "positions": base.int_inputs(shape),
            "segment_ids": base.int_inputs(shape),
        }

    def examples(self, tokenizer, raw, where):
        return sft_examples(raw, tokenizer, self.config, where)

    def real_tokens(self, batch):
        return int(np.count_nonzero(batch["segment_ids"]))
