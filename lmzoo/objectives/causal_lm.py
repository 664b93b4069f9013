"""Causal language modelling: next-token prediction for decoders, with the head and loss fused
(`losses.fused_head_loss` never stores the [B, T, V] logits); the recipe (`CausalLM`) trains on packed windows
of the run's documents.
"""

from lmzoo.objectives import base, losses
from lmzoo.trainers.state import Task


def causal_lm_task(model) -> Task:
    """Next-token prediction for a decoder taking (tokens, positions, segment_ids) with `return_hidden` and
    `output_embedding` (GPT-2): the head and loss are fused so the [B, T, V] logits are never stored."""

    def init(rng, batch):
        params = model.init({"params": rng, "dropout": rng}, batch["inputs"], positions=batch.get("positions"))[
            "params"
        ]
        return params, {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        _, hidden = model.apply(
            {"params": params},
            batch["inputs"],
            positions=batch.get("positions"),
            segment_ids=batch.get("segment_ids"),
            deterministic=not train,
            return_hidden=True,
            rngs={"dropout": rng},
        )
        embedding = model.apply({"params": params}, method=model.output_embedding)
        value, metrics = losses.fused_head_loss(hidden, embedding, batch)
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


class CausalLM(base.Objective):
    """Decoders on packed windows of the run's documents (nanoGPT's random windows or shuffled sequential ones)."""

    name = "causal_lm"

    def task(self, model):
        return causal_lm_task(model)

    def train_loader(self, tokenizer, raw, shard):
        return self.window_loader(tokenizer, raw, shard, self.config.data.seq_len)

    def eval_batches(self, tokenizer, raw, shard):
        return self.window_eval_batches(tokenizer, raw, shard, self.config.data.seq_len)
