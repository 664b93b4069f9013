"""RLHF policy optimisation against a frozen reward model (InstructGPT's third stage): PPO, REINFORCE, RLOO and GRPO.
GRPO and RLOO are also registered under their own names (objectives "grpo", "rloo": `ppo`'s recipe with that
algorithm and its defaults); `ppo` with `algorithm=` selects any of them.

The recipe around the policy trainer (`lmzoo.trainers.rl`: rollout, scoring and updates per step): the policy
is the SFT decoder with a zero-initialised value head on its trunk (`heads.LMWithValueHead`), or beside a
separate value network initialised from the reward model or the SFT trunk (`heads.LMWithValueModel`);
`optim.groups` gives "value_head" / "value_model" its own learning rate. The reference and reward model are
frozen models declared as roles (`frozen_roles`: `objective.sft` and `objective.reward_model`) that the run reads at
every start, never checkpointed; the trainer's setup then normalises the reward so SFT samples score mean 0, std 1. The data position (prompts
and PPO-ptx demonstrations) is the step, so a resumed run continues exactly.
"""

import atexit
import dataclasses

import jax
import numpy as np

from lmzoo import decoding, models, weights
from lmzoo.convert import hf
from lmzoo.data import chat, comparisons, pipeline, problems, readers, transforms
from lmzoo.data.loaders import PromptsAndDemonstrations
from lmzoo.models import heads
from lmzoo.objectives import base, tasks
from lmzoo.rl import environments, policy_gradient, reward, rewards
from lmzoo.trainers import optim
from lmzoo.trainers.rl import PROBLEM_KEYS, PTX_PREFIX, PPOTrainer, RLSettings

