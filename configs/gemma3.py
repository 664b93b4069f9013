"""Gemma 3 (text): the Llama decoder with sliding-window and global layers 5:1, each kind with its rope base, sandwich
norms, scaled embeddings, q/k norms and a gated tanh-GELU, on Tiny Shakespeare at character level, and the released
shapes.

    python train.py --config=configs/gemma3.py       # 6 layers (5 sliding of 16 : 1 global), D 128: minutes on 2 CPUs
    python train.py --config=configs/gemma3.py:gemma3_1b --config.data.source=store --config.data.path=STORE
    python train.py --config=configs/gemma3.py:gemma3_4b --config.data.source=store --config.data.path=STORE

The default variant is configs/llama.py's Shakespeare recipe with Gemma 3's layers: layers 1-5 attend within the last
16 positions and rotate with base 10,000, layer 6 attends to the whole context and rotates with base 1,000,000 (HF's
layer_types, rope_local_base_freq and rope_theta); 4 query heads of 64 (twice D / N, as Gemma's 256 is more than
1,152 / 4) sharing one kv head, q/k norms, each sublayer's output normalised before its residual add, embeddings
scaled by sqrt(D), the logit scale query_pre_attn_scalar ** -0.5 with query_pre_attn_scalar the head size, GeGLU with
tanh-GELU, the head tied to the embeddings. Its layers are scanned: both kinds are one scan body (the window and the
rotation are each layer's scan input). It exports to HF Gemma3ForCausalLM. `:tiny` shrinks it to one sliding and one
global layer for tests.

The released shapes of the text models, as their HF config.json files give them (`init_from=hf:google/gemma-3-1b-it`
or a folder reads the weights into them; docs/convert.md), bf16 compute, scanned and rematerialised layers, trained as
configs/llama.py's `llama3_8b` is:
- `gemma3_1b`: Gemma 3 1B, 26 layers (every sixth global), D 1,152, 4 query / 1 kv heads of 256, GeGLU 6,912,
  sliding window 512, vocabulary 262,144 tied to the head, 32,768 positions: 999,885,952 parameters. One GPU: float32
  params, gradients and AdamW's two moments take 16 bytes a parameter, 16.0 GB; the rest is a microbatch's activations
  (bf16, rematerialised; the fused head loss never holds the 262,144 logits of every token at once), bounded with
  `--config.train.grad_accum_steps`: one 80 GB GPU trains it in full.
- `gemma3_4b`: Gemma 3 4B's language model (its vision tower left out), 34 layers, D 2,560, 8 query / 4 kv heads of
  256, GeGLU 10,240, sliding window 1,024, global layers' rotation scaled linearly by 8, vocabulary 262,208 tied,
  131,072 positions: 3,880,263,168 parameters. One GPU: the bf16 weights alone are 7.8 GB, so one 80 GB GPU decodes it
  or trains LoRA adapters with room to spare; full training takes 16 bytes a parameter, 62.1 GB, which leaves an
  80 GB GPU about 18 GB for a rematerialised microbatch (grad_accum_steps) and the compiled program: tight; shard it
  over 2 (`--config.sharding.mesh_shape='(1,-1,1)'`, FSDP: docs/SCALING.md) for room.
A scanned stack's KV cache is full-length in every layer (a sliding layer's window is a mask over it): decoding 4B's
34 layers caches 34 x 2 x 4 heads x 256 x 2 bytes = 136 KiB a position (bf16), 9.1 GB for 65,536 positions. With
`--config.model.scan_layers=False` each sliding layer caches only its window.
"""

import pathlib

from lmzoo.config import check_variants, load_config_file, model_section

RELEASED = ("gemma3_1b", "gemma3_4b")


def gemma3_layer_types(num_layers: int) -> tuple[str, ...]:
    """Gemma 3's kinds of layer: every sixth global ("full_attention"), the others local (HF's sliding_window_pattern
    6)."""
    return tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers))


def get_config(arg: str | None = None):
    variants = check_variants(arg, known=("tiny", *RELEASED))
    # configs/llama.py's Shakespeare recipe, data, optimizer and schedule included; only the model differs.
    c = load_config_file(pathlib.Path(__file__).with_name("llama.py"), "tiny" if "tiny" in variants else None)
    c.model_name = "llama"
    c.model = model_section(
        "llama",
        vocab_size=66,  # 65 characters + <eos>
        max_len=64,
        emb_dim=128,
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,  # set on its own, as Gemma's
        num_layers=2 if "tiny" in variants else 6,
        mlp_dim=352,
        layer_types=("sliding_attention", "full_attention") if "tiny" in variants else gemma3_layer_types(6),
        sliding_window=16,  # a quarter of the context, so the local layers see less than the global one
        rope_theta=1_000_000.0,  # the global layers'
        sliding_rope_theta=10_000.0,  # the local layers' (HF's rope_local_base_freq)
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=64.0,  # the head size, as Gemma 3 1B's 256
        mlp_activation="gelu_tanh",  # HF's gelu_pytorch_tanh
        tie_embeddings=True,
        norm_epsilon=1e-6,
        scan_layers=True,
    )
    released = [name for name in RELEASED if name in variants]
    if len(released) > 1:
        raise ValueError(f"config variants {arg!r}: choose one of {', '.join(RELEASED)} (each is a model's shape)")
    if released:  # Gemma 3's heads, rope bases and norms, bf16 scanned rematerialised layers, a long schedule
        c.model.update(
            head_dim=256,
            query_pre_attn_scalar=256.0,
            dtype="bfloat16",
            remat_policy="dots_no_batch",
        )
        c.data.seq_len = 4096
        c.train.batch_size = 64
        c.optim.learning_rate, c.optim.min_learning_rate = 3e-4, 3e-5
        c.optim.warmup_steps, c.optim.decay_steps = 2000, 100_000
        c.optim.b2 = 0.95
        c.train.steps = 100_000
        c.train.sample_prompt = ""
    if "gemma3_1b" in variants:
        c.model.update(
            vocab_size=262_144,
            max_len=32_768,
            emb_dim=1152,
            num_heads=4,
            num_kv_heads=1,
            num_layers=26,
            mlp_dim=6912,
            layer_types=gemma3_layer_types(26),
            sliding_window=512,
        )
    if "gemma3_4b" in variants:
        c.model.update(
            vocab_size=262_208,
            max_len=131_072,
            emb_dim=2560,
            num_heads=8,
            num_kv_heads=4,
            num_layers=34,
            mlp_dim=10_240,
            layer_types=gemma3_layer_types(34),
            sliding_window=1024,
            rope_scaling_factor=8.0,  # HF's rope_scaling: rope_type linear, factor 8, the global layers only
            rope_scaling_type="linear",
        )
    return c
