"""Supervised fine-tuning on demonstrations (InstructGPT's first stage): prompt -> response, loss on the response only.

The demonstrations are the chosen dialogues of preference comparisons (`lmzoo.data.comparisons`,
HH-RLHF format): each becomes prompt ⊕ chosen reply ⊕ EOS, weighted only on the reply and its EOS,
and the examples are packed into rows of `data.seq_len` (attention and positions restart per
example). The loss is the decoder's own causal-LM path (`tasks.causal_lm_task`). Every
alignment stage splits the file the same way (`heldout_fraction`, `split_seed`), so no stage
trains on the held-out prompts.
"""

import numpy as np

from lmzoo.data import comparisons, readers
from lmzoo.objectives import base, tasks


class SFT(base.ExampleObjective):
    """A decoder fine-tuned on prompt -> chosen reply, packed, with the loss on reply tokens only."""

    name = "sft"
    Config = base.ComparisonSplitConfig
    reader = readers.COMPARISONS

    def task(self, model):
        return tasks.causal_lm_task(model)

    def input_shapes(self, batch_size):
        shape = (batch_size, self.config.data.seq_len)
        return {
            "inputs": base.int_inputs(shape),
            "positions": base.int_inputs(shape),
            "segment_ids": base.int_inputs(shape),
        }

    def examples(self, tokenizer, raw, where):
        return comparisons.sft_rows(
            raw, tokenizer, seq_len=self.config.data.seq_len, vocab_size=self.config.model.vocab_size, where=where
        )

    def real_tokens(self, batch):
        return int(np.count_nonzero(batch["segment_ids"]))
