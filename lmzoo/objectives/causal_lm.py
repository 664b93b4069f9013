"""Causal language modelling: next-token prediction for decoders, with the head and loss fused
(`tasks.causal_lm_task`: the [B, T, V] logits are never stored); the recipe (`CausalLM`) trains on packed windows
of the run's documents.
"""

from lmzoo.objectives import base, tasks


class CausalLM(base.Objective):
    """Decoders on packed windows of the run's documents (nanoGPT's random windows or shuffled sequential ones)."""

    name = "causal_lm"

    def task(self, model):
        return tasks.causal_lm_task(model)

    def train_loader(self, tokenizer, raw, shard):
        return self.window_loader(tokenizer, raw, shard, self.config.data.seq_len)

    def eval_batches(self, tokenizer, raw, shard):
        return self.window_eval_batches(tokenizer, raw, shard, self.config.data.seq_len)
