"""Building blocks shared by two or more families, one module per kind of block.

- `linears`: `project` and `Einsum`, projections whose kernels carry logical axis names.
- `embeddings`: token tables (`Embed`), learned-table length checks, sinusoidal and rotary positions.
- `norms`: LayerNorm and RMS norm.
- `attention`: `AttentionConfig` (the fields of one attention), masks, `Attention` with its KV cache.
- `latent_attention`: multi-head latent attention (DeepSeek-V3's MLA) with its compressed cache, YaRN's rotation.
- `mlp`: activations, the position-wise feed-forward (`MlpBlock`) and the mixture of experts (`MoeConfig`, `MoeBlock`).
- `blocks`: `TransformerBlock` (attention + MLP with residuals) and `BlockStack` (layers looped or scanned).
- `adapters`: low-rank adapters attached beside a layer's kernels, applied at a projection's inputs or merged (LoRA's
  training form).

Einsum letters: B batch, T query length, S key length, D emb_dim, N heads, K kv heads, H head_dim, F mlp_dim,
V vocab, E experts, R a token's routed experts (top-k), C an expert's capacity. Every parameter declares logical
axes (see `lmzoo.sharding`); activations are constrained at block boundaries. These are the plain forms that run on
GPUs and TPUs; where XLA:CPU is slow at one, `lmzoo.kernels` chooses the CPU form beside it.
"""
