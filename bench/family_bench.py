"""Family benchmark: llama_bench's comparison in each newer family, lmzoo against HF PyTorch on the same weights, train
step and decode, in one run.

    python bench/family_bench.py [--rounds 3]             # every family at llama_bench's shape
    python bench/family_bench.py --families qwen3,gemma3   # some: qwen3 qwen3_moe gemma3 gpt_oss qwen3_5 deepseek_v3
    python bench/family_bench.py --tiny                    # smoke run of every family: tiny shapes, 1 round, few steps

Each family is llama_bench's model (vocabulary 8,192, D 256, 4 query / 2 kv heads of 64, 4 layers, SwiGLU 704, batch
16 x 256 tokens; decode: a prompt of 16, 256 new tokens) with the family's own parts switched on (`FAMILIES`):
- qwen3: q/k norms, rope base 10^6;
- qwen3_moe: the same with 8 experts of F 352 a layer, top-2 renormalised (a token's active width is the dense 704);
- gemma3: sliding layers (window 64) and a global one 3:1 (Gemma 3's 5:1 cut to 4 layers), each kind with its rope base,
  sandwich norms, embeddings scaled by sqrt(D), q/k norms, GeGLU (tanh GELU), the head tied to the embeddings;
- gpt_oss: attention sinks, q/k/v/o biases, sliding (window 64) and full layers in turn rotating with YaRN, 8 biased
  experts of F 352 with gpt-oss's clamped SwiGLU, top-2 by a biased router;
- qwen3_5: Gated DeltaNet layers, three to each gated full-attention layer (linear heads: 2 query/key of 64, 4 value of
  64), a quarter of each attention head rotated;
- deepseek_v3: multi-head latent attention (latents of 192 for queries, 128 for keys and values; heads of 48 + 16
  rotated dimensions, values of 64), the first layer dense, then 8 experts of F 176 in 4 groups, top-3 within the best
  2 groups by sigmoid scores, plus a shared expert (active width 704).
The MoE families train with a load-balancing loss of 0.001 on both sides (HF's `output_router_logits`) and no
z-loss; DeepSeek-V3 with neither. `--tiny` shrinks the shape to vocabulary 512, D 64 (heads of 16), 2 layers (Qwen3.5:
its group of 4), SwiGLU 176, batch 2 x 32 tokens, 2 steps, 16 new tokens: every part runs, the numbers mean nothing.
Each family starts two trainer processes and compiles its programs anew, so even --tiny takes minutes.

For each family, in the same run: one random lmzoo model (`lmzoo.models`' init, every constant tensor - norm
scales, biases, correction biases - spread by noise of 0.1 so that each part's weights matter) is exported
with `lmzoo.convert.export.export_hf` and read by transformers' `AutoModelForCausalLM.from_pretrained` (its default
attention and experts implementations), and the logits of both on the bench's inputs (the train batch and the decode
prompt) are asserted equal within 1e-3 before anything is timed. Then, as llama_bench (`bench/common.py`):
(1) train tokens/s of lmzoo's production train step (the step `lmzoo.train.loop` jits, `common.LmzooTrainer`) and of
torch eager forward + backward + AdamW with lmzoo's hyper-parameters (`common.TorchTrainer`, with whichever of 1 or 2
threads runs a step faster), both starting from the exported weights, each in a process of its own
(`common.Isolated`), in interleaved rounds with the f32 matmul peak measured in each round and both MFUs against it
(FLOPs a token: 6 x the matmul weights a token uses, experts counted by their share k/E, plus 12 x T x width for each
softmax-attention layer, sliding ones over at most their window; the Gated DeltaNet recurrence is not counted); and
(2) greedy decode tokens/s of one prompt, `lmzoo.decoding.generate` with its KV cache against HF `generate` with its
cache (torch on whichever of 1 or 2 threads decodes faster), in interleaved rounds, with the fraction of tokens the
two agree on. Targets, llama_bench's, are printed as PASS/MISS and never asserted: train lmzoo/torch >= 1.25, decode
lmzoo/HF >= 1.0 (medians). The CPU model, the matmul peak and the load average at start and end are printed; the last
line is one JSON record of every number.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable

import flax.linen as nn
import jax
import numpy as np
from flax import serialization

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from lmzoo import config as config_lib  # noqa: E402
from lmzoo import models  # noqa: E402
from lmzoo.convert import export  # noqa: E402
from lmzoo.objectives import tasks  # noqa: E402

# PASS when the value is >= target, as llama_bench's: train vs torch, lmzoo's cached decode vs HF generate.
TARGETS = {"train_ratio": 1.25, "decode_vs_hf": 1.0}
LOGITS_TOL = 1e-3
LOAD_BALANCE_COEF = 0.001  # the MoE families' on both sides (HF: router_aux_loss_coef, which the export writes)
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes every family shares where it has them: llama_bench's (`FULL_SHAPE`) or a smoke run's (`TINY_SHAPE`)."""

    vocab_size: int
    emb_dim: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    mlp_dim: int
    seq_len: int
    batch_size: int
    steps_per_round: int
    prompt_len: int
    new_tokens: int

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.num_heads

    @property
    def max_len(self) -> int:
        """Positions of the one model that trains on seq_len and decodes prompt_len + new_tokens."""
        return max(self.seq_len, self.prompt_len + self.new_tokens)


