"""Reward model from ranked comparisons (InstructGPT's second stage).

A backbone (the SFT decoder via `init_from=ckpt:SFT_WORKDIR`, or an encoder) with a scalar head
read at the last non-pad token (`lmzoo.rl.reward.reward_model`). One batch element holds the K
responses of one prompt (prompt ⊕ response ⊕ EOS, right-padded): one forward per response scores
all K-choose-2 pairs, and the loss is the mean over pairs of −log σ(r_w − r_l) (`reward.ranking_loss`).
Scores are normalised later, against samples of the SFT policy, by the PPO objective.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lmzoo.data import comparisons, readers, transforms
from lmzoo.models import experts
from lmzoo.objectives import base
from lmzoo.rl import reward
from lmzoo.trainers.state import Task


@dataclasses.dataclass(frozen=True)
class RewardModelConfig(base.ComparisonSplitConfig):
    """Attributes (besides the held-out split):
    max_responses: K, responses per prompt in one batch element (HH-RLHF pairs: 2).
    """

    max_responses: int = 2

    def __post_init__(self):
        super().__post_init__()
        if self.max_responses < 2:
            raise ValueError(
                f"config.objective.max_responses={self.max_responses}: a ranking needs at least 2 responses"
            )


def reward_model_task(model, pad_id: int) -> Task:
    """K-wise ranking loss of `model` (a `reward.reward_model`) on batch "tokens" [B, K, L], "ranks", "valid" [B, K]."""

    def init(rng, batch):
        tokens = batch["tokens"].reshape(-1, batch["tokens"].shape[-1])
        segment_ids, positions = reward.padding_inputs(tokens, pad_id)
        return model.init(rng, tokens, segment_ids=segment_ids, positions=positions)["params"], {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        applied = experts.AuxCollector(model) if experts.has_experts(model) else model
        rewards = reward.score(applied, params, batch["tokens"], pad_id=pad_id)
        valid = batch["valid"].astype(bool)
        if "example_weights" in batch:
            valid = valid & (batch["example_weights"][:, None] > 0)
        value, metrics = reward.ranking_loss(rewards, batch["ranks"], valid)
        if applied is not model:  # a backbone with experts: its layers' losses join the ranking loss
            aux, aux_metrics = applied.terms()
            value, metrics = value + aux, {**metrics, **aux_metrics}
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


def reward_examples(raw: list[comparisons.Comparison], tokenizer, config, where: str) -> dict[str, np.ndarray]:
    """ "tokens" [N, K, seq_len], "ranks", "valid" and "lengths" (non-pad tokens) [N, K]: each comparison's chosen
    reply ranked above the rejected one."""
    arrays = comparisons.reward_model_arrays(
        [comparisons.as_ranked(c) for c in raw],
        tokenizer.encode,
        max_len=config.data.seq_len,
        max_responses=config.objective.max_responses,
        pad_id=tokenizer.pad_id,
        eos_id=comparisons.response_end_id(tokenizer),
    )
    transforms.check_token_ids(arrays["tokens"], config.model.vocab_size, where=where)
    return {**arrays, "lengths": np.sum(arrays["tokens"] != tokenizer.pad_id, axis=-1).astype(np.int32)}


class RewardModel(base.ExampleObjective):
    """A scalar-headed backbone trained on the comparisons of `data.path`, held-out pairwise accuracy next to a length baseline."""

    name = "reward_model"
    lora_heads = "classifier"  # the scalar head no base provides
    no_dropout_because = "its ranking loss compares the scores of one prompt's replies"
    Config = RewardModelConfig
    reader = readers.COMPARISONS
    loss_is_token_nll = False  # -log sigmoid of reward margins
    evaluators = ("loss", "preference")

    def model(self):
        return reward.reward_model(super().model(), self.config.model.emb_dim)

    def task(self, model):
        return reward_model_task(model, pad_id=base.fixed_tokenizer(self.config).pad_id)

    def input_shapes(self, batch_size):
        k = self.fields.max_responses
        return {
            "tokens": base.int_inputs((batch_size, k, self.config.data.seq_len)),
            "ranks": base.int_inputs((batch_size, k)),
            "valid": jax.ShapeDtypeStruct((batch_size, k), jnp.bool_),
        }

    def examples(self, tokenizer, raw, where):
        return reward_examples(raw, tokenizer, self.config, where)

    def real_tokens(self, batch):
        return int(np.sum(batch["lengths"]))
