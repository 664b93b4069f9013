"""Llama benchmark: lmzoo's production train step vs HF LlamaForCausalLM + torch AdamW, and KV-cache decode vs
recompute and vs HF `generate`, on the same small grouped-query shape.

    python bench/llama_bench.py [--rounds 3] [--quick]

Measures (1) the f32 matmul peak, (2) train tokens/s of the same model in lmzoo (the step `lmzoo.train.loop`
jits) and in torch eager (sdpa attention), each in a process of its own (`common.Isolated`), in interleaved
rounds, with lmzoo's MFU against the peak measured in the same round, and (3) greedy decode tokens/s of
`lmzoo.decoding.generate` with and without the KV cache and of HF `generate` (its KV cache; torch with whichever
of 1 or 2 threads is faster) on the same weights (`lmzoo.convert.llama`). Targets are printed as PASS/MISS,
never asserted; the last line is one JSON record of every number.
"""

import dataclasses
import json
import os
import pathlib
import sys

import jax
import numpy as np
import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from lmzoo import config as config_lib  # noqa: E402
from lmzoo import models  # noqa: E402
from lmzoo.convert import llama as llama_convert  # noqa: E402
from lmzoo.objectives import tasks  # noqa: E402

transformers.logging.set_verbosity_error()  # here, so the trainers' own processes get it too

# PASS when the value is >= target: train vs torch, cache vs recompute, lmzoo's cached decode vs HF generate.
TARGETS = {"train_ratio": 1.25, "decode_speedup": 5.0, "decode_vs_hf": 1.0}


@dataclasses.dataclass(frozen=True)
class Spec:
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

    def model_fields(self, max_len: int) -> dict:
        return dict(
            vocab_size=self.vocab_size,
            max_len=max_len,
            emb_dim=self.emb_dim,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            num_layers=self.num_layers,
            mlp_dim=self.mlp_dim,
        )

    def hf_config(self, max_len: int) -> transformers.LlamaConfig:
        """The HF config of the same model, by lmzoo's own exporter."""
        cfg = models.make_config("llama", self.model_fields(max_len))
        return transformers.LlamaConfig(**llama_convert.config_to_hf(cfg))

    def flops_per_token(self) -> float:
        """6 * N_matmul + 12 * L * T * N * H; N_matmul = q, k, v, o, the three SwiGLU kernels and the untied head."""
        d, f, layers = self.emb_dim, self.mlp_dim, self.num_layers
        head_dim = d // self.num_heads
        attn = 2 * d * self.num_heads * head_dim + 2 * d * self.num_kv_heads * head_dim
        n_matmul = layers * (attn + 3 * d * f) + self.vocab_size * d
        return 6 * n_matmul + 12 * layers * self.seq_len * d


MATMUL_BOUND = Spec(
    8192, 256, 4, 2, 4, 704, seq_len=256, batch_size=16, steps_per_round=6, prompt_len=16, new_tokens=256
)
QUICK = Spec(512, 64, 4, 2, 2, 176, seq_len=64, batch_size=4, steps_per_round=3, prompt_len=8, new_tokens=32)


def torch_trainer(spec: Spec, tokens: np.ndarray) -> common.TorchTrainer:
    """HF LlamaForCausalLM (sdpa attention) + torch AdamW as lmzoo trains; loss over the same B*T next tokens."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(spec.hf_config(spec.seq_len), attn_implementation="sdpa")
    # T inputs, loss over the same T next tokens as lmzoo (shift_labels stops HF's internal shift).
    inputs = {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1], "shift_labels": tokens[:, 1:]}
    return common.TorchTrainer(
        model,
        inputs,
        config_lib.base_config().optim,
        decays=lambda name, param: param.ndim == 2 and not name.startswith("model.embed_tokens"),
    )


def lmzoo_trainer(spec: Spec, tokens: np.ndarray) -> common.LmzooTrainer:
    """lmzoo's Llama train step on next-token targets of `tokens` [B, T + 1]."""
    model = models.build_model("llama", spec.model_fields(max_len=spec.seq_len))
    return common.LmzooTrainer(
        tasks.causal_lm_task(model), common.next_token_batch(tokens), config_lib.base_config().optim
    )


