"""A policy against its SFT reference, judged by the frozen reward model of a `ppo` run: mean reward-model score on
held-out prompts, KL to the reference on the policy's own samples, win rate against the reference's samples, and
scored samples.

Everything goes through the PPO trainer's rollout (`PPOTrainer.rollout`: the KV-cache sampler, the reward model and
the policy's and reference's log-probs), with the policy's decoder parameters swapped in, so every decoder checkpoint
of the run's model (PPO, RLOO, GRPO, DPO or the SFT run itself) is scored the same way, on the same prompts and keys.
"""

from typing import Any

import jax
import numpy as np

from lmzoo import sharding

ROLLOUT_KEYS = ("sequences", "segment_ids", "responses", "mask", "scores", "sequence_kl")


class PolicyJudge:
    """Scores decoders of `run`'s model (a `ppo` run; `state` carries its frozen reference and reward model, and the
    reward normalisation).

    batches: held-out prompt batches ("prompts", "prompt_mask" [B, P], "example_weights" [B]); rows of weight 0 pad
    the last batch and are dropped. Each prompt gets `samples_per_prompt` responses; every decoder is sampled with
    the same keys (`seed`, then one per batch), so the reference scored as a policy meets its own samples.
    """

    def __init__(self, run, state: Any, batches: list[dict], *, samples_per_prompt: int = 1, seed: int = 0):
        trainer = run.compiled.trainer
        self.run, self.state, self.batches = run, state, batches
        self.samples_per_prompt, self.seed = samples_per_prompt, seed
        self.prompt_len = trainer.settings.prompt_len

        @jax.jit
        def rollout(params, frozen, batch, rng):
            full, _ = trainer.rollout(params, frozen, 0.0, batch, rng, samples_per_prompt=samples_per_prompt)
            return {k: full[k] for k in ROLLOUT_KEYS}

        self._rollout = rollout
        self._scoring_models = trainer.scoring_models(state)
        self.reference = self.rollouts(state.frozen["reference"])

    def rollouts(self, decoder: Any) -> dict[str, np.ndarray]:
        """The rollouts of `decoder` (params of the policy's decoder) on every held-out prompt, on the host, padding
        rows dropped: "sequences", "segment_ids" [N·K, P + T] (prompt ⊕ response), "responses", "mask" [N·K, T],
        "scores" (normalised reward-model scores, with the run's missing-EOS penalty) and "sequence_kl"
        (Σ_t log π − log π_ref over the response) [N·K]; row n·K + k is sample k of prompt n."""
        params = {**self.state.params, "decoder": decoder}
        parts = []
        for i, batch in enumerate(self.batches):
            rng = jax.random.fold_in(jax.random.key(self.seed), i)
            with self.run.context():
                device_batch = sharding.put_batch(
                    {k: batch[k] for k in ("prompts", "prompt_mask")}, self.run.compiled.batch_sharding
                )
                rollout = jax.device_get(self._rollout(params, self._scoring_models, device_batch, rng))
            keep = np.repeat(batch["example_weights"] > 0, self.samples_per_prompt)
            parts.append({k: np.asarray(v)[keep] for k, v in rollout.items()})
        return {k: np.concatenate([p[k] for p in parts]) for k in ROLLOUT_KEYS}

    def judge(self, decoder: Any) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """(metrics, rollouts) of `decoder`: "score" (mean normalised RM score), "kl" (mean sequence KL to the
        reference, nats), "win_rate" (share of samples the RM scores above the reference's sample of the same prompt
        and key, ties counting ½), "response_len" (mean tokens), "samples" (N·K)."""
        rollout = self.rollouts(decoder)
        return {
            "score": float(np.mean(rollout["scores"])),
            "kl": float(np.mean(rollout["sequence_kl"])),
            "win_rate": win_rate(rollout["scores"], self.reference["scores"]),
            "response_len": float(np.mean(np.sum(rollout["mask"], axis=1))),
            "samples": float(len(rollout["scores"])),
        }, rollout

    def sample_lines(self, rollout: dict[str, np.ndarray], count: int) -> list[str]:
        """The first `count` samples of `rollouts` as Markdown list items: score, KL, the prompt's end and the reply."""
        tokenizer, p = self.run.tokenizer, self.prompt_len
        lines = []
        for i in range(min(count, len(rollout["scores"]))):
            prompt = tokenizer.decode(rollout["sequences"][i, :p][rollout["segment_ids"][i, :p] > 0].tolist())
            response = tokenizer.decode(rollout["responses"][i][rollout["mask"][i] > 0].tolist())
            lines.append(
                f"- score {rollout['scores'][i]:+.2f}, KL {rollout['sequence_kl'][i]:.1f}: "
                f"`…{prompt[-60:]!r}` → `{response!r}`"
            )
        return lines


def win_rate(scores: np.ndarray, baseline: np.ndarray) -> float:
    """scores, baseline [N] (paired) -> mean of [s > b] + ½·[s = b]."""
    return float(np.mean((scores > baseline) + 0.5 * (scores == baseline)))
