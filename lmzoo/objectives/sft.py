"""Supervised fine-tuning on demonstrations (InstructGPT's first stage): prompt -> response, loss on the response only.

The demonstrations are the chosen dialogues of preference comparisons (`lmzoo.data.comparisons`,
HH-RLHF format): each becomes prompt ⊕ chosen reply ⊕ EOS, weighted only on the reply and its EOS,
and the examples are packed into rows of `data.seq_len` (attention and positions restart per
example). The loss is the decoder's own causal-LM path (`tasks.causal_lm_task`). Every
alignment stage splits the file the same way (`heldout_fraction`, `split_seed`), so no stage
trains on the held-out prompts.

A chat file (`messages` rows, or conversational pairs whose prompt ⊕ chosen reply is trained on: `lmzoo.data.chat`)
is rendered through the checkpoint's chat template and weighted on the tokens of every assistant turn.
"""

import dataclasses

import numpy as np

from lmzoo.convert import hf
from lmzoo.data import chat, readers
from lmzoo.objectives import base, tasks


@dataclasses.dataclass(frozen=True)
class SFTConfig(base.ComparisonSplitConfig):
    """Attributes (besides the held-out split of config.data.path):
    chat_template: the template chat rows are rendered with: a tokenizer_config.json, a chat_template.jinja or the
      folder holding one; "" reads the one beside the run's tokenizer.json (data.tokenizer.path of kind hf_json, or
      init_from's hf: folder with kind init_from). HH-RLHF files use none.
    """

    chat_template: str = ""


class SFT(base.ExampleObjective):
    """A decoder fine-tuned on prompt -> chosen reply (or on a conversation's assistant turns), packed, with the loss on
    reply tokens only."""

    name = "sft"
    Config = SFTConfig
    reader = readers.CONVERSATIONS

    def check(self):
        super().check()
        chat.check_template(self.config, hf.resolve_folder)

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
        return base.demonstration_rows(self.config, tokenizer, raw, where)

    def real_tokens(self, batch):
        return int(np.count_nonzero(batch["segment_ids"]))