FULL_SHAPE = Shape(
    8192, 256, 4, 2, 4, 704, seq_len=256, batch_size=16, steps_per_round=6, prompt_len=16, new_tokens=256
)
TINY_SHAPE = Shape(512, 64, 4, 2, 2, 176, seq_len=32, batch_size=2, steps_per_round=2, prompt_len=8, new_tokens=16)


def _llama(s: Shape, **switches) -> tuple[str, dict]:
    fields = dict(
        vocab_size=s.vocab_size,
        max_len=s.max_len,
        emb_dim=s.emb_dim,
        num_heads=s.num_heads,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        num_layers=s.num_layers,
        mlp_dim=s.mlp_dim,
    )
    return "llama", fields | switches


# Router settings of the MoE families that HF trains alike: its load-balancing loss, no z-loss (HF has none).
ROUTER = dict(router_z_loss_coef=0.0, load_balance_coef=LOAD_BALANCE_COEF)


def qwen3(s: Shape) -> tuple[str, dict]:
    return _llama(s, qk_norm=True, rope_theta=1e6)


def qwen3_moe(s: Shape) -> tuple[str, dict]:
    return _llama(
        s,
        qk_norm=True,
        rope_theta=1e6,
        num_experts=8,
        experts_per_token=2,
        expert_mlp_dim=s.mlp_dim // 2,
        renormalize_expert_weights=True,
        **ROUTER,
    )


def gemma3(s: Shape) -> tuple[str, dict]:
    return _llama(
        s,
        layer_types=(SLIDING,) * (s.num_layers - 1) + (FULL,),
        sliding_window=s.seq_len // 4,
        rope_theta=1e6,
        sliding_rope_theta=1e4,
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=float(s.head_dim),
        mlp_activation="gelu_tanh",
        tie_embeddings=True,
    )


def gpt_oss(s: Shape) -> tuple[str, dict]:
    return _llama(
        s,
        mlp_dim=s.mlp_dim // 2,  # gpt-oss's intermediate_size: the experts' F
        layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(s.num_layers)),
        sliding_window=s.seq_len // 4,
        rope_theta=150_000.0,
        rope_scaling_type="yarn",
        rope_scaling_factor=4.0,
        rope_original_max_len=s.max_len // 4,
        rope_truncate=False,
        qkv_bias=True,
        out_bias=True,
        attention_sinks=True,
        num_experts=8,
        experts_per_token=2,
        renormalize_expert_weights=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
        norm_epsilon=1e-5,
        **ROUTER,
    )