def bench_decode(spec: Spec, rounds: int) -> dict:
    """Greedy decode of one prompt: lmzoo with and without the KV cache, and HF generate, on the same weights."""
    max_len = spec.prompt_len + spec.new_tokens
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM._from_config(spec.hf_config(max_len), attn_implementation="sdpa").eval()
    cfg = models.make_config("llama", spec.model_fields(max_len))
    model = models.build_model("llama", cfg)
    state_dict = {k: v.detach().numpy().copy() for k, v in hf_model.state_dict().items()}
    params = jax.device_put(llama_convert.from_hf(state_dict, cfg))
    prompt = np.random.default_rng(1).integers(0, spec.vocab_size, (1, spec.prompt_len), dtype=np.int32)
    torch_prompt = torch.from_numpy(prompt.astype(np.int64))

    def hf_generate(new_tokens: int = spec.new_tokens) -> np.ndarray:
        with torch.no_grad():
            out = hf_model.generate(
                torch_prompt,
                attention_mask=torch.ones_like(torch_prompt),
                do_sample=False,
                max_new_tokens=new_tokens,
                pad_token_id=0,
            )
        return out[:, spec.prompt_len :].numpy()

    hf_threads, _ = common.fastest_torch_threads(lambda: hf_generate(max(spec.new_tokens // 4, 1)))
    modes = {
        "cache": lambda: common.greedy_decode(model, params, prompt, spec.new_tokens, use_cache=True),
        "recompute": lambda: common.greedy_decode(model, params, prompt, spec.new_tokens, use_cache=False),
        "hf": hf_generate,
    }
    outputs = {name: run() for name, run in modes.items()}  # first call: jit compile (lmzoo)

    def measure(r: int) -> dict[str, float]:
        row = common.rates(modes, dict.fromkeys(modes, spec.new_tokens), r)
        row["speedup"] = row["cache"] / row["recompute"]
        row["vs_hf"] = row["cache"] / row["hf"]
        return row

    per_round = common.measure_rounds("decode round", rounds, measure)
    agree = {name: float(np.mean(outputs["cache"] == outputs[name])) for name in ("recompute", "hf")}
    return common.summary(per_round, hf_threads=hf_threads, greedy_tokens_agree=agree)


DECODE_COLUMNS = [
    ("cache tok/s", "cache", "{:.1f}"),
    ("recompute tok/s", "recompute", "{:.1f}"),
    ("HF generate tok/s", "hf", "{:.1f}"),
    ("cache/recompute", "speedup", "{:.2f}"),
    ("cache/HF", "vs_hf", "{:.2f}"),
]


def main():
    parser = common.rounds_parser(__doc__, "tiny config, 1 round (smoke test)")
    args = parser.parse_args()
    spec, rounds = (QUICK, 1) if args.quick else (MATMUL_BOUND, args.rounds)
    load = common.announce("llama", "quick" if args.quick else "matmul-bound", spec, rounds)

    peak = common.print_matmul_peak(sizes=(1024,) if args.quick else (1024, 2048))
    train = common.train_vs_torch(spec, rounds, lmzoo_trainer, torch_trainer)
    decode = bench_decode(spec, rounds)
    load["end"] = os.getloadavg()[0]

    common.print_train_vs_torch(spec, train)
    agree = decode["greedy_tokens_agree"]
    print(
        f"\ndecode: batch 1, prompt {spec.prompt_len}, {spec.new_tokens} new tokens, greedy; HF on "
        f"{decode['hf_threads']} torch thread(s); cache tokens agree with recompute {agree['recompute']:.1%}, "
        f"with HF {agree['hf']:.1%}"
    )
    common.print_table(decode, DECODE_COLUMNS)

    results = {
        "train_ratio": train["median_ratio"],
        "decode_speedup": decode["median_speedup"],
        "decode_vs_hf": decode["median_vs_hf"],
    }
    print(f"\nload average (1 min) at start {load['start']:.2f}, at end {load['end']:.2f}")
    print("targets (medians):")
    targets = common.report_targets(results, TARGETS)
    record = {
        "bench": "llama",
        "config": "quick" if args.quick else "matmul-bound",
        "spec": dataclasses.asdict(spec),
        "matmul_peak_gflops": {str(n): g for n, g in peak.items()},
        "train": train,
        "decode": decode,
        "load_average": load,
        "targets": targets,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
