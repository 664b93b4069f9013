"""Direct preference optimisation (Rafailov et al. 2023) from the comparisons the reward model reads: no reward
model, no sampling.

For a prompt x with chosen reply y_w and rejected reply y_l, with log-probs summed over the reply and its EOS
(prompt and padding masked),

    h = [log π(y_w|x) − log π_ref(y_w|x)] − [log π(y_l|x) − log π_ref(y_l|x)]
    sigmoid: −(1 − ε)·log σ(β·h) − ε·log σ(−β·h)    (ε = label_smoothing: conservative DPO, Mitchell 2023)
    ipo:     (h − 1/(2β))²                            (Azar et al. 2023; log-probs averaged over the reply, as trl)

averaged over comparisons. The reference π_ref is the frozen SFT decoder (`objective.sft`, read at every start,
never checkpointed, its log-probs under stop_gradient), and the policy starts as a copy of it; dropout is off in
both (trl's default), so the two agree at the start. The implicit rewards β·(log π − log π_ref) of the two
replies give the accuracy and margin metrics. Any decoder family (`model(tokens, positions=, segment_ids=) ->
logits`) trains through the supervised trainer.

Conversational pairs (`lmzoo.data.chat`: {"chosen": [messages], "rejected": [messages]}, with an optional "prompt")
are rendered through the checkpoint's chat template into the prompt and reply strings trl's DPO builds, then read as
the comparisons are.
"""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from lmzoo import weights
from lmzoo.convert import hf
from lmzoo.data import chat, comparisons, readers, transforms
from lmzoo.models import experts, kinds
from lmzoo.objectives import base
from lmzoo.rl import preference
from lmzoo.trainers.state import Task


@dataclasses.dataclass(frozen=True)
class DPOConfig(base.ComparisonSplitConfig):
    """Attributes (besides the held-out split of config.data.path, whose training comparisons are trained on):
    sft: "ckpt:WORKDIR" of the SFT run: the frozen reference and the policy's start.
    beta: β, the strength of the implicit KL to the reference (> 0).
    label_smoothing: ε in [0, 0.5), the assumed share of flipped labels (conservative DPO; sigmoid loss only).
    loss_type: "sigmoid" (DPO) or "ipo".
    chat_template: the template chat pairs are rendered with: a tokenizer_config.json, a chat_template.jinja or the
      folder holding one; "" reads the one beside the run's tokenizer.json (data.tokenizer.path of kind hf_json, or
      init_from's hf: folder with kind init_from). HH-RLHF files use none.
    max_prompt_len: P > 0 cuts every prompt to its last P tokens and every reply ⊕ EOS to data.seq_len - P, and runs
      each prompt through the policy and the reference once for both replies (`preference.shared_reply_logprobs`);
      0: each prompt cut to leave room for its longer reply, both rows run whole.
    """

    sft: str = ""
    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"
    chat_template: str = ""
    max_prompt_len: int = 0

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.max_prompt_len < 0:
            problems.append(f"max_prompt_len={self.max_prompt_len}: must be >= 0 (0: no prompt budget)")
        if self.beta <= 0:
            problems.append(f"beta={self.beta}: must be > 0, e.g. 0.1")
        if not 0 <= self.label_smoothing < 0.5:
            problems.append(f"label_smoothing={self.label_smoothing}: must lie in [0, 0.5)")
        if self.loss_type not in preference.LOSS_TYPES:
            problems.append(f"loss_type={self.loss_type!r}: choose one of {preference.LOSS_TYPES}")
        elif self.loss_type == "ipo" and self.label_smoothing:
            problems.append(f"label_smoothing={self.label_smoothing}: the ipo loss has none, set it to 0")
        if problems:
            raise ValueError("invalid config.objective: " + "; ".join(problems))


