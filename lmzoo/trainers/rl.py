"""The RLHF policy trainer (PPO, REINFORCE, RLOO, GRPO): one step is one iteration of rollout, scoring and updates.

`step` is three phases that the training loop jits and times apart (`phases`, `run_phase`): `generate` samples
responses to left-padded prompts with the KV-cache sampler (stop at EOS, mask after it); `score` scores
prompt ⊕ response with the frozen reward model, reads the log-probs of the frozen reference, shapes per-token
rewards −β·KL with the score on the last token and runs GAE; `update` makes `epochs` passes of `minibatches`
clipped PPO updates (or one REINFORCE/RLOO update on the same rollout), each optionally adding γ_ptx times the
LM loss on packed demonstrations (PPO-ptx). β follows the adaptive controller, whose value lives in the state.
GRPO scores without the KL in the reward, normalises the scores within each prompt's group of samples, and
adds β times the k3 KL to the reference to its clipped loss; the value head gets no loss.
Before the first step of a run, `prepare` fits the reward model's normalisation on the SFT policy's samples; the
state keeps it, so a resumed run or an evaluation reads it from the checkpoint instead of sampling again.
The maths is `lmzoo.rl`; the recipe around it (data, frozen models, settings) is `lmzoo.objectives.ppo`.
"""

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.experimental import io_callback

from lmzoo import decoding, kernels, lora
from lmzoo.models import experts, heads, kinds
from lmzoo.rl import policy_gradient, reward
from lmzoo.serving import slots
from lmzoo.trainers import base
from lmzoo.trainers.state import LossFn, Metrics

PTX_PREFIX = "ptx_"  # batch keys of the PPO-ptx demonstrations
PROBLEM_KEYS = ("problem_split", "problem_ids")  # which row of which split a prompt is: what reward functions read


@dataclasses.dataclass(frozen=True)
class RLSettings:
    """What a rollout and its updates do (an objective's config extends and validates it: `objectives.ppo.PPOConfig`)."""

    algorithm: str = "ppo"
    prompt_len: int = 64
    response_len: int = 32
    temperature: float = 1.0
    samples_per_prompt: int = 1
    # Each prompt run through the policy and the reference once for its samples_per_prompt replies (`shares_prompts`):
    # "on"; "off" (every row's prompt ⊕ reply whole: the fused attention kernels' form); "auto": on the CPU, where
    # attention is an einsum either way, and off on accelerators, whose fused kernels never hold the attention matrix
    # the shared form's einsum over the cache does (long contexts).
    shared_prompts: str = "auto"
    epochs: int = 4
    minibatches: int = 1
    clip_eps: float = 0.2
    value_clip_eps: float = 0.2
    value_coef: float = 0.1
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.05
    kl_target: float = 0.0
    kl_horizon: float = 10000.0
    kl_estimator: str = "k1"
    missing_eos_penalty: float = 1.0
    whiten_rewards: bool = False
    ptx_coef: float = 0.0
    # GRPO and its successors (`policy_gradient.grpo_loss`): Dr. GRPO (scale_rewards=False, loss_aggregation=
    # "constant"), DAPO (clip_eps_high, loss_aggregation="token", dynamic_sampling, overlong_cache), GSPO
    # (ratio_level="sequence", loss_aggregation="sequence"), the KL term of the loss (kl_loss "off" | "k1" | "k3").
    scale_rewards: bool = True
    loss_aggregation: str = "token"
    clip_eps_high: float = 0.0
    ratio_level: str = "token"
    kl_loss: str = "k3"
    dynamic_sampling: bool = False
    # DAPO's refill: each step's batch holds sampling_rounds x batch_size prompts, drawn batch_size at a time until
    # batch_size groups with differing rewards are kept (`_refilled_rollout`); 1 = no refill.
    sampling_rounds: int = 1
    overlong_cache: int = 0
    overlong_coef: float = 1.0
    # Multi-turn episodes with a tool (`PPOTrainer.environment`): at most max_turns policy turns of at most
    # turn_len tokens (0 = response_len) each, the environment's observations between them; all of them share
    # the response_len tokens of a response.
    max_turns: int = 1
    turn_len: int = 0
    # The value network: "head" (a value head on the policy's trunk) or a separate one started as "reward" (the reward
    # model, whose head `prepare` rescales by the reward normalisation) or "sft" (the SFT trunk under a zero head).
    value_model: str = "head"
    # Asynchronous GRPO: the update of step s uses the rollout drawn at step s - max_staleness by that step's policy
    # (its log-probs kept), corrected by truncated importance sampling capped at tis_cap; 0 = synchronous.
    max_staleness: int = 0
    tis_cap: float = 2.0


