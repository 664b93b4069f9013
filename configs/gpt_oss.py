"""gpt-oss (OpenAI 2025): the Llama decoder with experts, attention sinks, q/k/v/o biases, sliding and full layers 1:1
rotating with YaRN, biased experts with a clamped SwiGLU, on Tiny Shakespeare at character level, and the released
shapes.

    python train.py --config=configs/gpt_oss.py      # 4 layers (sliding of 16, full) x 2, 8 experts top-2: 2 CPUs
    python train.py --config=configs/gpt_oss.py:gpt_oss_20b --config.data.source=store --config.data.path=STORE \\
        --config.sharding.mesh_shape='(1,-1,1)'

The default variant is configs/llama.py's Shakespeare recipe with gpt-oss's layers: layers 1 and 3 attend within the
last 16 positions, 2 and 4 to the whole context, all rotating alike (YaRN stretching an original context of 16 by 4 to
the 64 positions, base 150,000, HF's rope_parameters); 8 query heads of 32 sharing 2 kv heads, biases on the four
projections, a learned sink logit per head in every softmax; every layer a mixture of 8 biased experts of F 128,
routed top-2 by a biased router (the softmax of the top-2 logits), each expert gpt-oss's clamped SwiGLU (limit 7,
alpha 1.702); untied head. It exports to HF GptOssForCausalLM. `:tiny` shrinks it to one sliding and one full layer.

The released shapes, as their HF config.json files give them (`init_from=hf:openai/gpt-oss-20b` or a folder reads
them: the experts' MXFP4 blocks are dequantized on load; docs/convert.md), bf16 compute, scanned and rematerialised
layers:
- `gpt_oss_20b`: gpt-oss-20b, 24 layers, D 2,880, 64 query / 8 kv heads of 64, 32 experts of F 2,880 a layer, top-4,
  sliding window 128, vocabulary 201,088 untied, 131,072 positions (YaRN x32 of 4,096): 20,914,757,184 parameters;
  4,187,440,704 take part in a token (4 of 32 experts), 3,608,307,264 without the embedding table (OpenAI's "3.6B
  active"). One GPU: the bf16 weights alone are 41.8 GB, so one 80 GB GPU decodes it or trains LoRA adapters (the base
  held in bf16); full training takes 16 bytes a parameter, 335 GB: shard it over at least 8 x 80 GB (FSDP as above, the
  experts over an expert axis: docs/moe.md, docs/SCALING.md).
- `gpt_oss_120b`: gpt-oss-120b, the same with 36 layers of 128 experts: 116,829,156,672 parameters, 5,711,982,912 of
  them taking part in a token, 5,132,849,472 without the embedding table (OpenAI's "5.1B active"). Its bf16 weights,
  234 GB, need several GPUs even to decode (4 x 80 GB at least).
A scanned stack's KV cache is full-length in every layer (a sliding layer's window is a mask over it): 20b caches
24 x 2 x 8 heads x 64 x 2 bytes = 48 KiB a position (bf16), 6.4 GB for 131,072 positions.
"""

import pathlib

from lmzoo.config import check_variants, load_config_file, model_section

RELEASED = ("gpt_oss_20b", "gpt_oss_120b")


def gpt_oss_layer_types(num_layers: int) -> tuple[str, ...]:
    """gpt-oss's kinds of layer: sliding and full in turn, the first sliding (HF's default layer_types)."""
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))


def get_config(arg: str | None = None):
    variants = check_variants(arg, known=("tiny", *RELEASED))
    # configs/llama.py's Shakespeare recipe, data, optimizer and schedule included; only the model differs.
    c = load_config_file(pathlib.Path(__file__).with_name("llama.py"), "tiny" if "tiny" in variants else None)
    c.model_name = "llama"
    num_layers = 2 if "tiny" in variants else 4
    c.model = model_section(
        "llama",
        vocab_size=66,  # 65 characters + <eos>
        max_len=64,
        emb_dim=128,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        num_layers=num_layers,
        mlp_dim=128,  # HF's intermediate_size: the experts' F (expert_mlp_dim 0)
        layer_types=gpt_oss_layer_types(num_layers),
        sliding_window=16,
        rope_theta=150_000.0,
        rope_scaling_type="yarn",
        rope_scaling_factor=4.0,
        rope_original_max_len=16,
        rope_truncate=False,  # gpt-oss's YaRN ramp is not rounded to whole dimensions
        qkv_bias=True,
        out_bias=True,
        attention_sinks=True,
        num_experts=8,
        experts_per_token=2,
        renormalize_expert_weights=True,  # the softmax of the top-k logits
        router_bias=True,
        expert_bias=True,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
        load_balance_coef=0.001,  # HF's router_aux_loss_coef default
        norm_epsilon=1e-5,
        scan_layers=True,
    )
    released = [name for name in RELEASED if name in variants]
    if len(released) > 1:
        raise ValueError(f"config variants {arg!r}: choose one of {', '.join(RELEASED)} (each is a model's shape)")
    if released:  # gpt-oss's shapes, YaRN x32 of 4,096, bf16 scanned rematerialised layers, a long schedule
        c.model.update(
            vocab_size=201_088,
            max_len=131_072,
            emb_dim=2880,
            num_heads=64,
            num_kv_heads=8,
            head_dim=64,
            mlp_dim=2880,
            sliding_window=128,
            rope_scaling_factor=32.0,
            rope_original_max_len=4096,
            experts_per_token=4,
            dtype="bfloat16",
            remat_policy="auto",  # `kernels.remat_policy`: none on the CPU, the projections kept on accelerators
        )
        c.data.seq_len = 4096
        c.train.batch_size = 64
        c.optim.learning_rate, c.optim.min_learning_rate = 3e-4, 3e-5
        c.optim.warmup_steps, c.optim.decay_steps = 2000, 100_000
        c.optim.b2 = 0.95
        c.train.steps = 100_000
        c.train.sample_prompt = ""
    if "gpt_oss_20b" in variants:
        c.model.update(num_layers=24, layer_types=gpt_oss_layer_types(24), num_experts=32, load_balance_coef=0.9)
    if "gpt_oss_120b" in variants:
        c.model.update(num_layers=36, layer_types=gpt_oss_layer_types(36), num_experts=128, load_balance_coef=0.9)
    return c
