"""RL with verifiable rewards: SFT on GSM8K's worked solutions, then GRPO scored by the final-answer check.

    python train.py --config=configs/gsm8k.py:sft --workdir=runs/gsm8k_sft
    python train.py --config=configs/gsm8k.py --workdir=runs/gsm8k_grpo --config.objective.sft=ckpt:runs/gsm8k_sft
    python eval.py --workdir=runs/gsm8k_grpo --gsm8k=../shared/data/gsm8k/test.jsonl

The reward is `lmzoo.rl.rewards.gsm8k`: 1 when the reply's final number (after `####`, in `\\boxed{}` or
`<answer>`, else the last number) equals the one after the row's `####`. Prompts are "Question: ...\\nAnswer:";
replies are byte-level, so the GSM8K recipe is sized for an accelerator (docs/rl.md gives the Qwen2.5 form).

Variants:
- `sft`: the SFT stage (prompt -> worked solution without its <<calculator>> annotations, loss on the solution).
- `addition_sft`, `addition`: the same two stages on a CPU-sized synthetic task, 2-digit sums generated in memory
  ("synthetic:addition", half of the SFT demonstrations wrong by 1 to 9): `addition` runs 400 GRPO steps from
  `--config.objective.sft=ckpt:` of the `addition_sft` run, 8 samples per prompt, the answer reward only, Dr.
  GRPO's advantages and DAPO's clip-higher (docs/rl.md: greedy accuracy on fresh sums before and after).
- `calculator`: the GRPO stage with the calculator tool (`<calc>48/2</calc>` -> `<result>24</result>`, its answers
  in the context but not in the loss), up to 4 policy turns of at most 128 tokens.
- `tiny`: GRPO with the answer reward from nothing (no SFT run: the policy starts from its initialisation, which is
  the reference), a few steps of a 1-layer model, in under a minute.
"""

import pathlib

from lmzoo.config import base_config, check_variants, model_section
from lmzoo.objectives import objective_section

GSM8K = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
# Half of the SFT demonstrations are off by 1 to 9 (the rewards check the true sum): demonstrations with errors,
# which the reward then teaches the policy to leave behind.
ADDITION = "synthetic:addition?digits=2&n=4000&noise=50"


def _model(size: str) -> dict:
    dims = {
        "tiny": dict(max_len=64, emb_dim=32, num_heads=2, num_layers=1, mlp_dim=64),
        "small": dict(max_len=64, emb_dim=128, num_heads=4, num_layers=2, mlp_dim=512),
        "gsm8k": dict(max_len=1024, emb_dim=384, num_heads=6, num_layers=6, mlp_dim=1536),
    }[size]
    return dict(vocab_size=258, dropout_rate=0.0, attention_dropout_rate=0.0, **dims)


def get_config(arg: str | None = None):
    variants = check_variants(arg, ("sft", "addition_sft", "addition", "calculator", "tiny"))
    addition = bool({"addition", "addition_sft", "tiny"} & set(variants))
    c = base_config()
    c.model = model_section("gpt2", **_model("tiny" if "tiny" in variants else "small" if addition else "gsm8k"))
    c.data.source = "local"
    c.data.path = ADDITION if addition else str(GSM8K / "train.jsonl")
    c.data.prompt_template = "{question}=" if addition else "Question: {question}\nAnswer:"
    c.data.tokenizer.kind = "byte"  # 256 bytes + <eos> 256 + <pad> 257
    c.data.seq_len = 32 if addition else 1024
    c.train.sample_tokens = 0
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.0
    if {"sft", "addition_sft"} & set(variants):
        c.objective = objective_section("sft", heldout_fraction=0.05, split_seed=0)
        c.optim.learning_rate, c.optim.min_learning_rate = 1e-3, 1e-4
        c.train.batch_size = 32 if addition else 16
        c.train.steps = c.optim.decay_steps = 300 if addition else 3000
        c.train.log_every = 25
        c.train.eval_every = c.train.checkpoint_every = 100 if addition else 500
        c.eval.batch_size, c.eval.max_batches = 32, 4
        return c
    objective = dict(
        rewards="gsm8k",
        prompt_len=16 if addition else 384,
        response_len=8 if addition else 256,
        samples_per_prompt=8,
        temperature=1.0,
        missing_eos_penalty=0.0,
        kl_coef=0.0,
        kl_loss="off",
        scale_rewards=False,  # Dr. GRPO
        clip_eps_high=0.28,  # DAPO's clip-higher
        heldout_fraction=0.05,
    )
    if "calculator" in variants:
        objective.update(environment="calculator", max_turns=4, turn_len=128, observation_len=32)
    if "tiny" in variants:
        objective.update(samples_per_prompt=4, prompt_len=8, response_len=4, reward_workers=1)
        if "calculator" in variants:
            objective.update(max_turns=2, turn_len=2)
    c.objective = objective_section("grpo", **objective)
    c.optim.learning_rate, c.optim.min_learning_rate = (1e-4, 1e-4) if addition else (1e-5, 1e-5)
    c.optim.warmup_steps = 10  # Adam's first steps are the size of the learning rate whatever the gradient's noise
    c.optim.grad_clip = 1.0
    c.train.batch_size = 16 if addition else 8
    c.train.steps = c.optim.decay_steps = 400 if addition else 500
    c.train.log_every = 5
    c.train.eval_every = c.train.checkpoint_every = 100 if addition else 50
    c.eval.batch_size, c.eval.max_batches = 64, 2
    if "tiny" in variants:
        c.train.steps, c.train.batch_size = 3, 4
        c.optim.decay_steps, c.optim.warmup_steps = c.train.steps, 0
        c.train.eval_every = c.train.checkpoint_every = 3
        c.eval.batch_size, c.eval.max_batches = 8, 1
    return c
