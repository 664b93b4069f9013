"""RLHF policy optimisation against a frozen reward model (InstructGPT's third stage): PPO, REINFORCE and RLOO.

One trainer step is one iteration, composed of three phases that the training loop jits and times
apart (`phases`, `run_phase`; `step` runs them as one program): `generate` samples responses to
left-padded prompts with the KV-cache sampler (stop at EOS, mask after it); `score` scores
prompt ⊕ response with the frozen reward model (normalised so SFT samples score mean 0, std 1; a
penalty for no EOS), reads the log-probs of the frozen SFT reference, shapes per-token rewards −β·KL with the score on the last token and runs GAE;
`update` makes `epochs` passes of `minibatches` clipped PPO updates (or one REINFORCE/RLOO update on
the same rollout), each optionally adding γ_ptx times the LM loss on packed SFT demonstrations
(PPO-ptx). β follows the adaptive controller, whose value lives in the state. The policy is the SFT
decoder with a zero-initialised value head on its trunk (`heads.LMWithValueHead`), or beside a
separate value network initialised from the reward model or the SFT trunk (`heads.LMWithValueModel`);
`optim.groups` gives "value_head" / "value_model" its own learning rate. The reference and reward
model are frozen subtrees read from `objective.sft` and `objective.reward_model` at every start,
never checkpointed; the data position (prompts and demonstrations) is the step, so a resumed run
continues exactly.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from lmzoo import decoding, models
from lmzoo.data import comparisons, pipeline, transforms
from lmzoo.models import heads
from lmzoo.objectives import base, causal_lm, sft
from lmzoo.rl import ppo, reward
from lmzoo.train import optim
from lmzoo.train import trainer as trainer_lib
from lmzoo.train.state import Metrics

ALGORITHMS = ("ppo", "reinforce", "rloo")
VALUE_MODELS = ("head", "reward", "sft")
PTX_PREFIX = "ptx_"  # batch keys of the PPO-ptx demonstrations


@dataclasses.dataclass(frozen=True)
class PPOConfig(sft.ComparisonSplitConfig):
    """Attributes (besides the held-out split of config.data.path, whose training prompts are the rollout prompts):
    sft: "ckpt:WORKDIR" of the SFT run: the frozen reference and the policy's start.
    reward_model: "ckpt:WORKDIR" of a reward_model run on the same backbone config as config.model.
    algorithm: "ppo"; "reinforce" (baseline: mean of the prompt's samples) or "rloo" (leave-one-out), one update per rollout.
    prompt_len, response_len: prompt tokens (left-padded, the end kept) and sampled tokens per response.
    temperature: sampling temperature, applied to every log-prob (policy, old policy, reference).
    samples_per_prompt: responses sampled per prompt (reinforce/rloo need >= 2).
    epochs, minibatches: PPO passes over each rollout and updates per pass.
    clip_eps, value_clip_eps, value_coef, entropy_coef: PPO losses (ε, ε_v, c_v, c_H).
    gamma, lam: GAE.
    kl_coef: β (the start value when kl_target > 0); kl_target: nats per response the adaptive controller holds
        (0 = fixed β); kl_horizon: its horizon in episodes; kl_estimator: k1 | k2 | k3.
    missing_eos_penalty: subtracted from the score of responses without EOS (0 = none).
    whiten_rewards: scale the shaped rewards to unit variance before GAE.
    normalize_samples: SFT samples (on training prompts) whose reward-model scores fix the normalisation.
    value_model: "head" (a zero-initialised value head on the policy's trunk) or a separate value network with its own
        trunk, initialised from "reward" (the reward model, its head rescaled by the reward normalisation so the value
        of a whole sequence is its normalised score) or "sft" (the SFT decoder's trunk under a zero head).
    ptx_coef: γ of PPO-ptx (InstructGPT): every update adds γ x the token-mean LM loss of packed SFT demonstrations of
        the training prompts (0 = off: no demonstrations are read); ptx_batch_size: demonstration rows
        [·, data.seq_len] per iteration (like train.batch_size, a multiple of the data-parallel devices), split over
        the `minibatches` updates of each epoch.
    """

    sft: str = ""
    reward_model: str = ""
    algorithm: str = "ppo"
    prompt_len: int = 64
    response_len: int = 32
    temperature: float = 1.0
    samples_per_prompt: int = 1
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
    normalize_samples: int = 64
    value_model: str = "head"
    ptx_coef: float = 0.0
    ptx_batch_size: int = 8

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.algorithm not in ALGORITHMS:
            problems.append(f"algorithm={self.algorithm!r}: choose one of {ALGORITHMS}")
        if self.algorithm != "ppo" and self.samples_per_prompt < 2:
            problems.append(
                f"samples_per_prompt={self.samples_per_prompt}: {self.algorithm} needs >= 2 samples per prompt"
            )
        if self.algorithm != "ppo" and self.epochs != 1:
            problems.append(f"epochs={self.epochs}: {self.algorithm} is on-policy, set epochs=1")
        if self.value_model not in VALUE_MODELS:
            problems.append(f"value_model={self.value_model!r}: choose one of {VALUE_MODELS}")
        if self.ptx_coef < 0:
            problems.append(f"ptx_coef={self.ptx_coef}: must be >= 0 (0 = no pretraining mix)")
        if self.kl_estimator not in ppo.KL_ESTIMATORS:
            problems.append(f"kl_estimator={self.kl_estimator!r}: choose one of {ppo.KL_ESTIMATORS}")
        counts = ("prompt_len", "response_len", "samples_per_prompt", "epochs", "minibatches", "normalize_samples")
        for name in counts + ("ptx_batch_size",):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)}: must be >= 1")
        if self.temperature <= 0:
            problems.append(f"temperature={self.temperature}: must be > 0 (log-probs are of the tempered distribution)")
        if self.kl_coef < 0 or self.kl_target < 0:
            problems.append(f"kl_coef={self.kl_coef}, kl_target={self.kl_target}: must be >= 0")
        if problems:
            raise ValueError("invalid config.objective: " + "; ".join(problems))


@struct.dataclass
class PPOState:
    """The policy (decoder + value head or network), its optimizer, the KL controller's β, the rng, the frozen models."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    frozen: Any  # {"reference", "reward", "reward_gain", "reward_bias"}: never checkpointed
    kl_coef: jax.Array


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
    reward_model: heads.SequenceClassifier
    settings: PPOConfig
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    batch_size: int
    eos_id: int
    pad_id: int

    @property
    def decoder(self):
        return self.policy.decoder

    def init(self, rng: jax.Array) -> PPOState:
        policy_rng, reference_rng, reward_rng, state_rng = jax.random.split(rng, 4)
        s = self.settings
        tokens = jnp.zeros((self.batch_size, s.prompt_len + s.response_len), jnp.int32)
        params = self.policy.init(policy_rng, tokens)["params"]
        frozen = {
            "reference": self.decoder.init(reference_rng, tokens)["params"],
            "reward": self.reward_model.init(reward_rng, tokens, segment_ids=jnp.ones_like(tokens))["params"],
            "reward_gain": jnp.ones((), jnp.float32),
            "reward_bias": jnp.zeros((), jnp.float32),
        }
        return PPOState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params),
                        rng=jax.random.key_data(state_rng), frozen=frozen, kl_coef=jnp.asarray(s.kl_coef, jnp.float32))  # fmt: skip

    def initial_carry(self, batch_size: int) -> dict:
        return {}

    def with_params(self, state: PPOState, params: Any) -> PPOState:
        return state.replace(params=params, opt_state=self.tx.init(params))

    def _logprobs(self, logits: jax.Array, responses: jax.Array) -> tuple[jax.Array, jax.Array]:
        return ppo.response_logprobs(ppo.align_to_responses(logits, self.settings.prompt_len), responses,
                                     temperature=self.settings.temperature)  # fmt: skip

    def generate(self, params, batch, rng, *, samples_per_prompt: int) -> dict[str, jax.Array]:
        """`samples_per_prompt` responses to each of batch "prompts"/"prompt_mask" [B, P] from the KV-cache sampler ->
        "prompts", "prompt_mask" [B·K, P], "responses" [B·K, T] (pad after the EOS) and "mask" [B·K, T] (float)."""
        s = self.settings
        prompts = jnp.repeat(batch["prompts"], samples_per_prompt, axis=0)
        prompt_mask = jnp.repeat(batch["prompt_mask"], samples_per_prompt, axis=0)
        samples = decoding.sample(self.decoder, params["decoder"], prompts, prompt_mask, rng, max_new_tokens=s.response_len,
                                  temperature=s.temperature, eos_id=self.eos_id, pad_id=self.pad_id)  # fmt: skip
        return {"prompts": prompts, "prompt_mask": prompt_mask, "responses": samples.tokens,
                "mask": samples.mask.astype(jnp.float32)}  # fmt: skip

    def score(self, params, frozen, kl_coef, samples: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], Metrics]:
        """Scores `generate`'s samples with the frozen reward model, reads the policy's and the reference's log-probs
        and the values, shapes the rewards and runs GAE -> the fixed targets of the updates (every array [B·K, ...])
        with the rollout metrics."""
        s = self.settings
        prompts, prompt_mask, responses, mask = (samples[k] for k in ("prompts", "prompt_mask", "responses", "mask"))
        has_eos = jnp.any((responses == self.eos_id) & (mask > 0), axis=1)
        inputs = rollout_inputs(prompts, prompt_mask, responses, mask)
        forward = dict(segment_ids=inputs["segment_ids"], positions=inputs["positions"])
        logits, values = self.policy.apply({"params": params}, inputs["sequences"], **forward)
        logprobs, entropy = self._logprobs(logits, responses)
        ref_logits = self.decoder.apply({"params": frozen["reference"]}, inputs["sequences"], **forward)
        ref_logprobs, _ = self._logprobs(ref_logits, responses)
        raw_scores = self.reward_model.apply({"params": frozen["reward"]}, inputs["sequences"], **forward)[:, 0]
        scores = reward.normalize(raw_scores, frozen["reward_gain"], frozen["reward_bias"])
        if s.missing_eos_penalty > 0:
            scores = ppo.penalize_missing_eos(scores, has_eos, penalty=s.missing_eos_penalty)
        targets, metrics = ppo.ppo_rollout_targets(
            scores, has_eos, jax.lax.stop_gradient(logprobs), ref_logprobs,
            jax.lax.stop_gradient(ppo.align_to_responses(values, s.prompt_len)), mask, kl_coef=kl_coef, gamma=s.gamma,
            lam=s.lam, kl_estimator=s.kl_estimator, whiten_rewards=s.whiten_rewards,
        )  # fmt: skip
        sequence_returns = jnp.sum(targets["rewards"], axis=1)  # score − β·Σ_t kl_t (scaled if whitened)
        rows = jnp.asarray(scores.shape[0], jnp.float32)
        metrics = {**metrics, "objective/raw_scores": (jnp.sum(raw_scores), rows),
                   "objective/entropy": (jnp.sum(-logprobs * mask), rows),
                   "policy/rollout_entropy": ppo.masked_stats(entropy, mask)}  # fmt: skip
        rollout = {**targets, **inputs, "responses": responses, "scores": scores,
                   "sequence_kl": jnp.sum((logprobs - ref_logprobs) * mask, axis=1), "sequence_returns": sequence_returns}  # fmt: skip
        return jax.tree.map(jax.lax.stop_gradient, rollout), metrics

    def rollout(
        self, params, frozen, kl_coef, batch, rng, *, samples_per_prompt: int
    ) -> tuple[dict[str, jax.Array], Metrics]:
        """`generate` then `score`."""
        samples = self.generate(params, batch, rng, samples_per_prompt=samples_per_prompt)
        return self.score(params, frozen, kl_coef, samples)

    def minibatch_loss(
        self, params, minibatch: dict[str, jax.Array], demonstrations: dict[str, jax.Array] | None = None
    ) -> tuple[jax.Array, Metrics]:
        """The PPO (or REINFORCE) loss of a rollout minibatch, plus ptx_coef x the SFT loss of the policy's decoder on
        `demonstrations` (packed "inputs", "targets", "weights", "segment_ids", "positions" [R, L]) when given."""
        loss, metrics = self._policy_loss(params, minibatch)
        if demonstrations is None:
            return loss, metrics
        ptx_loss, (ptx_metrics, _) = causal_lm.causal_lm_task(self.decoder).loss(
            params["decoder"], {}, {}, demonstrations, jax.random.key(0), step=0, train=False
        )
        ptx_metrics = {"ptx/loss": ptx_metrics["loss"], "ptx/accuracy": ptx_metrics["accuracy"]}
        return loss + self.settings.ptx_coef * ptx_loss, {**metrics, **jax.tree.map(jax.lax.stop_gradient, ptx_metrics)}

    def _policy_loss(self, params, minibatch: dict[str, jax.Array]) -> tuple[jax.Array, Metrics]:
        s = self.settings
        logits, values = self.policy.apply({"params": params}, minibatch["sequences"],
                                           segment_ids=minibatch["segment_ids"], positions=minibatch["positions"])  # fmt: skip
        logprobs, entropy = self._logprobs(logits, minibatch["responses"])
        if s.algorithm == "ppo":
            return ppo.ppo_loss(logprobs, entropy, ppo.align_to_responses(values, s.prompt_len), minibatch, clip_eps=s.clip_eps,
                                value_clip_eps=s.value_clip_eps, value_coef=s.value_coef, entropy_coef=s.entropy_coef)  # fmt: skip
        mask = minibatch["mask"]
        loss, metrics = ppo.reinforce_loss(logprobs, minibatch["sequence_advantages"], mask)
        loss = loss - s.entropy_coef * ppo.masked_mean(entropy, mask)
        return loss, {**metrics, "policy/entropy": jax.lax.stop_gradient(ppo.masked_stats(entropy, mask))}

    def update(
        self, params, opt_state, rollout: dict[str, jax.Array], rng: jax.Array,
        demonstrations: dict[str, jax.Array] | None = None,
    ):  # fmt: skip
        """`epochs` passes over the rollout, each a fresh permutation split into `minibatches` optimizer updates
        -> (params, opt_state, metrics summed over the updates). REINFORCE/RLOO first turn the sequence returns into
        per-prompt baselined advantages. `demonstrations` (PPO-ptx, [R, L] arrays) are split into `minibatches` strided
        parts, part m joining minibatch m of every epoch."""
        s = self.settings
        rows = rollout["mask"].shape[0]
        if rows % s.minibatches:
            raise ValueError(f"{rows} rollout rows do not split into config.objective.minibatches={s.minibatches}")
        if s.algorithm != "ppo":
            baseline = "mean" if s.algorithm == "reinforce" else "leave_one_out"
            grouped = rollout["sequence_returns"].reshape(-1, s.samples_per_prompt)
            advantages = ppo.reinforce_advantages(grouped, baseline=baseline).reshape(-1)
            rollout = {**rollout, "sequence_advantages": advantages}
        order = jnp.stack([jax.random.permutation(jax.random.fold_in(rng, e), rows) for e in range(s.epochs)])
        indices = order.reshape(s.epochs * s.minibatches, rows // s.minibatches)
        parts = None if demonstrations is None else trainer_lib.split_microbatches(demonstrations, s.minibatches)
        grad_fn = jax.value_and_grad(self.minibatch_loss, has_aux=True)

        def one_update(carry, xs):
            params, opt_state = carry
            index, part = xs
            part_demonstrations = None if parts is None else jax.tree.map(lambda x: x[part], parts)
            (_, metrics), grads = grad_fn(params, jax.tree.map(lambda x: x[index], rollout), part_demonstrations)
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
        before the step; the loop times them apart."""
        s = self.settings
        rng, sample_rng, shuffle_rng = jax.random.split(jax.random.wrap_key_data(state.rng), 3)
        if name == "rollout":
            return self.generate(state.params, batch, sample_rng, samples_per_prompt=s.samples_per_prompt)
        if name == "scoring":
            return self.score(state.params, state.frozen, state.kl_coef, carry)
        rollout, metrics = carry
        params, opt_state, update_metrics = self.update(
            state.params, state.opt_state, rollout, shuffle_rng, self.demonstrations(batch)
        )
        controller = ppo.KLController(state.kl_coef, s.kl_target or None, s.kl_horizon)
        kl_coef = ppo.update_kl_controller(
            controller, jnp.mean(rollout["sequence_kl"]), rollout["mask"].shape[0]
        ).kl_coef
        one = jnp.ones((), jnp.float32)
        metrics = {**metrics, **update_metrics, "learning_rate": (self.schedule(state.step), one)}
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=jax.random.key_data(rng),
                                  kl_coef=jnp.asarray(kl_coef, jnp.float32))  # fmt: skip
        return new_state, metrics

    def step(self, state: PPOState, batch) -> tuple[PPOState, Metrics]:
        return trainer_lib.run_phases(self, state, batch)

    def eval_step(self, state: PPOState, batch, carry) -> tuple[Metrics, Any]:
        """One response per held-out prompt (fixed key): "loss" = −(score − β·KL) per response, "score", "kl", "response_len";
        rows with example_weights 0 (padding the last batch) do not count."""
        rollout, _ = self.rollout(
            state.params, state.frozen, state.kl_coef, batch, jax.random.key(0), samples_per_prompt=1
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


def _unique_prompts(raw: list[comparisons.Comparison]) -> list[str]:
    return list(dict.fromkeys(c.prompt for c in raw))


def _as_batch(rows, ids, epochs):
    return dict(rows)


@dataclasses.dataclass(frozen=True)
class PromptsAndDemonstrations:
    """PPO-ptx training batches: the rollout prompts and packed SFT demonstrations (keys prefixed "ptx_"), each
    loader's batch a function of the step, so a resumed run reads the same demonstrations."""

    prompts: pipeline.ExampleLoader
    demonstrations: pipeline.ExampleLoader

    @property
    def dataset_size(self) -> str:
        return f"{self.prompts.num_examples:,} prompts + {self.demonstrations.num_examples:,} packed demonstration rows"

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rows = self.demonstrations.batch(step)
        return {**self.prompts.batch(step), **{PTX_PREFIX + k: v for k, v in rows.items()}}


class PPO(sft.ComparisonObjective):
    """RLHF against a frozen reward model from the SFT policy (see the module docstring)."""

    name = "ppo"
    Config = PPOConfig
    loss_is_token_nll = False  # the policy-gradient surrogate

    def check(self, config):
        o = self.fields(config)
        base.check_length(config, "prompt_len + response_len", o.prompt_len + o.response_len)
        for field in ("sft", "reward_model"):
            if not getattr(o, field).startswith("ckpt:"):
                raise ValueError(
                    f"config.objective.{field}={getattr(o, field)!r}: set it to 'ckpt:WORKDIR' of the {field} run"
                )
        rollout_rows = config.train.batch_size * o.samples_per_prompt
        if rollout_rows % o.minibatches:
            raise ValueError(f"train.batch_size x samples_per_prompt = {rollout_rows} rollout rows must split into "
                             f"config.objective.minibatches={o.minibatches} equal minibatches")  # fmt: skip
        if o.ptx_coef > 0:
            base.check_length(config, "seq_len", config.data.seq_len)
            if o.ptx_batch_size % o.minibatches:
                raise ValueError(f"config.objective.ptx_batch_size={o.ptx_batch_size} must split into "
                                 f"config.objective.minibatches={o.minibatches} equal parts")  # fmt: skip

    def model(self, config):
        decoder = super().model(config)
        if self.fields(config).value_model == "head":
            return heads.LMWithValueHead(decoder)
        backbone = models.build_model(config.model_name, config.model.to_dict())  # its own trunk, not shared
        return heads.LMWithValueModel(decoder, reward.value_model(backbone))

    def trainer(self, config, model):
        tokenizer = sft.fixed_tokenizer(config)
        if tokenizer.eos_id is None or tokenizer.eos_id == tokenizer.pad_id:
            raise ValueError(
                "PPO stops responses at <eos>: config.data.tokenizer needs an <eos> id distinct from <pad> (e.g. kind='byte')"
            )
        tx, schedule = optim.make_optimizer(config.optim)
        reward_model = reward.reward_model(
            models.build_model(config.model_name, config.model.to_dict()), config.model.emb_dim
        )
        return PPOTrainer(policy=model, reward_model=reward_model, settings=self.fields(config), tx=tx, schedule=schedule,
                          batch_size=config.train.batch_size, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)  # fmt: skip

    def step_summary(self, config):
        o = self.fields(config)
        ptx = f"; + {o.ptx_batch_size} demonstration rows x {config.data.seq_len} tokens" if o.ptx_coef > 0 else ""
        return (f"{config.train.batch_size} prompts x {o.samples_per_prompt} sampled response(s): {o.prompt_len} prompt + "
                f"{o.response_len} response tokens each, {o.epochs} epoch(s) of {o.minibatches} minibatch updates{ptx}")  # fmt: skip

    def input_shapes(self, config, batch_size):
        shape = (batch_size, config.objective.prompt_len)
        shapes = {"prompts": base.int_inputs(shape), "prompt_mask": base.int_inputs(shape)}
        o = self.fields(config)
        if o.ptx_coef > 0:
            rows = (o.ptx_batch_size, config.data.seq_len)
            for key in ("inputs", "targets", "segment_ids", "positions"):
                shapes[PTX_PREFIX + key] = base.int_inputs(rows)
            shapes[PTX_PREFIX + "weights"] = base.float_inputs(rows)
        return shapes

    def _prompts(self, config, raw, where):
        tokenizer = sft.fixed_tokenizer(config)
        arrays = comparisons.prompt_arrays(_unique_prompts(raw), tokenizer.encode, prompt_len=config.objective.prompt_len,
                                           pad_id=tokenizer.pad_id)  # fmt: skip
        transforms.check_token_ids(arrays["prompts"], config.model.vocab_size, where=where)
        return arrays

    def train_loader(self, config, tokenizer, raw, shard):
        prompts = pipeline.ExampleLoader(self._prompts(config, raw, "train split"), config.train.batch_size,
                                         seed=config.train.seed, transform=_as_batch, **dataclasses.asdict(shard))  # fmt: skip
        o = self.fields(config)
        if o.ptx_coef == 0:
            return prompts
        demonstrations = pipeline.ExampleLoader(sft.sft_examples(raw, tokenizer, config, "train split"), o.ptx_batch_size,
                                                seed=config.train.seed, transform=_as_batch, **dataclasses.asdict(shard))  # fmt: skip
        return PromptsAndDemonstrations(prompts, demonstrations)

    def eval_batches(self, config, tokenizer, raw, shard):
        return pipeline.ExampleLoader(self._prompts(config, raw, "evaluation split"), config.eval.batch_size, seed=0,
                                      transform=_as_batch, **dataclasses.asdict(shard)).eval_batches()  # fmt: skip

    def real_tokens(self, batch):
        return int(np.sum(batch["prompt_mask"]))

    def load_frozen(self, config, frozen):
        """The SFT reference and the reward model from their workdirs, and the reward normalisation (gain, bias) that
        gives `normalize_samples` SFT samples on training prompts mean 0 and std 1 (a fixed key: the same at every start)."""
        from lmzoo.train import restore

        o = self.fields(config)
        reference = restore.merge_pretrained(frozen["reference"], o.sft, config.model_name, config.model.to_dict())
        reward_params = restore.load(o.reward_model.removeprefix("ckpt:")).params
        expected, loaded = jax.tree.map(np.shape, frozen["reward"]), jax.tree.map(np.shape, reward_params)
        if expected != loaded:
            raise ValueError(f"the reward model in {o.reward_model} does not fit config.model (a reward_model run on the same "
                             f"backbone config is needed): its parameter shapes {loaded} vs {expected}")  # fmt: skip
        gain, bias = self.fit_normalization(config, reference, reward_params)
        return {
            "reference": reference,
            "reward": reward_params,
            "reward_gain": np.float32(gain),
            "reward_bias": np.float32(bias),
        }

    def fit_normalization(self, config, reference, reward_params) -> tuple[float, float]:
        o = self.fields(config)
        trainer = self.trainer(config, self.model(config))
        prompts = self._prompts(config, self.read(config)["train"], "train split")
        prompts = {k: v[: o.normalize_samples] for k, v in prompts.items()}

        @jax.jit
        def raw_scores(reference, reward_params, prompts):
            samples = decoding.sample(trainer.decoder, reference, prompts["prompts"], prompts["prompt_mask"], jax.random.key(1),
                                      max_new_tokens=o.response_len, temperature=o.temperature, eos_id=trainer.eos_id,
                                      pad_id=trainer.pad_id)  # fmt: skip
            inputs = rollout_inputs(prompts["prompts"], prompts["prompt_mask"], samples.tokens, samples.mask)
            return trainer.reward_model.apply({"params": reward_params}, inputs["sequences"], segment_ids=inputs["segment_ids"],
                                              positions=inputs["positions"])[:, 0]  # fmt: skip

        scores = raw_scores(reference, reward_params, prompts)
        gain, bias = reward.fit_normalization(scores)
        print(f"reward normalisation from {len(scores)} SFT samples: raw mean {float(np.mean(scores)):.4f} "
              f"std {float(np.std(scores)):.4f} -> gain {float(gain):.4f} bias {float(bias):.4f}")  # fmt: skip
        return float(gain), float(bias)

    def init_params(self, config, params, frozen):
        """The policy's decoder starts as the SFT reference. The value head stays at zero; a separate value network
        starts as the reward model with its head rescaled by the reward normalisation (gain·head + bias, so its
        value at a sequence's last token is the normalised score), or as the SFT trunk under a zero head."""
        params = {**params, "decoder": jax.tree.map(np.array, frozen["reference"])}
        value_model = self.fields(config).value_model
        if value_model == "reward":
            head, gain, bias = frozen["reward"]["classifier"], frozen["reward_gain"], frozen["reward_bias"]
            params["value_model"] = {
                "backbone": jax.tree.map(np.array, frozen["reward"]["backbone"]),
                "classifier": {
                    "kernel": np.asarray(head["kernel"]) * gain,
                    "bias": np.asarray(head["bias"]) * gain + bias,
                },
            }
        elif value_model == "sft":
            fresh = params["value_model"]
            params["value_model"] = {
                "backbone": {name: jax.tree.map(np.array, frozen["reference"][name]) for name in fresh["backbone"]},
                "classifier": jax.tree.map(np.zeros_like, fresh["classifier"]),
            }
        return params
