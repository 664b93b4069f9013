"""Qwen3 and Qwen3-MoE: the Llama decoder with a per-head RMSNorm of queries and keys (`qk_norm`), on Tiny Shakespeare
at character level, and the released shapes.

    python train.py --config=configs/qwen3.py        # 4 layers, 4 query / 2 kv heads of 64, D 128: minutes on 2 CPUs
    python train.py --config=configs/qwen3.py:moe    # the same with 8 routed experts a layer, top-2 (Qwen3-MoE)
    python train.py --config=configs/qwen3.py:qwen3_0_6b --config.data.source=store --config.data.path=STORE
    python train.py --config=configs/qwen3.py:qwen3_30b_a3b --config.data.source=store --config.data.path=STORE \\
        --config.sharding.mesh_shape='(1,-1,1)'

The default variant is configs/llama.py's Shakespeare recipe with Qwen3's attention: head_dim set on its own (64, twice
D / N, as Qwen3-0.6B's 128 is twice 1024 / 16), q/k norms, rope_theta 1,000,000, the head tied to the embeddings.
`moe` makes every layer a mixture of 8 experts of F 176, top-2 with the top-2 weights renormalised and no shared expert
(Qwen3-MoE's router: HF's norm_topk_prob). Both export to HF Qwen3ForCausalLM / Qwen3MoeForCausalLM. `:tiny` shrinks
the default for tests.

The released shapes, as their HF config.json files give them (`init_from=hf:Qwen/Qwen3-0.6B` or a folder reads the
weights into them; docs/convert.md), bf16 compute, scanned layers (rematerialised on accelerators), trained as
configs/llama.py's `llama3_8b` is:
- `qwen3_0_6b`: Qwen3-0.6B, 28 layers, D 1,024, 16 query / 8 kv heads of 128, SwiGLU 3,072, vocabulary 151,936 tied
  to the head, 40,960 positions: 596,049,920 parameters. One GPU: float32 params, gradients and AdamW's two moments
  take 16 bytes a parameter, 9.5 GB; the rest is a microbatch's activations (bf16, rematerialised; the largest the
  logits, 151,936 floats a token), bounded with `--config.train.grad_accum_steps`: one 80 GB GPU trains it in full.
- `qwen3_30b_a3b`: Qwen3-30B-A3B, 48 layers, D 2,048, 32 query / 4 kv heads of 128, 128 experts of F 768 a layer,
  top-8 renormalised, vocabulary 151,936 untied, 40,960 positions: 30,532,122,624 parameters, 3,353,032,704 of them
  active for a token (8 of 128 experts). One GPU: the bf16 weights alone are 61.1 GB, so one 80 GB GPU holds them to
  decode or to train LoRA adapters with small batches (the base held in bf16, as configs/llama_sft.py's `llama3_8b`);
  full training takes 16 bytes a parameter, 489 GB: shard it over at least 8 x 80 GB (FSDP as above; the experts over
  an expert axis: docs/moe.md, docs/SCALING.md).
"""

import pathlib

from lmzoo.config import check_variants, load_config_file, model_section

RELEASED = ("qwen3_0_6b", "qwen3_30b_a3b")


def get_config(arg: str | None = None):
    variants = check_variants(arg, known=("tiny", "moe", *RELEASED))
    # configs/llama.py's Shakespeare recipe, data, optimizer and schedule included; only the model differs.
    c = load_config_file(pathlib.Path(__file__).with_name("llama.py"), "tiny" if "tiny" in variants else None)
    c.model_name = "llama"
    c.model = model_section(
        "llama",
        vocab_size=66,  # 65 characters + <eos>
        max_len=64,
        emb_dim=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,  # set on its own, as Qwen3's
        num_layers=1 if "tiny" in variants else 4,
        mlp_dim=352,
        rope_theta=1_000_000.0,
        qk_norm=True,
        tie_embeddings=True,
        norm_epsilon=1e-6,
    )
    if "moe" in variants:  # Qwen3-MoE's router: top-k renormalised (norm_topk_prob), no shared expert
        c.model.update(num_experts=8, experts_per_token=2, expert_mlp_dim=176, renormalize_expert_weights=True)
    released = [name for name in RELEASED if name in variants]
    if len(released) > 1 or (released and "moe" in variants):
        raise ValueError(f"config variants {arg!r}: choose one of {', '.join(RELEASED)} (each is a model's shape)")
    if released:  # Qwen3's vocabulary, positions and rope base, bf16 scanned layers, a long schedule
        c.model.update(
            vocab_size=151_936,
            max_len=40_960,
            head_dim=128,
            rope_theta=1_000_000.0,
            dtype="bfloat16",
            scan_layers=True,
            remat_policy="auto",  # `kernels.remat_policy`: none on the CPU, the projections kept on accelerators
        )
        c.data.seq_len = 4096
        c.train.batch_size = 64
        c.optim.learning_rate, c.optim.min_learning_rate = 3e-4, 3e-5
        c.optim.warmup_steps, c.optim.decay_steps = 2000, 100_000
        c.optim.b2 = 0.95
        c.train.steps = 100_000
        c.train.sample_prompt = ""
    if "qwen3_0_6b" in variants:
        c.model.update(emb_dim=1024, num_heads=16, num_kv_heads=8, num_layers=28, mlp_dim=3072, tie_embeddings=True)
    if "qwen3_30b_a3b" in variants:
        c.model.update(
            emb_dim=2048,
            num_heads=32,
            num_kv_heads=4,
            num_layers=48,
            mlp_dim=6144,  # HF's intermediate_size, the F of dense layers; every layer is sparse, so unused
            tie_embeddings=False,
            num_experts=128,
            experts_per_token=8,
            expert_mlp_dim=768,
            renormalize_expert_weights=True,
            load_balance_coef=0.001,  # HF's router_aux_loss_coef
        )
    return c