def qwen3_5(s: Shape) -> tuple[str, dict]:
    return "qwen3_5", dict(
        vocab_size=s.vocab_size,
        max_len=s.max_len,
        emb_dim=s.emb_dim,
        num_heads=s.num_heads,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        num_layers=max(s.num_layers, 4),  # one group of 3 Gated DeltaNet layers and a full-attention one at least
        mlp_dim=s.mlp_dim,
        linear_key_heads=2,
        linear_value_heads=4,
        linear_key_dim=s.head_dim,
        linear_value_dim=s.head_dim,
    )


def deepseek_v3(s: Shape) -> tuple[str, dict]:
    return "deepseek", dict(
        vocab_size=s.vocab_size,
        max_len=s.max_len,
        emb_dim=s.emb_dim,
        num_heads=s.num_heads,
        num_layers=s.num_layers,
        mlp_dim=s.mlp_dim,
        q_lora_rank=3 * s.emb_dim // 4,
        kv_lora_rank=s.emb_dim // 2,
        qk_nope_head_dim=3 * s.head_dim // 4,
        qk_rope_head_dim=s.head_dim // 4,
        v_head_dim=s.head_dim,
        first_dense_layers=1,
        num_experts=8,
        experts_per_token=3,
        expert_mlp_dim=s.mlp_dim // 4,
        num_shared_experts=1,
        expert_groups=4,
        groups_per_token=2,
        routed_scaling=1.0,
    )


