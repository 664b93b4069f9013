"""A Llama-style decoder (RoPE, RMSNorm, SwiGLU, grouped-query attention) on Tiny Shakespeare, character level.

    python train.py --config=configs/llama.py                # 4 layers, 4 query / 2 kv heads, D 128: minutes on 2 CPUs
    python train.py --config=configs/llama.py:mistral        # the same with a 32-position sliding window
    python train.py --config=configs/llama.py:moe            # the same with 8 SwiGLU experts a layer, top-2
    python train.py --config=configs/llama.py:llama3_8b --config.data.source=store --config.data.path=STORE

The default variant is the Shakespeare recipe of `configs/shakespeare_char.py`, loaded from it (context 64, batch 12, 2,000
steps, AdamW 1e-3 cosine to 1e-4, clip 1.0) with the Llama block in place of GPT-2's. `llama3_8b` is Llama 3 8B's
shape (32 layers, D 4096, 32 query / 8 kv heads, SwiGLU 14,336, rope_theta 500,000, vocabulary 128,256, context
8,192) for accelerators, bf16 compute, scanned and rematerialised layers, on a prepared token store of its
tokenizer (`python -m lmzoo.data.prepare`, docs/data.md); shard it with `--config.sharding.mesh_shape`
(docs/SCALING.md). `moe` makes every layer a mixture of 8 experts of F 176 with Mixtral's top-2 router, so a token
goes through 2 x 176 = 352 expert units, the dense recipe's active parameter count (and a router [128, 8] a layer)
(docs/moe.md). `:tiny` shrinks the default for tests.
"""

import pathlib

from lmzoo.config import check_variants, load_config_file, model_section


def get_config(arg: str | None = None):
    variants = check_variants(arg, known=("tiny", "mistral", "moe", "llama3_8b"))
    # The Shakespeare recipe, data, optimizer and schedule included; only the model differs.
    c = load_config_file(
        pathlib.Path(__file__).with_name("shakespeare_char.py"), "tiny" if "tiny" in variants else None
    )
    c.model_name = "llama"
    c.model = model_section(
        "llama",
        vocab_size=66,  # 65 characters + <eos>
        max_len=64,
        emb_dim=128,
        num_heads=4,
        num_kv_heads=2,
        num_layers=1 if "tiny" in variants else 4,
        mlp_dim=352,  # SwiGLU's 3 matrices at about GPT-2's 4 x D MLP parameter count
        rope_theta=10_000.0,
        norm_epsilon=1e-5,
    )
    c.optim.decay_embeddings = False
    if "mistral" in variants:
        c.model.sliding_window = 32
    if "moe" in variants:
        c.model.update(num_experts=8, experts_per_token=2, expert_mlp_dim=176)
    if "llama3_8b" in variants:
        c.model.update(
            vocab_size=128_256,
            max_len=8192,
            emb_dim=4096,
            num_heads=32,
            num_kv_heads=8,
            num_layers=32,
            mlp_dim=14_336,
            rope_theta=500_000.0,
            dtype="bfloat16",
            scan_layers=True,
            remat_policy="dots_no_batch",
        )
        c.data.seq_len = 8192
        c.train.batch_size = 64
        c.optim.learning_rate, c.optim.min_learning_rate = 3e-4, 3e-5
        c.optim.warmup_steps, c.optim.decay_steps = 2000, 100_000
        c.optim.b2 = 0.95
        c.train.steps = 100_000
        c.train.sample_prompt = ""
    return c