@struct.dataclass
class PPOState:
    """The policy (decoder + value head or network), its optimizer, the KL controller's β, the rng, the frozen models."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    frozen: Any  # {"reference", "reward"}: never checkpointed
    kl_coef: jax.Array
    # With a reward model: {"reward_gain", "reward_bias"} [] that `prepare` fits before the first step; checkpointed.
    reward_normalization: Any = struct.field(default_factory=dict)
    # max_staleness > 0: the rollouts drawn but not yet learnt from, [max_staleness, rows, ...], slot step % k, each
    # row's "version" the step that drew it (-1: none yet); checkpointed, so a resumed run learns from them exactly.
    pending: Any = struct.field(default_factory=dict)


def left_aligned(tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """tokens, mask [B, N] with real tokens anywhere -> the same real tokens, in order, at the right end of each row
    (what the samplers read: left-padded prompts whose last column is a real token)."""
    order = jnp.argsort(mask > 0, axis=1, stable=True)  # padding first, then the real tokens in their order
    return jnp.take_along_axis(tokens, order, axis=1), jnp.take_along_axis(mask, order, axis=1)


@struct.dataclass
class Episode:
    """A multi-turn response being written: tokens [B, T] filled from the left, "loss_mask" [B, T] (float; 1 on the
    policy's tokens), "context_mask" [B, T] (float; 1 on every written token) and "filled" [B] (tokens written)."""

    tokens: jax.Array
    loss_mask: jax.Array
    context_mask: jax.Array
    filled: jax.Array

    @classmethod
    def empty(cls, batch: int, length: int, pad_id: int) -> "Episode":
        zeros = jnp.zeros((batch, length), jnp.float32)
        return cls(jnp.full((batch, length), pad_id, jnp.int32), zeros, zeros, jnp.zeros((batch,), jnp.int32))

    @property
    def full(self) -> jax.Array:
        return self.filled >= self.tokens.shape[1]

    def append(self, tokens: jax.Array, keep: jax.Array, *, policy: bool) -> "Episode":
        """The episode with each row's kept tokens (tokens, keep [B, L]; keep a prefix of 1s) written after its
        `filled` ones, as far as the row has room; `policy`: whether the loss counts them."""
        length = self.tokens.shape[1]
        where = self.filled[:, None] + jnp.cumsum(keep > 0, axis=1) - 1  # [B, L]: the column each kept token lands in
        valid = (keep > 0) & (where < length)
        lands = valid[:, :, None] & (where[:, :, None] == jnp.arange(length)[None, None])  # [B, L, T]
        written = jnp.any(lands, axis=1)
        values = jnp.sum(jnp.where(lands, tokens[:, :, None], 0), axis=1)
        return Episode(
            tokens=jnp.where(written, values, self.tokens).astype(jnp.int32),
            loss_mask=jnp.where(written, float(policy), self.loss_mask),
            context_mask=jnp.where(written, 1.0, self.context_mask),
            filled=self.filled + jnp.sum(valid, axis=1).astype(jnp.int32),
        )


def rollout_inputs(
    prompts: jax.Array, prompt_mask: jax.Array, responses: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    """prompt [B, P] ⊕ response [B, T] -> "sequences", "segment_ids" (1 on real tokens) and "positions" [B, P + T],
    positions counting real tokens only, as the sampler numbered them."""
    valid = jnp.concatenate([prompt_mask, mask.astype(prompt_mask.dtype)], axis=1)
    return {
        "sequences": jnp.concatenate([prompts, responses], axis=1),
        "segment_ids": valid.astype(jnp.int32),
        "positions": jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32),
    }


@dataclasses.dataclass(frozen=True)
class PPOTrainer:
    """The trainer protocol for RLHF: `step` = `generate`, `score`, `update` (each pure and jittable on its own: the
    benchmark times them apart) and the KL controller; `eval_step` = a rollout on held-out prompts with a fixed key."""

    policy: heads.LMWithValueHead | heads.LMWithValueModel
    reward_model: heads.SequenceClassifier | None  # None: the reward functions alone score
    settings: RLSettings
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    batch_size: int
    eos_id: int
    pad_id: int
    ptx_loss: LossFn | None = None  # a Task loss of the decoder on packed demonstrations (PPO-ptx)
    vocab_size: int | None = None  # the tokenizer's: rollouts never draw the ids a padded model vocabulary adds
    # LoRA: the trained params are adapters over the frozen reference (the policy's start) and the modules its
    # train_in_full selects (the value head); the policy runs on them merged (`policy_params`).
    lora_config: lora.LoraConfig | None = None
    # Verifiable rewards computed on the host between generation and scoring (the objective's reward functions):
    # (responses [B, T], mask [B, T], problem_split [B], problem_ids [B]) -> (rewards [F, B], failures [F]), float32;
    # each function's rewards weighted by its `.weights` [F] and summed, reported under its `.names`.
    host_rewards: Any = None
    # A tool the policy talks to over several turns (the objective's environment, on the host through a callback):
    # (turn tokens [B, L], turn mask [B, L], turn index (-1: reset), problem_split [B], problem_ids [B]) ->
    # (observation tokens [B, O], observation mask [B, O], done [B], reward [B]); `.stop_sequences` end a turn.
    environment: Any = None

    @property
    def decoder(self):
        return self.policy.decoder

    def init(self, rng: jax.Array) -> PPOState:
        policy_rng, reference_rng, reward_rng, state_rng = jax.random.split(rng, 4)
        s = self.settings
        tokens = jnp.zeros((self.batch_size, s.prompt_len + s.response_len), jnp.int32)
        params = self.policy.init(policy_rng, tokens)["params"]
        if self.lora_config is not None:
            params = lora.init_adapters(jax.random.fold_in(policy_rng, 1), params, self.lora_config)
        frozen = {"reference": self.decoder.init(reference_rng, tokens)["params"]}
        normalization = {}
        if self.reward_model is not None:
            frozen["reward"] = self.reward_model.init(reward_rng, tokens, segment_ids=jnp.ones_like(tokens))["params"]
            normalization = {"reward_gain": jnp.ones((), jnp.float32), "reward_bias": jnp.zeros((), jnp.float32)}
        return PPOState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.tx.init(params),
            rng=jax.random.key_data(state_rng),
            frozen=frozen,
            kl_coef=jnp.asarray(s.kl_coef, jnp.float32),
            reward_normalization=normalization,
            pending=self._no_pending(),
        )

    def _no_pending(self) -> dict:
        """The empty rollout queue of asynchronous GRPO: max_staleness slots of a rollout's rows, version -1."""
        s, k = self.settings, self.settings.max_staleness
        if k == 0:
            return {}
        rows = self.batch_size * s.samples_per_prompt
        ints = lambda *shape: jnp.zeros((k, rows, *shape), jnp.int32)  # noqa: E731
        floats = lambda *shape: jnp.zeros((k, rows, *shape), jnp.float32)  # noqa: E731
        pending = {
            "prompts": ints(s.prompt_len),
            "prompt_mask": ints(s.prompt_len),
            "responses": ints(s.response_len),
            "mask": floats(s.response_len),
            "behaviour_logprobs": floats(s.response_len),
            "version": jnp.full((k, rows), -1, jnp.int32),
        }
        if self.host_rewards is not None:
            pending.update({key: ints() for key in PROBLEM_KEYS})
        return pending

    def initial_carry(self, batch_size: int) -> dict:
        return {}

    def with_params(self, state: PPOState, params: Any) -> PPOState:
        return state.replace(params=params, opt_state=self.tx.init(params))

    def policy_params(self, params, frozen, *, train: bool = False) -> Any:
        """The params the policy runs on: the trained `params`, or under LoRA those merged into the frozen reference
        ({"decoder": ..., "value_head": ...}); with `train`, in LoRA's training form (`lora.attach`), for the loss
        that is differentiated."""
        if self.lora_config is None:
            return params
        combine = lora.attach if train else lora.merge
        return combine({"decoder": frozen["reference"]}, params, self.lora_config)

    def scoring_models(self, state: PPOState) -> dict[str, Any]:
        """The frozen models as scoring reads them: the reference, the reward model and its normalisation (`prepare`)."""
        return {**state.frozen, **state.reward_normalization}

    def model_params(self, state: PPOState) -> Any:
        """The policy's params (evaluation, generation, export): `policy_params` of the state."""
        return self.policy_params(state.params, state.frozen)

    def _response_window(self, responses: jax.Array) -> tuple[int, int]:
        """The positions of prompt ⊕ responses [B, T] whose logits predict the response tokens: (P - 1, P - 1 + T)."""
        start = self.settings.prompt_len - 1
        return start, start + responses.shape[1]

    def _logprobs(self, logits: jax.Array, responses: jax.Array) -> tuple[jax.Array, jax.Array]:
        """logits [B, T, V] of the response window -> (log π(y_t), entropy) [B, T]."""
        return policy_gradient.response_logprobs(logits, responses, temperature=self.settings.temperature)

    @property
    def shares_prompts(self) -> bool:
        """Whether the forwards over a rollout run each prompt once for its G samples (`_response_logits`): with
        shared_prompts "on" (or "auto" on the CPU), G > 1, an algorithm that reads no values (PPO's value loss reads
        the prompts' hidden states) and no experts (their auxiliary losses count every token the router sees)."""
        s = self.settings
        return (
            (s.shared_prompts == "on" or (s.shared_prompts == "auto" and kernels.on_cpu()))
            and s.samples_per_prompt > 1
            and s.algorithm != "ppo"
            and not experts.has_experts(self.policy)
        )

    def _response_logits(self, model, params, inputs: dict[str, jax.Array], group: int) -> jax.Array:
        """The logits [B·G, T, V] of `model` (the policy or the reference decoder) predicting the responses of
        `rollout_inputs` rows [B·G, P + T] whose runs of `group` rows share their prompt, each prompt run once
        (`slots.shared_prompt_logits`); what `window_logits` over the rows at `_response_window` gives."""
        prompt_len = self.settings.prompt_len
        return slots.shared_prompt_logits(
            model,
            params,
            inputs["sequences"][::group, :prompt_len],
            inputs["segment_ids"][::group, :prompt_len],
            inputs["sequences"][:, prompt_len:],
            inputs["segment_ids"][:, prompt_len:],
        )

    def generate(self, params, batch, rng, *, samples_per_prompt: int) -> dict[str, jax.Array]:
        """`samples_per_prompt` responses to each of batch "prompts"/"prompt_mask" [B, P] from the KV-cache sampler
        (each prompt prefilled once) -> "prompts", "prompt_mask" [B·K, P], "responses" [B·K, T] (pad after the EOS)
        and "mask" [B·K, T] (float); with an environment, episodes of several turns (`_episodes`), adding
        "context_mask" [B·K, T]."""
        s = self.settings
        prompts = jnp.repeat(batch["prompts"], samples_per_prompt, axis=0)
        prompt_mask = jnp.repeat(batch["prompt_mask"], samples_per_prompt, axis=0)
        problems = {k: jnp.repeat(batch[k], samples_per_prompt, axis=0) for k in PROBLEM_KEYS if k in batch}
        samples = {**problems, "prompts": prompts, "prompt_mask": prompt_mask}
        if self.environment is not None:
            return {**samples, **self._episodes(params, prompts, prompt_mask, problems, rng)}
        sampled = decoding.sample(  # each prompt prefilled once for its samples
            *kinds.decoding_form(self.decoder, params["decoder"]),
            batch["prompts"],
            batch["prompt_mask"],
            rng,
            samples_per_prompt=samples_per_prompt,
            max_new_tokens=s.response_len,
            temperature=s.temperature,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            vocab_size=self.vocab_size,
        )
        mask = sampled.mask.astype(jnp.float32)
        samples = {**samples, "responses": sampled.tokens, "mask": mask}
        if s.max_staleness:  # the drawing policy's log-probs, for the importance weights of a later update
            samples["behaviour_logprobs"] = sampled.log_probs * mask
        return samples

    def _episodes(self, params, prompts, prompt_mask, problems, rng) -> dict[str, jax.Array]:
        """Episodes of up to max_turns policy turns, each sampled (up to turn_len tokens, to EOS or one of the
        environment's stop sequences) after the prompt and the episode so far, the environment's observation
        inserted after it; a row ends at EOS, when the environment says done, at max_turns or when its response_len
        tokens are full. -> "responses" [B, T] (policy and environment tokens, in order), "mask" [B, T] (1 on the
        policy's tokens: the loss's), "context_mask" [B, T] (1 on both: what the policy conditions on),
        "environment_rewards" [B] (the turns' rewards summed) and "turns" [B]."""
        s, env = self.settings, self.environment
        batch, length = prompts.shape[0], s.response_len
        episode = Episode.empty(batch, length, self.pad_id)
        ids = (problems["problem_split"], problems["problem_ids"])
        observation = self._observe(jnp.full((batch, 1), self.pad_id), jnp.zeros((batch, 1), jnp.int32), -1, *ids)
        episode = episode.append(observation[0], observation[1], policy=False)
        active, rewards, turns = jnp.ones((batch,), bool), jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,))
        decoder, decoder_params = kinds.decoding_form(self.decoder, params["decoder"])
        for turn in range(s.max_turns):
            context, context_mask = left_aligned(
                jnp.concatenate([prompts, episode.tokens], axis=1),
                jnp.concatenate([prompt_mask, episode.context_mask.astype(prompt_mask.dtype)], axis=1),
            )
            sampled = decoding.sample(
                decoder,
                decoder_params,
                context,
                context_mask,
                jax.random.fold_in(rng, turn),
                max_new_tokens=s.turn_len or length,
                temperature=s.temperature,
                eos_id=self.eos_id,
                stop_sequences=env.stop_sequences,
                pad_id=self.pad_id,
                vocab_size=self.vocab_size,
            )
            kept = sampled.mask * active[:, None]
            episode = episode.append(sampled.tokens, kept, policy=True)
            turns = turns + active
            active = active & ~jnp.any((sampled.tokens == self.eos_id) & (kept > 0), axis=1) & ~episode.full
            if turn == s.max_turns - 1:
                break
            tokens, mask, done, reward = self._observe(sampled.tokens, kept, turn, *ids)
            episode = episode.append(tokens, mask * active[:, None], policy=False)
            rewards = rewards + reward * active
            active = active & ~done & ~episode.full
        return {
            "responses": episode.tokens,
            "mask": episode.loss_mask,
            "context_mask": episode.context_mask,
            "environment_rewards": rewards,
            "turns": turns,
        }

    def _observe(self, tokens, mask, turn: int, problem_split, problem_ids):
        """The environment's answer to a turn (turn -1: its reset), on the host, in order with the other turns."""
        batch, length = tokens.shape[0], self.environment.observation_len
        shapes = (
            jax.ShapeDtypeStruct((batch, length), jnp.int32),
            jax.ShapeDtypeStruct((batch, length), jnp.int32),
            jax.ShapeDtypeStruct((batch,), bool),
            jax.ShapeDtypeStruct((batch,), jnp.float32),
        )
        return io_callback(
            self.environment, shapes, tokens, mask, jnp.int32(turn), problem_split, problem_ids, ordered=True
        )

    def prepare(self, state: PPOState, prompts: dict[str, Any]) -> tuple[PPOState, dict[str, jax.Array]]:
        """The run's first phase, before its first step: with a reward model, the normalisation (gain, bias) that gives
        its raw scores of one reference sample per prompt ("prompts", "prompt_mask" [N, P]) mean 0 and std 1, kept in
        the state; a value network started as the reward model (value_model "reward") takes it into its head
        (gain·head + bias: its value of a whole sequence is the normalised score). The key is fixed. -> (state, what
        was fitted, as scalars)."""
        if self.reward_model is None:
            return state, {}
        samples = self.generate(
            {"decoder": state.frozen["reference"]}, prompts, jax.random.key(1), samples_per_prompt=1
        )
        context = samples.get("context_mask", samples["mask"])
        inputs = rollout_inputs(samples["prompts"], samples["prompt_mask"], samples["responses"], context)
        forward = dict(segment_ids=inputs["segment_ids"], positions=inputs["positions"])
        scores = self.reward_model.apply({"params": state.frozen["reward"]}, inputs["sequences"], **forward)[:, 0]
        gain, bias = reward.fit_normalization(scores)
        params = state.params
        if self.settings.value_model == "reward":
            head = params["value_model"]["classifier"]
            scaled = {"kernel": head["kernel"] * gain, "bias": head["bias"] * gain + bias}
            params = {**params, "value_model": {**params["value_model"], "classifier": scaled}}
        normalization = {"reward_gain": gain.astype(jnp.float32), "reward_bias": bias.astype(jnp.float32)}
        fitted = {
            "reward_normalization/samples": jnp.asarray(scores.shape[0], jnp.float32),
            "reward_normalization/raw_mean": jnp.mean(scores),
            "reward_normalization/raw_std": jnp.std(scores),
            "reward_normalization/gain": gain,
            "reward_normalization/bias": bias,
        }
        return state.replace(params=params, reward_normalization=normalization), fitted

    @property
    def update_reads_old_logprobs(self) -> bool:
        """GRPO with one optimizer update per rollout (epochs x minibatches = 1) and unwhitened rewards: the update's
        forward runs the very params that score the rollout, so its own log-probs (held constant) are the old ones and
        scoring skips the policy's forward, as trl does; the policy's entropy and KL metrics then come from the
        update."""
        s = self.settings
        return s.algorithm == "grpo" and s.epochs * s.minibatches == 1 and not s.whiten_rewards

    def score(
        self,
        params,
        frozen,
        kl_coef,
        samples: dict[str, jax.Array],
        *,
        policy_forward: bool = True,
        samples_per_prompt: int = 1,
    ) -> tuple[dict[str, jax.Array], Metrics]:
        """Scores `generate`'s samples (`_scores`: the frozen reward model, the reward functions), reads the policy's and
        the reference's log-probs and the values, shapes the rewards and runs GAE -> the fixed targets of the updates
        (every array [B·K, ...]) with the rollout metrics. policy_forward False (`update_reads_old_logprobs`): GRPO's
        targets without the policy's log-probs, which its one update reads itself. samples_per_prompt: the K of the
        samples' groups, whose prompt the forwards run once (`shares_prompts`)."""
        s = self.settings
        group = samples_per_prompt if self.shares_prompts else 1
        prompts, prompt_mask, responses, mask = (samples[k] for k in ("prompts", "prompt_mask", "responses", "mask"))
        has_eos = jnp.any((responses == self.eos_id) & (mask > 0), axis=1)
        # An episode's environment tokens are in the context the policy reads, never in its loss (`mask`).
        inputs = rollout_inputs(prompts, prompt_mask, responses, samples.get("context_mask", mask))
        forward = dict(segment_ids=inputs["segment_ids"], positions=inputs["positions"])
        ref_logprobs = None
        if s.algorithm != "grpo" or s.kl_loss != "off":  # GRPO without a KL term never runs the reference
            if group > 1:
                ref_logits = self._response_logits(self.decoder, frozen["reference"], inputs, group)
            else:
                ref_logits, _ = self.decoder.apply(
                    {"params": frozen["reference"]},
                    inputs["sequences"],
                    self._response_window(responses),
                    method="window_logits",
                    **forward,
                )
            ref_logprobs, _ = self._logprobs(ref_logits, responses)
        if "scores" in samples:  # scored while drawn (`_refilled_rollout`)
            scores, raw_scores, reward_metrics = samples["scores"], samples["raw_scores"], {}
        else:
            scores, raw_scores, reward_metrics = self._scores(frozen, inputs, forward, samples, has_eos)
        rows = jnp.asarray(scores.shape[0], jnp.float32)
        metrics = {**reward_metrics, "objective/raw_scores": (jnp.sum(raw_scores), rows)}
        rollout = {**inputs, "responses": responses, "scores": scores}
        if policy_forward:
            if group > 1:  # an algorithm without values: GAE's, unused, over values of 0
                logits = self._response_logits(self.policy, params, inputs, group)
                values = jnp.zeros(inputs["sequences"].shape, jnp.float32)
            else:
                logits, values = self.policy.apply(
                    {"params": params}, inputs["sequences"], logits_window=self._response_window(responses), **forward
                )
            logprobs, entropy = self._logprobs(logits, responses)
            if ref_logprobs is None:  # KL 0 in every metric
                ref_logprobs = jax.lax.stop_gradient(logprobs)
            targets, target_metrics = policy_gradient.ppo_rollout_targets(
                scores,
                has_eos,
                jax.lax.stop_gradient(logprobs),
                ref_logprobs,
                jax.lax.stop_gradient(policy_gradient.align_to_responses(values, s.prompt_len)),
                mask,
                kl_coef=0.0 if s.algorithm == "grpo" else kl_coef,  # GRPO's KL is a loss term, not in the reward
                gamma=s.gamma,
                lam=s.lam,
                kl_estimator=s.kl_estimator,
                whiten_rewards=s.whiten_rewards,
            )
            metrics.update(target_metrics)
            metrics.update(self._policy_metrics(logprobs, entropy, None, mask))
            rollout.update(targets)
            rollout["sequence_kl"] = jnp.sum((logprobs - ref_logprobs) * mask, axis=1)
            # score − β·Σ_t kl_t (scaled if whitened; GRPO: the score)
            rollout["sequence_returns"] = jnp.sum(targets["rewards"], axis=1)
        else:
            rollout.update(mask=mask, sequence_returns=scores)
            metrics.update(policy_gradient.score_metrics(scores, has_eos, mask))
        if "behaviour_logprobs" in samples:
            rollout["behaviour_logprobs"] = samples["behaviour_logprobs"]
        if s.algorithm == "grpo":
            if ref_logprobs is not None:
                rollout["ref_logprobs"] = ref_logprobs
            if s.dynamic_sampling:
                grouped = rollout["sequence_returns"].reshape(-1, s.samples_per_prompt)
                informative = policy_gradient.informative_groups(grouped)
                groups = jnp.asarray(informative.shape[0], jnp.float32)
                metrics["objective/informative_groups"] = (jnp.sum(informative.astype(jnp.float32)), groups)
        return jax.tree.map(jax.lax.stop_gradient, rollout), metrics

    def _policy_metrics(self, logprobs, entropy, ref_logprobs, mask) -> Metrics:
        """The sampled tokens' negative log-likelihood and the policy's entropy per response (and, given the
        reference's log-probs, the KL to it as `kl_estimator` estimates it) as (sum, count) metrics."""
        rows = jnp.asarray(mask.shape[0], jnp.float32)
        metrics = {
            "objective/entropy": (jnp.sum(-logprobs * mask), rows),
            "policy/rollout_entropy": policy_gradient.masked_stats(entropy, mask),
        }
        if ref_logprobs is not None:
            kl = policy_gradient.kl_estimate(logprobs, ref_logprobs, self.settings.kl_estimator) * mask
            metrics["objective/kl"] = (jnp.sum(kl), rows)
        return jax.tree.map(jax.lax.stop_gradient, metrics)

    def _refilled_rollout(self, params, frozen, batch, rng) -> tuple[dict[str, jax.Array], Metrics]:
        """DAPO's dynamic sampling with refill (Yu et al. 2025): batch holds sampling_rounds x B prompts; round r draws
        `samples_per_prompt` replies to prompts r·B .. r·B+B-1 and scores them (`_scores`), until B groups whose rewards
        differ are kept, in the order drawn. Round 0's groups are kept informative first, so where every round together
        finds fewer than B, its uninformative groups fill the rest (the update masks them out). -> (`generate`'s samples
        of B groups with their "scores" and "raw_scores" [B·G]; the reward metrics of every reply drawn, and the rounds
        run)."""
        s, groups, size = self.settings, self.batch_size, self.settings.samples_per_prompt
        prompt_keys = ("prompts", "prompt_mask", *PROBLEM_KEYS)

        def draw(r):
            prompts = {k: jax.lax.dynamic_slice_in_dim(batch[k], r * groups, groups) for k in prompt_keys if k in batch}
            samples = self.generate(params, prompts, jax.random.fold_in(rng, r), samples_per_prompt=size)
            has_eos = jnp.any((samples["responses"] == self.eos_id) & (samples["mask"] > 0), axis=1)
            inputs = rollout_inputs(
                samples["prompts"],
                samples["prompt_mask"],
                samples["responses"],
                samples.get("context_mask", samples["mask"]),
            )
            forward = dict(segment_ids=inputs["segment_ids"], positions=inputs["positions"])
            scores, raw_scores, metrics = self._scores(frozen, inputs, forward, samples, has_eos)
            informative = policy_gradient.informative_groups(scores.reshape(groups, size))
            return {**samples, "scores": scores, "raw_scores": raw_scores}, metrics, informative

        def rows_of(group_targets):  # [B] group slots (B: dropped) -> [B·G] row slots
            return (group_targets[:, None] * size + jnp.arange(size)).reshape(-1)

        first, metrics, informative = draw(0)
        order = jnp.argsort(~informative, stable=True)  # informative groups first
        kept_samples = jax.tree.map(lambda x: x[rows_of(order)], first)

        def cond(carry):
            r, kept, _, _ = carry
            return (r < s.sampling_rounds) & (kept < groups)

        def body(carry):
            r, kept, kept_samples, metrics = carry
            drawn, drawn_metrics, informative = draw(r)
            slot = jnp.where(informative, kept + jnp.cumsum(informative) - 1, groups)
            targets = rows_of(slot)  # slots from B on (the uninformative, those past a full batch): dropped
            kept_samples = jax.tree.map(lambda old, new: old.at[targets].set(new, mode="drop"), kept_samples, drawn)
            metrics = jax.tree.map(jnp.add, metrics, drawn_metrics)
            return r + 1, kept + jnp.sum(informative), kept_samples, metrics

        start = (jnp.int32(1), jnp.sum(informative).astype(jnp.int32), kept_samples, metrics)
        rounds, _, kept_samples, metrics = jax.lax.while_loop(cond, body, start)
        metrics["objective/sampling_rounds"] = (rounds.astype(jnp.float32), jnp.ones((), jnp.float32))
        return kept_samples, metrics

    def _scores(self, frozen, inputs, forward, samples, has_eos) -> tuple[jax.Array, jax.Array, Metrics]:
        """(scores [B], raw scores [B], metrics): the reward model's score normalised (`prepare`), plus each reward
        function's weighted reward (on the host, through a callback), the missing-EOS penalty and DAPO's overlong
        shaping."""
        s = self.settings
        rows = jnp.asarray(samples["responses"].shape[0], jnp.float32)
        raw_scores = scores = jnp.zeros(samples["responses"].shape[0], jnp.float32)
        metrics = {}
        if self.reward_model is not None:
            raw_scores = self.reward_model.apply({"params": frozen["reward"]}, inputs["sequences"], **forward)[:, 0]
            scores = reward.normalize(raw_scores, frozen["reward_gain"], frozen["reward_bias"])
        if self.host_rewards is not None:
            count, batch = len(self.host_rewards.names), samples["responses"].shape[0]
            shapes = (jax.ShapeDtypeStruct((count, batch), jnp.float32), jax.ShapeDtypeStruct((count,), jnp.float32))
            per_function, failures = jax.pure_callback(
                self.host_rewards,
                shapes,
                samples["responses"],
                samples.get("context_mask", samples["mask"]),  # an episode's text includes the tool's answers
                samples["problem_split"],
                samples["problem_ids"],
            )
            functions = jnp.asarray(self.host_rewards.weights, jnp.float32) @ per_function
            raw_scores = raw_scores + functions
            scores = scores + functions
            for i, name in enumerate(self.host_rewards.names):
                metrics[f"rewards/{name}"] = (jnp.sum(per_function[i]), rows)
                metrics[f"rewards/{name}_failures"] = (failures[i], jnp.ones((), jnp.float32))
        if "environment_rewards" in samples:
            scores = scores + samples["environment_rewards"]
            limit = jnp.asarray(s.max_turns, jnp.float32)
            metrics["episode/turns"] = (jnp.sum(samples["turns"]), rows)
            metrics["episode/turn_limit"] = (jnp.sum((samples["turns"] >= limit).astype(jnp.float32)), rows)
            metrics["episode/environment_tokens"] = (jnp.sum(samples["context_mask"] - samples["mask"]), rows)
        if s.missing_eos_penalty > 0:
            scores = policy_gradient.penalize_missing_eos(scores, has_eos, penalty=s.missing_eos_penalty)
        if s.overlong_cache > 0:
            lengths = jnp.sum(samples.get("context_mask", samples["mask"]), axis=1)
            penalty = policy_gradient.overlong_penalty(lengths, max_len=s.response_len, cache_len=s.overlong_cache)
            scores = scores + s.overlong_coef * penalty
            metrics["objective/overlong_penalty"] = (jnp.sum(penalty), rows)
        return scores, raw_scores, metrics

    def rollout(
        self, params, frozen, kl_coef, batch, rng, *, samples_per_prompt: int
    ) -> tuple[dict[str, jax.Array], Metrics]:
        """`generate` then `score`."""
        samples = self.generate(params, batch, rng, samples_per_prompt=samples_per_prompt)
        return self.score(params, frozen, kl_coef, samples, samples_per_prompt=samples_per_prompt)

    def minibatch_loss(
        self,
        params,
        minibatch: dict[str, jax.Array],
        demonstrations: dict[str, jax.Array] | None = None,
        frozen: Any = None,
        *,
        prompt_group: int = 1,
    ) -> tuple[jax.Array, Metrics]:
        """The PPO (or REINFORCE) loss of a rollout minibatch, plus ptx_coef x the SFT loss of the policy's decoder on
        `demonstrations` (packed "inputs", "targets", "weights", "segment_ids", "positions" [R, L]) when given;
        `params` are the trained ones (`frozen`: the state's, which LoRA's policy params are merged into).
        prompt_group > 1: the minibatch's rows share their prompt in runs of that many, run once (`shares_prompts`)."""
        adapted = lora.training_form(self.lora_config, train=False) if self.lora_config else contextlib.nullcontext()
        with adapted:
            params = self.policy_params(params, frozen, train=True)
            loss, metrics = self._policy_loss(params, minibatch, prompt_group)
            if demonstrations is None:
                return loss, metrics
            ptx_loss, (ptx_metrics, _) = self.ptx_loss(
                params["decoder"], {}, {}, demonstrations, jax.random.key(0), step=0, train=False
            )
        ptx_metrics = {"ptx/loss": ptx_metrics["loss"], "ptx/accuracy": ptx_metrics["accuracy"]}
        return loss + self.settings.ptx_coef * ptx_loss, {**metrics, **jax.tree.map(jax.lax.stop_gradient, ptx_metrics)}

    def _policy_loss(self, params, minibatch: dict[str, jax.Array], prompt_group: int) -> tuple[jax.Array, Metrics]:
        """The algorithm's loss of a rollout minibatch; a policy with experts adds its layers' auxiliary losses."""
        if prompt_group > 1:
            return self._algorithm_loss(
                self._response_logits(self.policy, params, minibatch, prompt_group), None, minibatch
            )
        applied = experts.AuxCollector(self.policy) if experts.has_experts(self.policy) else self.policy
        logits, values = applied.apply(
            {"params": params},
            minibatch["sequences"],
            segment_ids=minibatch["segment_ids"],
            positions=minibatch["positions"],
            logits_window=self._response_window(minibatch["responses"]),
        )
        loss, metrics = self._algorithm_loss(logits, values, minibatch)
        if applied is not self.policy:
            aux, aux_metrics = applied.terms()
            loss, metrics = loss + aux, {**metrics, **aux_metrics}
        return loss, metrics

    def _algorithm_loss(self, logits, values, minibatch: dict[str, jax.Array]) -> tuple[jax.Array, Metrics]:
        """PPO's clipped loss (with the value loss), GRPO's, or REINFORCE/RLOO's, from the policy's logits and values."""
        s = self.settings
        logprobs, entropy = self._logprobs(logits, minibatch["responses"])
        if s.algorithm == "ppo":
            return policy_gradient.ppo_loss(
                logprobs,
                entropy,
                policy_gradient.align_to_responses(values, s.prompt_len),
                minibatch,
                clip_eps=s.clip_eps,
                value_clip_eps=s.value_clip_eps,
                value_coef=s.value_coef,
                entropy_coef=s.entropy_coef,
            )
        if s.algorithm == "grpo":
            ref_logprobs = minibatch.get("ref_logprobs")
            extra = {}
            if "old_logprobs" not in minibatch:  # `update_reads_old_logprobs`: these params drew and scored it
                minibatch = {**minibatch, "old_logprobs": jax.lax.stop_gradient(logprobs)}
                kl_ref = jax.lax.stop_gradient(logprobs) if ref_logprobs is None else ref_logprobs
                extra = self._policy_metrics(logprobs, entropy, kl_ref, minibatch["mask"])
            loss, metrics = policy_gradient.grpo_loss(
                logprobs,
                None if s.kl_loss == "off" else ref_logprobs,
                minibatch,
                clip_eps=s.clip_eps,
                kl_coef=s.kl_coef,
                clip_eps_high=s.clip_eps_high or None,
                aggregation=s.loss_aggregation,
                ratio_level=s.ratio_level,
                kl_estimator=s.kl_loss,
                tis_cap=s.tis_cap if s.max_staleness else None,
            )
            return loss, {**metrics, **extra}
        mask = minibatch["mask"]
        loss, metrics = policy_gradient.reinforce_loss(logprobs, minibatch["sequence_advantages"], mask)
        loss = loss - s.entropy_coef * policy_gradient.masked_mean(entropy, mask)
        return loss, {**metrics, "policy/entropy": jax.lax.stop_gradient(policy_gradient.masked_stats(entropy, mask))}

    def update(
        self,
        params,
        opt_state,
        rollout: dict[str, jax.Array],
        rng: jax.Array,
        demonstrations: dict[str, jax.Array] | None = None,
        frozen: Any = None,
    ):
        """`epochs` passes over the rollout, each a fresh permutation split into `minibatches` optimizer updates
        -> (params, opt_state, metrics summed over the updates). REINFORCE/RLOO first turn the sequence returns into
        per-prompt baselined advantages, GRPO into group-normalised ones. `demonstrations` (PPO-ptx, [R, L] arrays) are
        split into `minibatches` strided parts, part m joining minibatch m of every epoch. `frozen`: the state's
        frozen params, which LoRA's trained `params` are merged into."""
        s = self.settings
        rows = rollout["mask"].shape[0]
        if rows % s.minibatches:
            raise ValueError(f"{rows} rollout rows do not split into config.objective.minibatches={s.minibatches}")
        if s.algorithm != "ppo":
            grouped = rollout["sequence_returns"].reshape(-1, s.samples_per_prompt)
            if s.algorithm == "grpo":
                advantages = policy_gradient.group_advantages(grouped, scale_by_std=s.scale_rewards)
                if s.dynamic_sampling:  # DAPO: groups of equal rewards teach nothing and only dilute the token mean
                    informative = jnp.repeat(policy_gradient.informative_groups(grouped), s.samples_per_prompt)
                    rollout = {**rollout, "mask": rollout["mask"] * informative[:, None].astype(rollout["mask"].dtype)}
            else:
                baseline = "mean" if s.algorithm == "reinforce" else "leave_one_out"
                advantages = policy_gradient.reinforce_advantages(grouped, baseline=baseline)
            rollout = {**rollout, "sequence_advantages": advantages.reshape(-1)}
        # Minibatches of whole groups when their prompts are run once: the groups are shuffled, not the rows.
        group = (
            s.samples_per_prompt if self.shares_prompts and (rows // s.samples_per_prompt) % s.minibatches == 0 else 1
        )
        order = jnp.stack([jax.random.permutation(jax.random.fold_in(rng, e), rows // group) for e in range(s.epochs)])
        order = (order[..., None] * group + jnp.arange(group)).reshape(s.epochs, rows)
        indices = order.reshape(s.epochs * s.minibatches, rows // s.minibatches)
        parts = None if demonstrations is None else base.split_microbatches(demonstrations, s.minibatches)
        grad_fn = jax.value_and_grad(functools.partial(self.minibatch_loss, prompt_group=group), has_aux=True)

        def one_update(carry, xs):
            params, opt_state = carry
            index, part = xs
            part_demonstrations = None if parts is None else jax.tree.map(lambda x: x[part], parts)
            minibatch = jax.tree.map(lambda x: x[index], rollout)
            (_, metrics), grads = grad_fn(params, minibatch, part_demonstrations, frozen)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            one = jnp.ones((), jnp.float32)
            return (optax.apply_updates(params, updates), opt_state), {
                **metrics,
                "grad_norm": (optax.global_norm(grads), one),
            }

        part_ids = jnp.arange(s.epochs * s.minibatches) % s.minibatches
        (params, opt_state), metrics = jax.lax.scan(one_update, (params, opt_state), (indices, part_ids))
        return params, opt_state, jax.tree.map(lambda x: jnp.sum(x, axis=0), metrics)

    def demonstrations(self, batch) -> dict[str, jax.Array] | None:
        """The PPO-ptx rows of a training batch (its "ptx_*" arrays, prefix removed); None when ptx_coef is 0."""
        if self.settings.ptx_coef == 0:
            return None
        rows = {k.removeprefix(PTX_PREFIX): v for k, v in batch.items() if k.startswith(PTX_PREFIX)}
        if not rows:
            raise ValueError(
                "ptx_coef > 0 but the batch has no ptx_* demonstration rows (PPO's train_loader adds them)"
            )
        return rows

    phases = ("rollout", "scoring", "update")

    def run_phase(self, name: str, state: PPOState, batch, carry):
        """One part of `step`: "rollout" -> `generate`'s samples; "scoring" (carry: the samples) -> (`score`'s
        targets, metrics); "update" (carry: those) -> (the next state, metrics). Every phase reads `state` as it was
        before the step; the loop times them apart. With max_staleness k > 0, "rollout" draws this step's rollout and
        hands on the one drawn k steps ago (`state.pending`), which "scoring" scores with today's policy and "update"
        learns from (no update while the queue fills), queueing today's in its place."""
        s = self.settings
        rng, sample_rng, shuffle_rng = jax.random.split(jax.random.wrap_key_data(state.rng), 3)
        if name == "rollout":
            policy = self.policy_params(state.params, state.frozen)
            if s.sampling_rounds > 1:
                return self._refilled_rollout(policy, self.scoring_models(state), batch, sample_rng)
            drawn = self.generate(policy, batch, sample_rng, samples_per_prompt=s.samples_per_prompt)
            if not s.max_staleness:
                return drawn
            drawn = {**drawn, "version": jnp.full(drawn["mask"].shape[:1], state.step, jnp.int32)}
            slot = state.step % s.max_staleness
            return {"stale": jax.tree.map(lambda queued: queued[slot], state.pending), "drawn": drawn}
        if name == "scoring":
            samples, draw_metrics = carry, {}
            if s.max_staleness:
                samples = carry["stale"]
            elif s.sampling_rounds > 1:  # `_refilled_rollout`'s (samples, metrics of every reply drawn)
                samples, draw_metrics = carry
            policy = self.policy_params(state.params, state.frozen)
            forward = not self.update_reads_old_logprobs
            rollout, metrics = self.score(
                policy,
                self.scoring_models(state),
                state.kl_coef,
                samples,
                policy_forward=forward,
                samples_per_prompt=s.samples_per_prompt,
            )
            scored = rollout, {**metrics, **draw_metrics}
            return (scored, carry["drawn"], samples["version"]) if s.max_staleness else scored
        if s.max_staleness:
            (rollout, metrics), drawn, version = carry
        else:
            rollout, metrics = carry
        params, opt_state, update_metrics = self.update(
            state.params, state.opt_state, rollout, shuffle_rng, self.demonstrations(batch), state.frozen
        )
        kl_coef = state.kl_coef  # GRPO's β is fixed (kl_target 0, checked by its config)
        if "sequence_kl" in rollout:
            controller = policy_gradient.KLController(state.kl_coef, s.kl_target or None, s.kl_horizon)
            kl_coef = policy_gradient.update_kl_controller(
                controller, jnp.mean(rollout["sequence_kl"]), rollout["mask"].shape[0]
            ).kl_coef
        one = jnp.ones((), jnp.float32)
        metrics = {**metrics, **update_metrics, "learning_rate": (self.schedule(state.step), one)}
        pending = state.pending
        if s.max_staleness:
            learnt = version[0] >= 0  # a slot is filled whole: its rows share their version
            params, opt_state = jax.tree.map(
                lambda new, old: jnp.where(learnt, new, old), (params, opt_state), (state.params, state.opt_state)
            )
            slot = state.step % s.max_staleness
            pending = jax.tree.map(lambda queued, new: queued.at[slot].set(new), state.pending, drawn)
            staleness = jnp.where(learnt, (state.step - version[0]).astype(jnp.float32), 0.0)
            metrics["async/staleness"] = (staleness * learnt, learnt.astype(jnp.float32))
            metrics["async/updates"] = (learnt.astype(jnp.float32), one)
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            rng=jax.random.key_data(rng),
            kl_coef=jnp.asarray(kl_coef, jnp.float32),
            pending=pending,
        )
        return new_state, metrics

    def step(self, state: PPOState, batch) -> tuple[PPOState, Metrics]:
        return base.run_phases(self, state, batch)

    def eval_step(self, state: PPOState, batch, carry) -> tuple[Metrics, Any]:
        """One response per held-out prompt (fixed key): "loss" = −(score − β·KL) per response, "score", "kl", "response_len";
        rows with example_weights 0 (padding the last batch) do not count."""
        policy = self.policy_params(state.params, state.frozen)
        rollout, _ = self.rollout(
            policy, self.scoring_models(state), state.kl_coef, batch, jax.random.key(0), samples_per_prompt=1
        )
        weights = batch.get("example_weights", jnp.ones(rollout["scores"].shape, jnp.float32))
        count = jnp.sum(weights)
        objective = rollout["scores"] - state.kl_coef * rollout["sequence_kl"]
        metrics = {
            "loss": (jnp.sum(-objective * weights), count),
            "score": (jnp.sum(rollout["scores"] * weights), count),
            "kl": (jnp.sum(rollout["sequence_kl"] * weights), count),
            "response_len": (jnp.sum(jnp.sum(rollout["mask"], axis=1) * weights), count),
        }
        return metrics, carry