FAMILIES: dict[str, Callable[[Shape], tuple[str, dict]]] = {
    f.__name__: f for f in (qwen3, qwen3_moe, gemma3, gpt_oss, qwen3_5, deepseek_v3)
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One family's bench, as the trainers' processes receive it: the lmzoo family and its config.model fields, the
    folder holding the weights both sides start from (params.msgpack, hf/), and what `common.train_vs_torch` reads."""

    family: str
    model_name: str
    fields: dict
    folder: str
    vocab_size: int
    seq_len: int
    batch_size: int
    steps_per_round: int
    flops: float

    def flops_per_token(self) -> float:
        return self.flops


def flops_per_token(model_name: str, cfg, params, seq_len: int) -> float:
    """6 x the matmul weights a token uses (experts [E, ...] by their share k/E; the embedding table only as a tied
    head; convolutions left out) + 12 x T x width per softmax-attention layer (PaLM's 6N + 12LTD; a sliding layer's T
    at most its window; width the heads' query/key plus value dimensions over 2). Gated DeltaNet's recurrence is not
    counted."""
    leaves = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    tied = not any("lm_head" in name for name in leaves)
    n_matmul = 0.0
    for name, leaf in leaves.items():
        last = name.rsplit("[", 1)[-1]
        if leaf.ndim < 2 or "bias" in last or "conv" in last or ("embedding" in last and not tied):
            continue
        experts = leaf.ndim == 3 and "mlp" in name and leaf.shape[0] == cfg.num_experts
        n_matmul += leaf.size * (cfg.experts_per_token / cfg.num_experts if experts else 1.0)
    if model_name == "deepseek":
        width = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) / 2
        contexts = [seq_len] * cfg.num_layers
    elif model_name == "qwen3_5":
        width = cfg.num_heads * cfg.head_dim
        contexts = [seq_len] * (cfg.num_layers // 4)  # the full-attention layer of each group of 4
    else:
        width = cfg.num_heads * cfg.head_size
        kinds = cfg.layer_types or (FULL,) * cfg.num_layers
        contexts = [min(seq_len, cfg.sliding_window) if kind == SLIDING else seq_len for kind in kinds]
    return 6 * n_matmul + 12 * width * sum(contexts)


def spread_constants(params, seed: int = 1):
    """`params` (numpy) with every tensor whose entries are all equal (norm scales, biases, correction biases) plus
    noise of 0.1, so that a part left out on either side changes the logits."""
    rng = np.random.default_rng(seed)

    def spread(x: np.ndarray) -> np.ndarray:
        if x.size > 1 and np.all(x == x.flat[0]):
            return (x + 0.1 * rng.standard_normal(x.shape)).astype(x.dtype)
        return x

    return jax.tree.map(spread, params)


def hf_model(folder: str):
    """The exported model as transformers reads it: float32, its default attention and experts implementations.
    torch and transformers are imported here, not at the top: lmzoo's trainer process, which imports this module
    again (`common.Isolated` spawns it), then starts without them."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(os.path.join(folder, "hf"), dtype=torch.float32)


def read_params(folder: str):
    return serialization.msgpack_restore(pathlib.Path(folder, "params.msgpack").read_bytes())


def lmzoo_trainer(spec: Spec, tokens: np.ndarray) -> common.LmzooTrainer:
    """lmzoo's train step on next-token targets of `tokens` [B, T + 1], from the bench's weights."""
    model = models.build_model(spec.model_name, spec.fields)
    trainer = common.LmzooTrainer(
        tasks.causal_lm_task(model), common.next_token_batch(tokens), config_lib.base_config().optim
    )
    # The weights replace the initial ones; AdamW's fresh state (zero moments, step 0) does not depend on them.
    params = jax.device_put(read_params(spec.folder), trainer.compiled.state_shardings.params)
    trainer.state = trainer.state.replace(params=params)
    return trainer


def torch_trainer(spec: Spec, tokens: np.ndarray) -> common.TorchTrainer:
    """HF's model of the exported weights + torch AdamW as lmzoo trains; loss over the same B*T next tokens, with
    HF's load-balancing loss where lmzoo has one. Runs on whichever of 1 or 2 threads runs a step faster (a warm-up
    step, then one with each), which it writes to FOLDER/torch_threads.json."""
    model = hf_model(spec.folder)
    if spec.fields.get("load_balance_coef"):
        model.config.output_router_logits = True
    # T inputs, loss over the same T next tokens as lmzoo (shift_labels stops HF's internal shift).
    inputs = {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1], "shift_labels": tokens[:, 1:]}
    trainer = common.TorchTrainer(
        model,
        inputs,
        config_lib.base_config().optim,
        decays=lambda name, param: param.ndim >= 2 and not name.startswith("model.embed_tokens"),
    )
    threads, seconds = common.fastest_torch_threads(lambda: trainer.run(1))
    pathlib.Path(spec.folder, "torch_threads.json").write_text(json.dumps({"threads": threads, "seconds": seconds}))
    return trainer


def train_tokens(shape: Shape) -> np.ndarray:
    """The train batch's tokens [B, T + 1], as `common.train_vs_torch` draws them."""
    return np.random.default_rng(0).integers(0, shape.vocab_size, (shape.batch_size, shape.seq_len + 1), np.int32)


def prompt_of(shape: Shape) -> np.ndarray:
    """The decode prompt [1, P]: the first P tokens of the train batch's first row, so that the logits check of the
    train batch covers the prompt's too (a causal model's logits at a position depend on the tokens up to it)."""
    return train_tokens(shape)[:1, : shape.prompt_len]


def build(family: str, shape: Shape, folder: str) -> tuple[Spec, nn.Module, dict, dict]:
    """`family`'s random model at `shape`, its weights written to `folder` (params.msgpack, and hf/ by lmzoo's
    exporter): (the Spec, the lmzoo model, its params, the export's summary)."""
    model_name, fields = FAMILIES[family](shape)
    cfg = models.make_config(model_name, fields)
    model = models.build_model(model_name, cfg)
    init = jax.jit(lambda rng: nn.unbox(model.init(rng, train_tokens(shape)[:1, :8]))["params"])
    params = spread_constants(jax.tree.map(np.asarray, jax.device_get(init(jax.random.key(0)))))
    pathlib.Path(folder, "params.msgpack").write_bytes(serialization.msgpack_serialize(params))
    summary = export.export_hf(model_name, cfg, params, os.path.join(folder, "hf"))
    spec = Spec(
        family=family,
        model_name=model_name,
        fields=fields,
        folder=folder,
        vocab_size=shape.vocab_size,
        seq_len=shape.seq_len,
        batch_size=shape.batch_size,
        steps_per_round=shape.steps_per_round,
        flops=flops_per_token(model_name, cfg, params, shape.seq_len),
    )
    return spec, model, params, summary


def check_logits(family: str, model: nn.Module, params: dict, reference, shape: Shape) -> dict:
    """Max |lmzoo - HF| logits on the train batch's inputs (and so on the decode prompt, `prompt_of`) and the
    logits' spread; raises beyond LOGITS_TOL, before anything is timed."""
    import torch

    inputs = train_tokens(shape)[:, :-1]
    ours = np.asarray(jax.jit(lambda p, x: model.apply({"params": p}, x))(params, inputs))
    with torch.no_grad():
        theirs = reference(torch.from_numpy(inputs.astype(np.int64))).logits.numpy()
    diff, std = float(np.max(np.abs(ours - theirs))), float(theirs.std())
    assert diff <= LOGITS_TOL, (
        f"{family}: lmzoo's and HF's logits differ by {diff:.3e} > {LOGITS_TOL} (logit std {std:.3f}): the two sides "
        "would time different models"
    )
    return {"logits_max_diff": diff, "logits_std": std}


def bench_decode(family: str, model: nn.Module, params: dict, reference, shape: Shape, rounds: int) -> dict:
    """Greedy decode of one prompt: lmzoo's `generate` with its KV cache and HF `generate` (`reference`) with its."""
    import torch

    reference.generation_config.eos_token_id = None  # every new token, as lmzoo's
    params = jax.device_put(params)
    prompt = prompt_of(shape)
    torch_prompt = torch.from_numpy(prompt.astype(np.int64))

    def hf_generate(new_tokens: int = shape.new_tokens) -> np.ndarray:
        with torch.no_grad():
            out = reference.generate(
                torch_prompt,
                attention_mask=torch.ones_like(torch_prompt),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
        return out[:, shape.prompt_len :].numpy()

    hf_threads, _ = common.fastest_torch_threads(lambda: hf_generate(max(shape.new_tokens // 4, 1)))
    modes = {
        "lmzoo": lambda: common.greedy_decode(model, params, prompt, shape.new_tokens, use_cache=True),
        "hf": hf_generate,
    }
    outputs = {name: run() for name, run in modes.items()}  # first call: jit compile (lmzoo)
    shapes = {name: out.shape for name, out in outputs.items()}
    assert set(shapes.values()) == {(1, shape.new_tokens)}, f"{family}: decoded {shapes}"

    def measure(r: int) -> dict[str, float]:
        row = common.rates(modes, dict.fromkeys(modes, shape.new_tokens), r)
        row["vs_hf"] = row["lmzoo"] / row["hf"]
        return row

    per_round = common.measure_rounds(f"{family} decode round", rounds, measure)
    agree = float(np.mean(outputs["lmzoo"] == outputs["hf"]))
    return common.summary(per_round, hf_threads=hf_threads, greedy_tokens_agree=agree)


DECODE_COLUMNS = [
    ("lmzoo tok/s", "lmzoo", "{:.1f}"),
    ("HF generate tok/s", "hf", "{:.1f}"),
    ("lmzoo/HF", "vs_hf", "{:.2f}"),
]


def model_has_experts(spec: Spec) -> bool:
    return spec.fields.get("num_experts", 0) > 0


def bench_family(family: str, shape: Shape, rounds: int) -> dict:
    """One family: its model, the logits check, train rounds, decode rounds, printed as they finish; its record."""
    with tempfile.TemporaryDirectory(prefix=f"family_bench_{family}_") as folder:
        spec, model, params, summary = build(family, shape, folder)
        reference = hf_model(folder).eval()
        hf = {
            "class": summary["architecture"],
            "attention": reference.config._attn_implementation,
            "experts": getattr(reference.config, "_experts_implementation", None) if model_has_experts(spec) else None,
        }
        check = check_logits(family, model, params, reference, shape)
        print(
            f"\n=== {family}: lmzoo {spec.model_name} {spec.fields}\n    HF {hf['class']} (attention "
            f"{hf['attention']}, experts {hf['experts']}); max |lmzoo - HF| logits {check['logits_max_diff']:.2e} "
            f"(logit std {check['logits_std']:.3f}, tolerance {LOGITS_TOL})",
            flush=True,
        )
        train = common.train_vs_torch(spec, rounds, lmzoo_trainer, torch_trainer)
        train["torch_threads"] = json.loads(pathlib.Path(folder, "torch_threads.json").read_text())
        decode = bench_decode(family, model, params, reference, shape, rounds)
    common.print_train_vs_torch(spec, train)
    seconds = train["torch_threads"]["seconds"]
    print(
        f"torch trained on {train['torch_threads']['threads']} thread(s) (a step, after a warm-up step, took "
        + ", ".join(f"{s:.2f} s on {n}" for n, s in seconds.items())
        + "; so torch's compile+1st step above is a warm step)"
    )
    print(
        f"\ndecode: batch 1, prompt {shape.prompt_len}, {shape.new_tokens} new tokens, greedy; HF on "
        f"{decode['hf_threads']} torch thread(s); tokens agree with HF {decode['greedy_tokens_agree']:.1%}"
    )
    common.print_table(decode, DECODE_COLUMNS)
    return {
        "model_name": spec.model_name,
        "fields": spec.fields,
        "hf": hf,
        "check": check,
        "train": train,
        "decode": decode,
        "results": {"train_ratio": train["median_ratio"], "decode_vs_hf": decode["median_vs_hf"]},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, 1 round, few steps (smoke test)")
    args = parser.parse_args()
    families = [name for name in args.families.split(",") if name]
    unknown = [name for name in families if name not in FAMILIES]
    if unknown or not families:
        parser.error(f"--families: unknown {unknown or 'none given'}; choose from {', '.join(FAMILIES)}")
    shape, rounds = (TINY_SHAPE, 1) if args.tiny else (FULL_SHAPE, args.rounds)
    load = common.announce("family", f"{'tiny' if args.tiny else 'llama_bench'} {','.join(families)}", shape, rounds)
    peak = common.print_matmul_peak(sizes=(1024,) if args.tiny else (1024, 2048))

    records = {family: bench_family(family, shape, rounds) for family in families}
    load["end"] = os.getloadavg()[0]

    print(f"\nload average (1 min) at start {load['start']:.2f}, at end {load['end']:.2f}")
    print("targets (medians; train = lmzoo/torch tokens/s, decode = lmzoo/HF generate tokens/s):")
    targets = {}
    for family, record in records.items():
        shown = common.report_targets(
            {f"{family} {name}": value for name, value in record["results"].items()},
            {f"{family} {name}": target for name, target in TARGETS.items()},
        )
        targets[family] = {name: shown[f"{family} {name}"] for name in TARGETS}
    cpu_model, isa = common.cpu_model_and_isa()
    record = {
        "bench": "family",
        "config": "tiny" if args.tiny else "llama_bench",
        "shape": dataclasses.asdict(shape),
        "cpu": cpu_model,
        "isa": isa,
        "matmul_peak_gflops": {str(n): g for n, g in peak.items()},
        "families": records,
        "load_average": load,
        "targets": targets,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
