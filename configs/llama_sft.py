"""Fine-tuning a Llama on conversations with LoRA, then DPO with LoRA from it: the recipe for a released checkpoint,
run on the CPU from a small Llama pretrained here (docs/finetune.md).

    python train.py --config=configs/llama_sft.py:base --workdir=runs/llama_sft_base   # stage 0: the base to adapt
    python scripts/hh_chat.py --out=runs/hh_chat                                     # HH-RLHF dialogues as chat rows
    python train.py --config=configs/llama_sft.py --workdir=runs/llama_sft            # stage 1: LoRA SFT over the base
    python train.py --config=configs/llama_sft.py:dpo --workdir=runs/llama_sft_dpo \\
        --config.objective.sft=ckpt:runs/llama_sft                                   # stage 2: LoRA DPO from stage 1
    python train.py --config=configs/llama_sft.py:llama3_8b --workdir=runs/llama3_8b_sft  # Llama 3 8B Instruct, one GPU
    python train.py --config=configs/llama_sft.py:llama3_8b,dpo --workdir=runs/llama3_8b_dpo \\
        --config.objective.sft=ckpt:runs/llama3_8b_sft

The base (`:base`) stands in for a released checkpoint: configs/llama.py's Llama (4 layers, D 128, 4 query / 2 kv
heads, SwiGLU 352) at byte level, pretrained on Tiny Shakespeare with context 512. Stage 1 trains rank-8 adapters on
all seven projections over it (the base frozen, `init_from`), on the HH-RLHF conversations that scripts/hh_chat.py
writes, rendered through Llama 3's chat format (configs/llama3_chat.jinja), loss on the assistant turns only. Stage 2
(`:dpo`) trains new adapters by DPO over the stage-1 run's merged model, which is also its frozen reference, on the
same prompts' chosen / rejected replies. Every stage holds out the same 10% of the prompts.

`llama3_8b` is the same recipe for Meta-Llama-3-8B-Instruct (`init_from=hf:`, a Hub name read from the local
Hugging Face cache, never downloaded; its tokenizer and chat template come with it): configs/llama.py:llama3_8b's
bf16, scanned, rematerialised Llama, the base held in bfloat16, rank-16 adapters in float32. One 80 GB GPU holds it
with adapters on the attention projections; on a pod slice, `--config.sharding.mesh_shape='(1,-1,1)'` shards it
(FSDP) and `--config.lora.targets='query|key|value|out|wi_0|wi_1|wo'` adapts the MLP too (docs/finetune.md gives the
memory arithmetic of both). `:tiny` shrinks every stage for tests.
"""

import pathlib

from lmzoo.config import check_variants, load_config_file
from lmzoo.objectives import objective_section

CONFIGS = pathlib.Path(__file__).resolve().parent
CHAT_ROWS = "runs/hh_chat"  # scripts/hh_chat.py --out
ALL_PROJECTIONS = "query|key|value|out|wi_0|wi_1|wo"
ATTENTION = "query|key|value|out"
EXCLUSIVE = (("tiny", "llama3_8b"), ("base", "dpo"), ("base", "llama3_8b"))


def get_config(arg: str | None = None):
    variants = check_variants(arg, known=("tiny", "base", "dpo", "llama3_8b"))
    for pair in EXCLUSIVE:
        if set(pair) <= set(variants):
            raise ValueError(f"config variants {arg!r}: choose one of {', '.join(pair)}")
    tiny, dpo, llama3_8b = "tiny" in variants, "dpo" in variants, "llama3_8b" in variants
    # configs/llama.py's Llama and Tiny Shakespeare recipe, at byte level: the base stage trains it as it is
    c = load_config_file(CONFIGS / "llama.py", "tiny" if tiny else None)
    c.data.tokenizer.kind = "byte"  # 256 bytes + <eos> 256 + <pad> 257: any text, and the chat format's markers
    c.model.update(vocab_size=258, max_len=512)
    c.data.seq_len = 512
    c.train.batch_size = 8
    c.train.sample_tokens = 0
    if "base" in variants:
        c.train.steps = c.optim.decay_steps = 4 if tiny else 600
        if tiny:
            c.data.seq_len, c.train.batch_size = 256, 4
        c.train.eval_every = c.train.checkpoint_every = c.train.steps
        return c

    # LoRA adapts a frozen base: SFT's is init_from, the base stage's run; DPO's is its reference, the SFT run
    c.init_from = "" if dpo else "ckpt:runs/llama_sft_base"
    c.data.source = "local"
    c.data.path = f"{CHAT_ROWS}/pairs.jsonl" if dpo else f"{CHAT_ROWS}/conversations.jsonl"
    c.lora.update(targets=ALL_PROJECTIONS, rank=8, alpha=16.0)
    split = dict(heldout_fraction=0.1, split_seed=0, chat_template=str(CONFIGS / "llama3_chat.jinja"))
    c.objective = objective_section("dpo", beta=0.1, **split) if dpo else objective_section("sft", **split)
    c.optim.learning_rate, c.optim.min_learning_rate = (5e-4, 5e-5) if dpo else (2e-3, 2e-4)
    c.optim.warmup_steps = 10 if dpo else 20
    c.optim.weight_decay = 0.0  # the adapters start at the base's function: nothing to decay towards
    c.train.steps = c.optim.decay_steps = 130 if dpo else 260  # DPO: half the ~2,070 training pairs
    c.train.log_every = 10
    c.train.eval_every = c.train.checkpoint_every = c.train.steps
    c.eval.batch_size, c.eval.max_batches = 8, 16

    if llama3_8b:  # Meta-Llama-3-8B-Instruct: its shape, tokenizer and template; the base in bf16, the adapters in f32
        c.model = load_config_file(CONFIGS / "llama.py", "llama3_8b").model
        # bf16 weights from the start (never an f32 copy of the base); each layer's input alone kept for the backward
        c.model.update(param_dtype="bfloat16", remat_policy="full")
        c.init_from = "hf:meta-llama/Meta-Llama-3-8B-Instruct"  # DPO too: its tokenizer and chat template
        c.data.tokenizer.kind = "init_from"
        c.objective.chat_template = ""  # the checkpoint's own (tokenizer_config.json)
        c.lora.update(targets=ATTENTION, rank=16, alpha=32.0, base_dtype="bfloat16")
        c.data.seq_len = 1024
        c.train.batch_size = c.eval.batch_size = 16
        # microbatches of 4,096 tokens: 4 sequences, or 2 pairs x 2 replies (docs/finetune.md: the memory they take)
        c.train.grad_accum_steps = 8 if dpo else 4
        c.optim.learning_rate, c.optim.min_learning_rate = (5e-5, 5e-6) if dpo else (2e-4, 2e-5)
        c.train.steps = c.optim.decay_steps = 130 if dpo else 50  # DPO: one epoch; SFT: 800 packed rows
    if tiny:
        c.data.seq_len = 256  # the first assistant turn of most conversations begins within it
        c.train.steps = c.optim.decay_steps = 4
        c.train.batch_size, c.train.log_every = 4, 1
        c.optim.warmup_steps = 0
        c.train.eval_every = c.train.checkpoint_every = 2
        c.eval.batch_size, c.eval.max_batches = 4, 2
    return c