ALGORITHMS = ("ppo", "reinforce", "rloo", "grpo")
VALUE_MODELS = ("head", "reward", "sft")
SHARED_PROMPTS = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class PPOConfig(base.ComparisonSplitConfig, RLSettings):
    """The trainer's settings (`RLSettings`), validated here, plus the recipe's. Attributes (besides the held-out
    split of config.data.path, whose training prompts are the rollout prompts):
    sft: "ckpt:WORKDIR" of the SFT run: the frozen reference and the policy's start.
    reward_model: "ckpt:WORKDIR" of a reward_model run on the same backbone config as config.model.
    algorithm: "ppo"; "reinforce" (baseline: mean of the prompt's samples) or "rloo" (leave-one-out), one update per
        rollout; "grpo": the PPO clipped loss with each response's score normalised within its prompt's
        `samples_per_prompt` samples as advantage, kl_coef x the k3 KL to the reference as a loss term (fixed β,
        kl_target 0), no value loss.
    prompt_len, response_len: prompt tokens (left-padded, the end kept) and sampled tokens per response.
    temperature: sampling temperature, applied to every log-prob (policy, old policy, reference).
    samples_per_prompt: responses sampled per prompt (reinforce/rloo/grpo need >= 2: GRPO's group size G).
    shared_prompts: "on": reinforce/rloo/grpo run each prompt through the policy and the reference once for its G
        responses (docs/rl.md); "off": every prompt ⊕ response row whole; "auto": on on the CPU, off on accelerators.
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
    chat_template: for chat rows (`messages` conversations or conversational pairs: the prompt is the messages
        before the reply), the template prompts are rendered with, its generation prompt added: a
        tokenizer_config.json, a chat_template.jinja or the folder holding one; "" reads the one beside the run's
        tokenizer.json, as sft's does.
    rewards: reward functions scoring each reply beside (or instead of) the reward model, comma-separated: built-ins
        ("gsm8k": the final number equals the row's answer; "format": <think>…</think><answer>…</answer>; "length")
        or the user's "module:function" (`lmzoo.rl.rewards`); they read the rows of a problems file
        (`lmzoo.data.problems`: GSM8K's jsonl, "synthetic:addition"). reward_weights: their weights,
        comma-separated ("" = all 1). reward_timeout: seconds one call may take (then it scores 0, counted);
        reward_workers: processes they run in.
    GRPO and its successors (algorithm "grpo"): scale_rewards (False: Dr. GRPO's advantages without the group's
        std), loss_aggregation ("token": DAPO's token mean over the minibatch; "sequence": GRPO's mean of each
        reply's token mean; "constant": Dr. GRPO's sum over B x response_len), clip_eps_high (DAPO's clip-higher
        upper bound, 0 = clip_eps), ratio_level ("sequence": GSPO's length-normalised sequence ratio), kl_loss
        ("off" | "k1" | "k3": the KL term of the loss), dynamic_sampling (DAPO: groups whose rewards are all equal
        are dropped from the loss; with sampling_rounds R > 1 each step reads R x train.batch_size prompts and draws
        train.batch_size of them at a time until train.batch_size groups whose rewards differ are kept, the rest
        unused), overlong_cache (DAPO's soft overlong punishment over the last overlong_cache
        tokens before response_len, times overlong_coef; 0 = off).
    max_staleness: asynchronous GRPO: the update of step s learns from the rollout drawn at step s - max_staleness (the
        first max_staleness steps only draw), corrected by truncated importance sampling min(π_old / π_behaviour,
        tis_cap) per token; 0 = synchronous, the same run as without it.
    environment: a tool the policy talks to over up to max_turns turns ("calculator": <calc>48/2</calc> ->
        <result>24</result>; or the user's "module:Class", `lmzoo.rl.environments`), each turn up to turn_len tokens
        (0 = response_len) ending at the tool's stop string; its answers (at most observation_len tokens) are in the
        context but not in the loss; all turns share response_len.
    """

    sft: str = ""
    reward_model: str = ""
    normalize_samples: int = 64
    ptx_batch_size: int = 8
    chat_template: str = ""
    rewards: str = ""
    reward_weights: str = ""
    reward_timeout: float = 10.0
    reward_workers: int = 2
    environment: str = ""
    observation_len: int = 32

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.algorithm not in ALGORITHMS:
            problems.append(f"algorithm={self.algorithm!r}: choose one of {ALGORITHMS}")
        if self.algorithm != "ppo" and self.samples_per_prompt < 2:
            problems.append(
                f"samples_per_prompt={self.samples_per_prompt}: {self.algorithm} needs >= 2 samples per prompt"
            )
        if self.algorithm in ("reinforce", "rloo") and self.epochs != 1:
            problems.append(f"epochs={self.epochs}: {self.algorithm} is on-policy, set epochs=1")
        if self.algorithm == "grpo" and self.kl_target != 0:
            problems.append(f"kl_target={self.kl_target}: grpo keeps β = kl_coef fixed, set kl_target=0")
        if self.shared_prompts not in SHARED_PROMPTS:
            problems.append(f"shared_prompts={self.shared_prompts!r}: choose one of {SHARED_PROMPTS}")
        if self.value_model not in VALUE_MODELS:
            problems.append(f"value_model={self.value_model!r}: choose one of {VALUE_MODELS}")
        if self.ptx_coef < 0:
            problems.append(f"ptx_coef={self.ptx_coef}: must be >= 0 (0 = no pretraining mix)")
        if self.loss_aggregation not in policy_gradient.AGGREGATIONS:
            problems.append(f"loss_aggregation={self.loss_aggregation!r}: choose one of {policy_gradient.AGGREGATIONS}")
        if self.ratio_level not in policy_gradient.RATIO_LEVELS:
            problems.append(f"ratio_level={self.ratio_level!r}: choose one of {policy_gradient.RATIO_LEVELS}")
        if self.kl_loss not in policy_gradient.GRPO_KL_ESTIMATORS:
            problems.append(f"kl_loss={self.kl_loss!r}: choose one of {policy_gradient.GRPO_KL_ESTIMATORS}")
        if self.clip_eps_high and self.clip_eps_high < self.clip_eps:
            problems.append(f"clip_eps_high={self.clip_eps_high}: must be >= clip_eps={self.clip_eps} (0 = clip_eps)")
        if self.overlong_cache < 0 or self.overlong_cache > self.response_len:
            problems.append(f"overlong_cache={self.overlong_cache}: must lie in [0, response_len={self.response_len}]")
        if self.max_turns < 1 or not 0 <= self.turn_len <= self.response_len or self.observation_len < 1:
            problems.append(
                f"max_turns={self.max_turns}, turn_len={self.turn_len}, observation_len={self.observation_len}: "
                f"need max_turns >= 1, 0 <= turn_len <= response_len={self.response_len}, observation_len >= 1"
            )
        if self.max_staleness < 0 or self.tis_cap <= 0:
            problems.append(f"max_staleness={self.max_staleness}, tis_cap={self.tis_cap}: must be >= 0 and > 0")
        if self.max_staleness and (self.algorithm != "grpo" or self.environment):
            problems.append(
                f"max_staleness={self.max_staleness}: asynchronous rollouts are for GRPO without an environment "
                f"(algorithm={self.algorithm!r}, environment={self.environment!r}); set max_staleness=0"
            )
        if self.sampling_rounds < 1 or (
            self.sampling_rounds > 1 and not (self.dynamic_sampling and self.algorithm == "grpo")
        ):
            problems.append(
                f"sampling_rounds={self.sampling_rounds}: must be >= 1, and > 1 refills GRPO's batch under "
                f"dynamic_sampling (algorithm={self.algorithm!r}, dynamic_sampling={self.dynamic_sampling})"
            )
        if self.sampling_rounds > 1 and (self.max_staleness or self.environment):
            problems.append(
                f"sampling_rounds={self.sampling_rounds}: refilling is for synchronous GRPO without an environment "
                f"(max_staleness={self.max_staleness}, environment={self.environment!r}); set sampling_rounds=1"
            )
        if self.max_turns > 1 and not self.environment:
            problems.append(f"max_turns={self.max_turns}: turns alternate with an environment; set environment")
        if self.reward_timeout <= 0 or self.reward_workers < 1:
            problems.append(
                f"reward_timeout={self.reward_timeout}, reward_workers={self.reward_workers}: must be > 0 and >= 1"
            )
        if self.kl_estimator not in policy_gradient.KL_ESTIMATORS:
            problems.append(f"kl_estimator={self.kl_estimator!r}: choose one of {policy_gradient.KL_ESTIMATORS}")
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


