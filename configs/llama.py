"""A Llama-style decoder (RoPE, RMSNorm, SwiGLU, grouped-query attention) on Tiny Shakespeare, character level.

    python train.py --config=configs/llama.py                # 4 layers, 4 query / 2 kv heads, D 128: minutes on 2 CPUs
    python train.py --config=configs/llama.py:mistral        # the same with a 32-position sliding window
    python train.py --config=configs/llama.py:moe            # the same with 8 SwiGLU experts a layer, top-2
    python train.py --config=configs/llama.py:llama3_8b --config.data.source=store --config.data.path=STORE
    python train.py --config=configs/llama.py:llama3_1b --config.data.source=store --config.data.path=STORE

The default variant is the Shakespeare recipe of `configs/shakespeare_char.py`, loaded from it (context 64, batch 12,
2,000 steps, AdamW 1e-3 cosine to 1e-4, clip 1.0) with the Llama block in place of GPT-2's. `llama3_8b` is Llama 3 8B's
shape (32 layers, D 4096, 32 query / 8 kv heads, SwiGLU 14,336, rope_theta 500,000, vocabulary 128,256, context 8,192)
for accelerators, bf16 compute, scanned layers rematerialised as the platform needs (`remat_policy="auto"`: none on the
CPU, the projections kept on accelerators), on a prepared token store of its tokenizer (`python -m lmzoo.data.prepare`,
docs/data.md); shard it with `--config.sharding.mesh_shape` (docs/SCALING.md). `moe` makes every layer a mixture of 8
experts of F 176 with Mixtral's top-2 router, so a token goes through 2 x 176 = 352 expert units, the dense recipe's
active parameter count (and a router [128, 8] a layer) (docs/moe.md). `:tiny` shrinks the default for tests.

`llama3_1b` is Llama 3.2 1B's shape as its HF config.json gives it (16 layers, D 2,048, 32 query / 8 kv heads of 64,
SwiGLU 8,192, vocabulary 128,256 with the head tied to the embeddings, rope_theta 500,000 with llama3 rope scaling:
factor 32, low / high frequency factors 1 / 4, 8,192 original positions; 131,072 positions), 1,235,814,400
parameters, trained as `llama3_8b` is; bench/device_suite.py times its step on one accelerator.
"""

import pathlib

from lmzoo.config import check_variants, load_config_file, model_section


def get_config(arg: str | None = None):
    variants = check_variants(arg, known=("tiny", "mistral", "moe", "llama3_8b", "llama3_1b"))
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
    released = [name for name in ("llama3_8b", "llama3_1b") if name in variants]
    if len(released) > 1:
        raise ValueError(f"config variants {arg!r}: choose one of llama3_8b, llama3_1b (each is a model's shape)")
    if released:  # Llama 3's vocabulary and rope base, bf16 scanned layers, its pretraining schedule
        c.model.update(
            vocab_size=128_256,
            num_heads=32,
            num_kv_heads=8,
            rope_theta=500_000.0,
            dtype="bfloat16",
            scan_layers=True,
            remat_policy="auto",  # `kernels.remat_policy`: none on the CPU, the projections kept on accelerators
        )
        c.data.seq_len = 8192
        c.train.batch_size = 64
        c.optim.learning_rate, c.optim.min_learning_rate = 3e-4, 3e-5
        c.optim.warmup_steps, c.optim.decay_steps = 2000, 100_000
        c.optim.b2 = 0.95
        c.train.steps = 100_000
        c.train.sample_prompt = ""
    if "llama3_8b" in variants:
        c.model.update(max_len=8192, emb_dim=4096, num_layers=32, mlp_dim=14_336)
    if "llama3_1b" in variants:
        c.model.update(
            max_len=131_072,
            emb_dim=2048,
            head_dim=0,  # emb_dim // num_heads = 64; 0 as `init_from=hf:` reads HF's head_dim 64, so they match
            num_layers=16,
            mlp_dim=8192,
            rope_scaling_factor=32.0,  # HF's rope_scaling: rope_type llama3, factor 32, low 1, high 4, original 8192
            rope_low_freq_factor=1.0,
            rope_high_freq_factor=4.0,
            rope_original_max_len=8192,
            tie_embeddings=True,
        )
    return c