def dpo_task(model, fields: DPOConfig, *, pad_id: int) -> Task:
    """The DPO loss of decoder `model` on batch "tokens" [B, 2, L] (chosen, rejected), "prompt_lengths" [B] (and
    "example_weights" [B] in evaluation), against frozen {"reference": params of the same decoder}."""

    def init(rng, batch):
        tokens = batch["tokens"][:, 0]
        params = model.init(rng, tokens)["params"]
        return params, {"reference": params}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        tokens, prompt_lengths = batch["tokens"], batch["prompt_lengths"]
        applied = experts.AuxCollector(model) if experts.has_experts(model) else model
        if fields.max_prompt_len and applied is model:  # experts' auxiliary losses count every token routed
            logprobs = functools.partial(preference.shared_reply_logprobs, prompt_budget=fields.max_prompt_len)
        else:
            logprobs = preference.reply_logprobs
        policy, replies = logprobs(applied, params, tokens, prompt_lengths, pad_id=pad_id)
        reference, _ = logprobs(model, frozen["reference"], tokens, prompt_lengths, pad_id=pad_id)
        reference = jax.lax.stop_gradient(reference)
        example_weights = batch.get("example_weights", jnp.ones(prompt_lengths.shape, jnp.float32))
        scale = jnp.maximum(replies, 1.0) if fields.loss_type == "ipo" else 1.0  # IPO compares per-token means
        value, metrics = preference.dpo_loss(
            policy / scale,
            reference / scale,
            example_weights,
            beta=fields.beta,
            label_smoothing=fields.label_smoothing,
            loss_type=fields.loss_type,
        )
        count = metrics["loss"][1]
        logged = jax.lax.stop_gradient(policy * example_weights[:, None])
        metrics = {
            **metrics,
            "logps/chosen": (jnp.sum(logged[:, 0]), count),
            "logps/rejected": (jnp.sum(logged[:, 1]), count),
        }
        if applied is not model:  # the policy's expert layers' losses (the frozen reference has none to learn)
            aux, aux_metrics = applied.terms()
            value, metrics = value + aux, {**metrics, **aux_metrics}
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


def dpo_examples(raw: list[comparisons.Comparison], tokenizer, config, where: str) -> dict[str, np.ndarray]:
    """ "tokens" [N, 2, seq_len] (chosen, rejected: prompt ⊕ reply ⊕ EOS, right-padded, cut as for the reward model),
    "prompt_lengths" [N] and "lengths" [N, 2] (non-pad tokens). Comparisons whose two rows are identical (equal
    replies, or replies equal up to the cut) teach nothing and are skipped, with a count."""
    end = comparisons.response_end_id(tokenizer)
    # A third, empty reply changes no cut (`comparisons.reward_model_arrays` cuts the prompt for the longest reply):
    # its row, prompt ⊕ EOS, measures the prompt as kept.
    groups = [comparisons.RankedResponses(c.prompt, (c.chosen, c.rejected, ""), (0, 1, 2)) for c in raw]
    arrays = comparisons.reward_model_arrays(
        groups,
        tokenizer.encode,
        max_len=config.data.seq_len,
        max_responses=3,
        pad_id=tokenizer.pad_id,
        eos_id=end,
        prompt_budget=config.objective.max_prompt_len,
    )
    lengths = np.sum(arrays["tokens"] != tokenizer.pad_id, axis=-1).astype(np.int32)
    tokens = arrays["tokens"][:, :2]
    distinct = np.any(tokens[:, 0] != tokens[:, 1], axis=-1)
    if not distinct.all():
        logging.warning(
            "dpo, %s: skipped %d of %d comparisons whose chosen and rejected replies are identical (within data.seq_len=%d)",
            where,
            int(np.sum(~distinct)),
            len(distinct),
            config.data.seq_len,
        )
    if not distinct.any():
        raise ValueError(f"dpo, {where}: no comparison has distinct chosen and rejected replies")
    transforms.check_token_ids(tokens, config.model.vocab_size, where=where)
    return {"tokens": tokens[distinct], "prompt_lengths": lengths[distinct, 2] - 1, "lengths": lengths[distinct, :2]}


