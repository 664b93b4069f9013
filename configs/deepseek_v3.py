"""DeepSeek-V3: multi-head latent attention and a mixture of small experts with sigmoid routing, on Tiny Shakespeare at
character level, and the released shape.

    python train.py --config=configs/deepseek_v3.py    # 4 layers (1 dense, 3 of 8 experts), D 128: minutes on 2 CPUs
    python train.py --config=configs/deepseek_v3.py:deepseek_v3_671b --config.data.source=store \\
        --config.data.path=STORE --config.sharding.mesh_shape='(1,-1,8,1)'

The default variant is configs/llama.py's Shakespeare recipe with DeepSeek-V3's layers (`lmzoo.models.deepseek`):
4 query heads of 16 + 8 rotated dimensions over a key/value latent of 32 (the decode cache holds 32 + 8 numbers a
position and layer, where multi-head attention would hold 4 x (24 + 16) = 160) and a query latent of 48; the first
layer a SwiGLU of 352, the others 8 experts of F 48 in 4 groups, each token routed to its top 2 within its 2 best
groups, plus one shared expert of F 48, with no auxiliary loss: the routing biases balance the load, moved 0.001 a step
against each expert's excess (`optim.expert_bias_rate`, DeepSeek-V3's gamma). `:tiny` shrinks it to 2 layers (1 dense, 1 of experts)
for tests; both export to HF DeepseekV3ForCausalLM.

`deepseek_v3_671b` is DeepSeek-V3's shape as its HF config.json gives it (`init_from=hf:deepseek-ai/DeepSeek-V3` reads
a bf16 copy of its weights: the released files are FP8, which the converter refuses; docs/convert.md): 61 layers, D
7,168, 128 heads of 128 + 64 rotated dimensions with values of 128, latents of 1,536 (queries) and 512 (keys and
values), the first 3 layers SwiGLUs of 18,432, the other 58 of 256 experts of F 2,048 in 8 groups (top-8 within the
best 4, weights renormalised and scaled by 2.5) plus one shared expert, vocabulary 129,280 untied, 163,840 positions
(YaRN: factor 40 over 4,096). It has 671,026,419,200 parameters, 37,552,297,472 of them active for a token (8 of 256
experts). Not runnable here; the arithmetic of one GPU: its bf16 weights alone are 1.34 TB, 17 x 80 GB GPUs before a
single activation, and full training (float32 params, gradients and AdamW's moments, 16 bytes a parameter) 10.7 TB:
shard the experts over an expert axis and the rest FSDP (docs/moe.md, docs/SCALING.md). Its decode cache is 70,272
bytes a token in bf16 (61 layers x (512 + 64) x 2), 4.6 GB for a 65,536-token context, where multi-head attention's
keys and values would take 4,997,120 bytes a token (71x).
"""

import pathlib

from lmzoo.config import check_variants, load_config_file, model_section

RELEASED = ("deepseek_v3_671b",)


def get_config(arg: str | None = None):
    variants = check_variants(arg, known=("tiny", *RELEASED))
    # configs/llama.py's Shakespeare recipe, data, optimizer and schedule included; only the model differs.
    c = load_config_file(pathlib.Path(__file__).with_name("llama.py"), "tiny" if "tiny" in variants else None)
    c.model_name = "deepseek"
    c.model = model_section(
        "deepseek",
        vocab_size=66,  # 65 characters + <eos>
        max_len=64,
        emb_dim=128,
        num_heads=4,
        num_layers=2 if "tiny" in variants else 4,
        mlp_dim=352,  # the dense layer's SwiGLU, as configs/llama.py's
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        first_dense_layers=1,
        num_experts=8,
        experts_per_token=2,
        expert_mlp_dim=48,
        num_shared_experts=1,
        expert_groups=4,
        groups_per_token=2,
        routed_scaling=1.0,  # DeepSeek-V3's 2.5 balances its 8 of 256 experts against the shared one
        norm_epsilon=1e-6,
    )
    c.optim.expert_bias_rate = 0.001  # auxiliary-loss-free balancing (DeepSeek-V3: 0.001, then 0 for its last tokens)
    if "deepseek_v3_671b" in variants:
        c.model = model_section(
            "deepseek",
            vocab_size=129_280,
            max_len=163_840,
            rope_scaling_factor=40.0,  # YaRN over the 4,096 positions of pretraining
            rope_original_max_len=4096,
            rope_mscale=1.0,
            rope_mscale_all_dim=1.0,  # the softmax scale gains (0.1 ln 40 + 1) ** 2
            dtype="bfloat16",
            scan_layers=True,
            remat_policy="auto",  # `kernels.remat_policy`: none on the CPU, the projections kept on accelerators
        )  # the other fields are the family's defaults: DeepSeek-V3's shape
        c.data.seq_len = 4096
        c.train.batch_size = 64
        c.optim.learning_rate, c.optim.min_learning_rate = 2.2e-4, 2.2e-5
        c.optim.warmup_steps, c.optim.decay_steps = 2000, 100_000
        c.optim.b2 = 0.95
        c.train.steps = 100_000
        c.train.sample_prompt = ""
    return c