def _unique_prompts(raw: list[comparisons.Comparison]) -> list[str]:
    return list(dict.fromkeys(c.prompt for c in raw))


def _as_batch(rows, ids, epochs):
    return dict(rows)


class ProblemTables:
    """The problems of each split the objective has made prompts of, by "problem_split": what the host callbacks
    (reward functions, environments) look a sample's row up in."""

    def __init__(self):
        self.tables: list[list[problems.Problem]] = []

    def register(self, rows: list[problems.Problem]) -> int:
        """The "problem_split" of a split's problems, registered once."""
        for split, table in enumerate(self.tables):
            if table is rows:
                return split
        self.tables.append(rows)
        return len(self.tables) - 1

    def rows(self, split, ids) -> list[problems.Problem]:
        """The problems of "problem_split", "problem_ids" [B]."""
        return [self.tables[int(s)][int(i)] for s, i in zip(np.asarray(split), np.asarray(ids), strict=True)]


class VerifiableRewards:
    """The reward functions of a run, called on the host between generation and scoring (`PPOTrainer.host_rewards`):
    each sampled reply decoded and scored against the row of its problem by a `rewards.RewardPool`, started on first
    use and stopped when the process exits.

    Attributes:
        names, weights: the F functions' names and weights.
    """

    def __init__(self, tokenizer, tables: ProblemTables, functions: dict, weights: list[float], **pool_settings):
        self.tokenizer, self.tables, self.functions = tokenizer, tables, functions
        self.names, self.weights = tuple(functions), tuple(weights)
        self._pool_settings = pool_settings
        self._pool: rewards.RewardPool | None = None

    def close(self) -> None:
        """Stops the worker processes (started again on the next call)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def check(self, rows: list[problems.Problem]) -> None:
        """Refuses rows without a field a function reads, before anything is generated."""
        rewards.check_fields(self.functions, rows[0].fields)

    def __call__(self, responses, mask, split, ids) -> tuple[np.ndarray, np.ndarray]:
        """responses, mask [B, T]; split, ids [B] -> (each function's rewards [F, B], failures per function [F])."""
        if self._pool is None:
            self._pool = rewards.RewardPool(self.functions, self.weights, **self._pool_settings)
            atexit.register(self.close)
        completions = [
            decoding.reply_text(self.tokenizer, row, row_mask)
            for row, row_mask in zip(np.asarray(responses), np.asarray(mask), strict=True)
        ]
        rows = self.tables.rows(split, ids)
        scores = self._pool.score([p.prompt for p in rows], completions, [p.fields for p in rows])
        failures = np.asarray([scores.failures.get(name, 0) for name in scores.names], np.float32)
        return scores.per_function.astype(np.float32), failures


class ToolEpisodes:
    """The environment of a run's multi-turn episodes, on the host (`PPOTrainer.environment`): one environment per
    rollout row, reset on its problem's row, stepped with each policy turn's text; observations encoded, cut to
    `observation_len` tokens.

    Attributes:
        stop_sequences: the environment's stop strings as token ids (a turn ends after one).
        observation_len: the tokens an observation may take.
    """

    def __init__(self, tokenizer, tables: ProblemTables, factory, observation_len: int):
        self.tokenizer, self.tables, self.factory, self.observation_len = tokenizer, tables, factory, observation_len
        stops = factory().stop_strings
        self.stop_sequences = tuple(tuple(tokenizer.encode(stop)) for stop in stops if tokenizer.encode(stop))
        self._episodes: list = []

    def _encoded(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.full((len(texts), self.observation_len), self.tokenizer.pad_id, np.int32)
        mask = np.zeros((len(texts), self.observation_len), np.int32)
        for i, text in enumerate(texts):
            ids = self.tokenizer.encode(text)[: self.observation_len] if text else []
            tokens[i, : len(ids)], mask[i, : len(ids)] = ids, 1
        return tokens, mask

    def __call__(self, tokens, mask, turn, split, ids):
        """A turn's tokens, mask [B, L] (turn -1: reset the episodes) -> (observation tokens, mask [B, O], done [B],
        reward [B])."""
        if int(turn) < 0:
            self._episodes = [self.factory() for _ in range(len(np.asarray(ids)))]
            texts = [
                env.reset(row.fields) for env, row in zip(self._episodes, self.tables.rows(split, ids), strict=True)
            ]
            done, reward = np.zeros(len(texts), bool), np.zeros(len(texts), np.float32)
        else:
            steps = [
                env.step(decoding.reply_text(self.tokenizer, row, row_mask)) if np.any(row_mask) else None
                for env, row, row_mask in zip(self._episodes, np.asarray(tokens), np.asarray(mask), strict=True)
            ]
            texts = [step.observation if step else "" for step in steps]
            done = np.asarray([step.done if step else True for step in steps], bool)
            reward = np.asarray([step.reward if step else 0.0 for step in steps], np.float32)
        return (*self._encoded(texts), done, reward)


class PPO(base.Objective):
    """RLHF against a frozen reward model from the SFT policy (see the module docstring)."""

    def __init__(self, config):
        super().__init__(config)
        self._tables = ProblemTables()  # the rows the reward functions and the environment read
        self._verifiable: VerifiableRewards | None = None  # the reward functions, made with the trainer

    name = "ppo"
    lora_base = "reference"  # with LoRA the policy is the frozen SFT reference plus adapters: held once
    lora_heads = "value_head"
    no_dropout_because = "its updates compare the policy's log-probabilities with the rollout's; trl's do too"
    Config = PPOConfig
    reader = readers.CONVERSATIONS
    loss_is_token_nll = False  # the policy-gradient surrogate

    def close(self):
        if self._verifiable is not None:
            self._verifiable.close()

    def check(self):
        o = self.fields
        base.check_length(self.config, "prompt_len + response_len", o.prompt_len + o.response_len)
        self.check_lora()
        chat.check_template(self.config, hf.resolve_folder)
        adapted = self.lora_config()
        if adapted is not None and o.value_model != "head":
            raise ValueError(
                f"config.lora.targets={adapted.targets!r}: under LoRA the policy is the frozen SFT reference plus "
                f"adapters and a value head; a separate value network (config.objective.value_model="
                f"{o.value_model!r}) has no frozen base of its own: set --config.objective.value_model=head"
            )
        if o.value_model == "reward" and not o.reward_model:
            raise ValueError(
                "config.objective.value_model='reward' starts the value network from the reward model: set "
                "config.objective.reward_model, or value_model='head'"
            )
        if not o.rewards and not o.reward_model:
            raise ValueError(
                "config.objective: score replies with a reward model (reward_model='ckpt:WORKDIR'), reward functions "
                "(rewards='gsm8k', or 'module:function'), or both"
            )
        if o.rewards:
            rewards.resolve_all(o.rewards, o.reward_weights)  # an unknown name or module:function, before any work
        if o.environment:
            environments.resolve(o.environment)
            # a turn is sampled after the prompt and the episode so far: prompt_len + response_len + turn_len positions
            turn = o.turn_len or o.response_len
            base.check_length(self.config, "prompt_len + response_len + turn_len", o.prompt_len + o.response_len + turn)
        # Without an SFT run the policy starts from its own initialisation, which is then the reference.
        for field in ("sft", "reward_model"):
            if getattr(o, field) and not getattr(o, field).startswith("ckpt:"):
                raise ValueError(
                    f"config.objective.{field}={getattr(o, field)!r}: set it to 'ckpt:WORKDIR' of the {field} run"
                )
            source = weights.saved_objective(getattr(o, field).removeprefix("ckpt:"))
            if source is not None and (source == "reward_model") != (field == "reward_model"):
                raise ValueError(
                    f"config.objective.{field}={getattr(o, field)!r} is a {source!r} run; point it at the "
                    f"{'reward_model' if field == 'reward_model' else 'sft (or causal_lm)'} run"
                )
        rollout_rows = self.config.train.batch_size * o.samples_per_prompt
        if rollout_rows % o.minibatches:
            raise ValueError(
                f"train.batch_size x samples_per_prompt = {rollout_rows} rollout rows must split into "
                f"config.objective.minibatches={o.minibatches} equal minibatches"
            )
        if o.ptx_coef > 0:
            base.check_length(self.config, "seq_len", self.config.data.seq_len)
            if o.ptx_batch_size % o.minibatches:
                raise ValueError(
                    f"config.objective.ptx_batch_size={o.ptx_batch_size} must split into "
                    f"config.objective.minibatches={o.minibatches} equal parts"
                )

    def value_problems(self, *, data_parallel_size, batches):
        """PPO-ptx demonstration rows come in the batch, sharded over the data-parallel devices like its prompts. (The
        minibatch parts of the rollout and of the demonstrations need not split evenly: the partitioner pads them.)"""
        o = self.fields
        if not batches or o.ptx_coef == 0 or o.ptx_batch_size % data_parallel_size == 0:
            return []
        fit = max(data_parallel_size, o.ptx_batch_size // data_parallel_size * data_parallel_size)
        return [
            f"objective.ptx_batch_size={o.ptx_batch_size} must be a multiple of the {data_parallel_size} "
            f"data-parallel devices; set --config.objective.ptx_batch_size={fit}"
        ]

    def model(self):
        decoder = super().model()
        if self.fields.value_model == "head":
            return heads.LMWithValueHead(decoder)
        backbone = models.build_model(self.config.model_name, self.config.model.to_dict())  # its own trunk, not shared
        return heads.LMWithValueModel(decoder, reward.value_model(backbone))

    def trainer(self, model):
        tokenizer = base.fixed_tokenizer(self.config)
        if tokenizer.eos_id is None or tokenizer.eos_id == tokenizer.pad_id:
            raise ValueError(
                "PPO stops responses at <eos>: config.data.tokenizer needs an <eos> id distinct from <pad> (e.g. kind='byte')"
            )
        tx, schedule = optim.make_optimizer(self.config.optim)
        o = self.fields
        reward_model = None
        if o.reward_model:
            backbone = models.build_model(self.config.model_name, self.config.model.to_dict())
            reward_model = reward.reward_model(backbone, self.config.model.emb_dim)
        if o.rewards:
            functions, weights = rewards.resolve_all(o.rewards, o.reward_weights)
            self._verifiable = VerifiableRewards(
                tokenizer, self._tables, functions, weights, timeout_s=o.reward_timeout, workers=o.reward_workers
            )
        episodes = None
        if o.environment:
            factory = environments.resolve(o.environment)
            episodes = ToolEpisodes(tokenizer, self._tables, factory, o.observation_len)
        ptx_loss = tasks.causal_lm_task(model.decoder).loss if o.ptx_coef > 0 else None
        return PPOTrainer(
            policy=model,
            reward_model=reward_model,
            settings=o,
            tx=tx,
            schedule=schedule,
            batch_size=self.config.train.batch_size,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            ptx_loss=ptx_loss,
            vocab_size=tokenizer.vocab_size,
            lora_config=self.lora_config(),
            host_rewards=self._verifiable,
            environment=episodes,
        )

    def step_summary(self):
        o = self.fields
        ptx = f"; + {o.ptx_batch_size} demonstration rows x {self.config.data.seq_len} tokens" if o.ptx_coef > 0 else ""
        refill = f" (kept from up to {o.sampling_rounds} rounds, DAPO's refill)" if o.sampling_rounds > 1 else ""
        return (
            f"{self.config.train.batch_size} prompts{refill} x {o.samples_per_prompt} sampled response(s): "
            f"{o.prompt_len} prompt + "
            f"{o.response_len} response tokens each, {o.epochs} epoch(s) of {o.minibatches} minibatch updates{ptx}"
        )

    def input_shapes(self, batch_size):
        o = self.fields
        prompts = batch_size * o.sampling_rounds
        shape = (prompts, o.prompt_len)
        shapes = {"prompts": base.int_inputs(shape), "prompt_mask": base.int_inputs(shape)}
        if o.rewards or o.environment:
            shapes.update({key: base.int_inputs((prompts,)) for key in PROBLEM_KEYS})
        if o.ptx_coef > 0:
            rows = (o.ptx_batch_size, self.config.data.seq_len)
            for key in ("inputs", "targets", "segment_ids", "positions"):
                shapes[PTX_PREFIX + key] = base.int_inputs(rows)
            shapes[PTX_PREFIX + "weights"] = base.float_inputs(rows)
        return shapes

    def _prompts(self, raw, where):
        """Left-padded prompt ids [N, prompt_len] of the split's distinct prompts: HH-RLHF's text, chat rows' prompt
        messages rendered through the chat template with its generation prompt (what trl's GRPO samples from), or
        problems' prompts, each with which split and row it is ("problem_split", "problem_ids" [N]: what the reward
        functions read)."""
        tokenizer = base.fixed_tokenizer(self.config)
        rows = None
        if problems.holds_problems(raw):
            prompts, rows = [p.prompt for p in raw], raw
        elif chat.holds_conversations(raw):
            template = chat.template_for(self.config, hf.resolve_folder)
            texts = [template.render(c.prompt, where=c.where, add_generation_prompt=True)[0] for c in raw]
            prompts = list(dict.fromkeys(texts))
        else:
            prompts = _unique_prompts(raw)
        arrays = comparisons.prompt_arrays(
            prompts, tokenizer.encode, prompt_len=self.fields.prompt_len, pad_id=tokenizer.pad_id
        )
        transforms.check_token_ids(arrays["prompts"], self.config.model.vocab_size, where=where)
        o = self.fields
        if o.rewards or o.environment:
            if rows is None:
                raise ValueError(
                    f"config.objective.rewards={o.rewards!r} and environment={o.environment!r} read their problems' "
                    "rows: config.data.path must hold problems (GSM8K-style jsonl rows with 'question' and 'answer', "
                    f"or 'synthetic:addition'), the {where} holds comparisons or conversations"
                )
            if self._verifiable is not None:
                self._verifiable.check(rows)
            split = self._tables.register(rows)
            arrays["problem_split"] = np.full(len(rows), split, np.int32)
            arrays["problem_ids"] = np.arange(len(rows), dtype=np.int32)
        return arrays

    def train_loader(self, tokenizer, raw, shard):
        prompts = pipeline.ExampleLoader(
            self._prompts(raw, "train split"),
            self.config.train.batch_size * self.fields.sampling_rounds,  # DAPO's refill draws from the extra ones
            seed=self.config.train.seed,
            transform=_as_batch,
            **dataclasses.asdict(shard),
        )
        o = self.fields
        if o.ptx_coef == 0:
            return prompts
        demonstrations = pipeline.ExampleLoader(
            base.demonstration_rows(self.config, tokenizer, raw, "train split"),
            o.ptx_batch_size,
            seed=self.config.train.seed,
            transform=_as_batch,
            **dataclasses.asdict(shard),
        )
        return PromptsAndDemonstrations(prompts, demonstrations, PTX_PREFIX)

    def eval_batches(self, tokenizer, raw, shard):
        return pipeline.ExampleLoader(
            self._prompts(raw, "evaluation split"),
            self.config.eval.batch_size,
            seed=0,
            transform=_as_batch,
            **dataclasses.asdict(shard),
        ).eval_batches()

    def real_tokens(self, batch):
        return int(np.sum(batch["prompt_mask"]))

    def frozen_roles(self):
        """The SFT reference (the policy's start) and the reward model, a reward_model run on this backbone config."""
        o, cfg = self.fields, self.config

        def check_reward(fresh, loaded):
            expected, found = jax.tree.map(np.shape, fresh), jax.tree.map(np.shape, loaded)
            if expected != found:
                raise ValueError(
                    f"the reward model in {o.reward_model} does not fit config.model (a reward_model run on the same "
                    f"backbone config is needed): its parameter shapes {found} vs {expected}"
                )

        roles = {}
        if o.sft:
            roles["reference"] = base.Role(o.sft, cfg.model_name, cfg.model.to_dict())
        if o.reward_model:
            roles["reward"] = base.Role(
                o.reward_model, cfg.model_name, cfg.model.to_dict(), read="run", check=check_reward
            )
        return roles

    def prepare_batch(self):
        """The first `normalize_samples` distinct training prompts, whose SFT samples fix the reward normalisation
        (`PPOTrainer.prepare`); None without a reward model."""
        if not self.fields.reward_model:
            return None
        prompts = self._prompts(self.read()["train"], "train split")
        return {k: v[: self.fields.normalize_samples] for k, v in prompts.items()}

    def init_params(self, params, frozen):
        """The policy's decoder starts as the SFT reference. The value head stays at zero; a separate value network
        starts as the reward model (whose head the trainer's `prepare` rescales by the reward normalisation it fits)
        or as the SFT trunk under a zero head."""
        params = {**params, "decoder": jax.tree.map(np.array, frozen["reference"])}
        value_model = self.fields.value_model
        if value_model == "reward":
            params["value_model"] = jax.tree.map(np.array, frozen["reward"])
        elif value_model == "sft":
            fresh = params["value_model"]
            params["value_model"] = {
                "backbone": {name: jax.tree.map(np.array, frozen["reference"][name]) for name in fresh["backbone"]},
                "classifier": jax.tree.map(np.zeros_like, fresh["classifier"]),
            }
        return params


def _algorithm_config(algorithm: str, **defaults) -> type[PPOConfig]:
    """`PPOConfig` with `algorithm` and the defaults it needs (e.g. several samples per prompt), for the objective
    registered under the algorithm's own name; another algorithm there is refused."""
    fields = [("algorithm", str, dataclasses.field(default=algorithm))]
    fields += [(name, type(value), dataclasses.field(default=value)) for name, value in defaults.items()]

    def check_algorithm(self):
        if self.algorithm != algorithm:
            raise ValueError(
                f"config.objective.algorithm={self.algorithm!r}: objective {algorithm!r} runs {algorithm}; to run "
                f"another algorithm use objective 'ppo' with --config.objective.algorithm"
            )
        PPOConfig.__post_init__(self)

    return dataclasses.make_dataclass(
        f"{algorithm.upper()}Config",
        fields,
        bases=(PPOConfig,),
        frozen=True,
        namespace={"__post_init__": check_algorithm},
    )


class GRPO(PPO):
    """GRPO under its own name (`ppo` with algorithm="grpo" runs the same): groups of samples per prompt, scores
    normalised within each group as advantages, β times the k3 KL to the reference as a loss term, no value loss."""

    name = "grpo"
    Config = _algorithm_config("grpo", samples_per_prompt=4, epochs=1, minibatches=1, kl_coef=0.04, kl_target=0.0)


class RLOO(PPO):
    """RLOO under its own name (`ppo` with algorithm="rloo" runs the same): several samples per prompt, each
    response's baseline the mean score of the others, one update per rollout."""

    name = "rloo"
    Config = _algorithm_config("rloo", samples_per_prompt=4, epochs=1)