class DPO(base.ExampleObjective):
    """A decoder trained from the SFT policy on the comparisons of `data.path` by DPO or IPO (see the module docstring)."""

    name = "dpo"
    Config = DPOConfig
    reader = readers.CONVERSATIONS
    loss_is_token_nll = False  # −log σ of implicit reward margins (or IPO's squares)
    lora_base = "reference"  # with LoRA the policy is the frozen reference plus adapters: the base is held once
    no_dropout_because = "its loss compares the policy's log-probabilities with the reference's, as trl's does"

    def check(self):
        super().check()
        seq_len = self.config.data.seq_len
        if self.fields.max_prompt_len > seq_len - 2:
            raise ValueError(
                f"config.objective.max_prompt_len={self.fields.max_prompt_len} leaves no room for a reply and its EOS "
                f"in data.seq_len={seq_len}: set it below {seq_len - 1} (0: no prompt budget)"
            )
        sft_spec = self.fields.sft
        if not sft_spec.startswith("ckpt:"):
            raise ValueError(f"config.objective.sft={sft_spec!r}: set it to 'ckpt:WORKDIR' of the SFT run")
        saved = weights.saved_config(sft_spec.removeprefix("ckpt:"))
        source = (saved or {}).get("objective", {}).get("name")
        # ckpt: reads a reward model's backbone, which has the decoder's shapes: nothing later would refuse it.
        if source == "reward_model":
            raise ValueError(
                f"config.objective.sft={sft_spec!r} is a 'reward_model' run; point it at the sft (or causal_lm) run"
            )
        if saved is not None:
            ours = {"model_name": self.config.model_name, "tokenizer": self.config.data.tokenizer.to_dict()}
            theirs = {"model_name": saved.get("model_name"), "tokenizer": saved.get("data", {}).get("tokenizer")}
            differing = [k for k in ours if ours[k] != theirs[k]]
            if differing:
                raise ValueError(
                    f"the SFT run {sft_spec.removeprefix('ckpt:')} differs from this run in {differing}: "
                    + ", ".join(f"{k} {theirs[k]!r} there vs {ours[k]!r} here" for k in differing)
                )
        if kinds.kind_of(self.model()) != kinds.DECODER:
            raise ValueError(f"dpo trains a decoder; config.model_name={self.config.model_name!r} is not one")
        chat.check_template(self.config, hf.resolve_folder)

    def task(self, model):
        return dpo_task(model, self.fields, pad_id=base.fixed_tokenizer(self.config).pad_id)

    def step_summary(self):
        b, t = self.config.train.batch_size, self.config.data.seq_len
        return f"{b} comparisons x 2 replies x {t} tokens, policy and reference forwards"

    def input_shapes(self, batch_size):
        return {
            "tokens": base.int_inputs((batch_size, 2, self.config.data.seq_len)),
            "prompt_lengths": base.int_inputs((batch_size,)),
        }

    def examples(self, tokenizer, raw, where):
        if chat.holds_conversations(raw):
            raw = chat.rendered_comparisons(raw, chat.template_for(self.config, hf.resolve_folder))
        return dpo_examples(raw, tokenizer, self.config, where)

    def real_tokens(self, batch):
        return int(np.sum(batch["lengths"]))

    def frozen_roles(self):
        """The reference: the SFT run's decoder, read as it is (`check_reference`: every parameter of config.model)."""
        cfg = self.config
        return {
            "reference": base.Role(
                self.fields.sft, cfg.model_name, cfg.model.to_dict(), read="params", check=self.check_reference
            )
        }

    def check_reference(self, fresh, loaded):
        """Refuses an SFT checkpoint that is not a config.model decoder, naming the parameters that differ."""
        workdir = self.fields.sft.removeprefix("ckpt:")
        expected = traverse_util.flatten_dict(jax.tree.map(np.shape, fresh), sep="/")
        found = traverse_util.flatten_dict(jax.tree.map(np.shape, loaded), sep="/")
        if expected != found:
            differing = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
            raise ValueError(
                f"the checkpoint in {workdir} is not a config.model decoder: parameters "
                + ", ".join(f"{k} {found.get(k)} there vs {expected.get(k)} here" for k in differing[:5])
                + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
            )

    def init_params(self, params, frozen):
        """The policy starts as the reference."""
        return jax.tree.map(np.array, frozen["reference"])
