"""Qwen3.5 (text): Gated DeltaNet linear-attention layers, three to each gated full-attention layer, on Tiny Shakespeare
at character level, and the released shape.

    python train.py --config=configs/qwen3_5.py    # 4 layers (3 Gated DeltaNet + 1 full attention), D 128: 2 CPUs
    python train.py --config=configs/qwen3_5.py:qwen3_5_9b --config.init_from=hf:FOLDER \\
        --config.data.source=store --config.data.path=STORE

The default variant is configs/llama.py's Shakespeare recipe with Qwen3.5's layers (`lmzoo.models.qwen3_5`): one
group of 3 Gated DeltaNet layers (2 query/key heads of 32, 4 value heads of 32, a 4-tap convolution) and 1 full-
attention layer (4 query heads of 32 over 2 key/value heads, a quarter of each head rotated, outputs gated), SwiGLU of
352. The decode cache of a Gated DeltaNet layer is its state (4 x 32 x 32 numbers) and 3 convolution inputs, whatever
the length. `:tiny` shrinks it for tests; both export to HF Qwen3_5ForCausalLM.

`:moe` makes every layer's SwiGLU a mixture of 8 experts (top-2, renormalised) with a sigmoid-gated shared expert, as
Qwen3.5-MoE's; it exports to Qwen3_5MoeForCausalLM. Qwen3-Next folders (Qwen3NextForCausalLM, model_type
qwen3_next) load into this family too (`lmzoo.convert.qwen3_5`, docs/convert.md).

`qwen3_5_9b` is the text model of Qwen3.5-9B as transformers' Qwen3_5TextConfig defaults give it (`init_from=hf:`
reads a Qwen3_5ForCausalLM folder; the released checkpoint is the vision-language Qwen3_5ForConditionalGeneration,
whose text model the converter refuses to pick out on its own, docs/convert.md): 32 layers (8 groups of 3 Gated
DeltaNet + 1 full attention), D 4,096, full attention 16 heads of 256 over 4 key/value heads rotating 64 dimensions
(theta 10^7), Gated DeltaNet 16 query/key heads of 128 and 32 value heads of 128, SwiGLU of 12,288, vocabulary 248,320
untied: 8,953,803,264 parameters. The arithmetic of one GPU: bf16 weights 17.9 GB (inference fits an 80 GB GPU);
full training with float32 params, gradients and AdamW's moments (16 bytes a parameter) is 143 GB: shard it FSDP over
2+ GPUs (docs/SCALING.md), or fine-tune with LoRA. Only the 8 full-attention layers keep keys and values: 32 KB a token
in bf16 (8 x 2 x 4 x 256 x 2 bytes), a quarter of a 32-layer attention model's; each Gated DeltaNet layer's state is
32 x 128 x 128 float32 numbers (2 MB) a sequence.

`qwen3_5_35b_a3b` is the text model of Qwen3.5-35B-A3B as transformers' Qwen3_5MoeTextConfig defaults give it: 40
layers (10 groups), D 2,048, full attention 16 heads of 256 over 2 key/value heads, Gated DeltaNet as the 9B's, every
layer 256 experts of F 512 (top-8, renormalised) plus a gated shared expert of 512: 34,660,610,688 parameters. bf16
weights 69 GB, more than one 80 GB GPU holds with activations: shard the experts over an expert axis
(`--config.sharding.mesh_shape='(1,-1,8,1)'`, docs/moe.md) or FSDP.
"""

import pathlib

from lmzoo.config import check_variants, load_config_file, model_section

RELEASED = ("qwen3_5_9b", "qwen3_5_35b_a3b")


def get_config(arg: str | None = None):
    variants = check_variants(arg, known=("tiny", "moe", *RELEASED))
    # configs/llama.py's Shakespeare recipe, data, optimizer and schedule included; only the model differs.
    c = load_config_file(pathlib.Path(__file__).with_name("llama.py"), "tiny" if "tiny" in variants else None)
    c.model_name = "qwen3_5"
    c.model = model_section(
        "qwen3_5",
        vocab_size=66,  # 65 characters + <eos>
        max_len=64,
        emb_dim=64 if "tiny" in variants else 128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16 if "tiny" in variants else 32,
        num_layers=4,  # one group: 3 Gated DeltaNet layers, then full attention (HF's default pattern)
        mlp_dim=176 if "tiny" in variants else 352,
        rope_theta=10_000.0,
        linear_key_heads=2,
        linear_value_heads=4,
        linear_key_dim=16 if "tiny" in variants else 32,
        linear_value_dim=16 if "tiny" in variants else 32,
        chunk_size=32,
    )
    if "moe" in variants:  # every layer's SwiGLU 8 experts of F 48, top-2 renormalised, plus a gated shared expert
        c.model.update(num_experts=8, experts_per_token=2, expert_mlp_dim=48, shared_expert_mlp_dim=48)
    released = {
        "qwen3_5_9b": {},  # the family's defaults
        "qwen3_5_35b_a3b": dict(
            emb_dim=2048,
            num_kv_heads=2,
            num_layers=40,
            mlp_dim=512,
            num_experts=256,
            experts_per_token=8,
            expert_mlp_dim=512,
            shared_expert_mlp_dim=512,
            load_balance_coef=0.001,
        ),
    }
    for name, fields in released.items():
        if name not in variants:
            continue
        c.model = model_section(
            "qwen3_5",
            max_len=262_144,
            dtype="bfloat16",
            scan_layers=True,
            remat_policy="auto",  # `kernels.remat_policy`: none on the CPU, the projections kept on accelerators
            **fields,
        )
        c.data.seq_len = 4096
        c.train.batch_size = 16
        c.optim.learning_rate, c.optim.min_learning_rate = 1e-5, 1e-6
        c.optim.warmup_steps, c.optim.decay_steps = 100, 10_000
        c.train.steps = 10_000
        c.train.sample_prompt = ""
    return c
