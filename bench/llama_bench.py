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

import argparse
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
from bench.gpt2_bench import print_table, verdict  # noqa: E402
from lmzoo import config as config_lib  # noqa: E402
from lmzoo import decoding, models  # noqa: E402
from lmzoo.convert import llama as llama_convert  # noqa: E402
from lmzoo.objectives import causal_lm  # noqa: E402

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
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones(tokens[:, 1:].shape, np.float32)}
    batch = {k: np.ascontiguousarray(v) for k, v in batch.items()}
    return common.LmzooTrainer(causal_lm.causal_lm_task(model), batch, config_lib.base_config().optim)


def bench_train(spec: Spec, rounds: int) -> dict:
    tokens = np.random.default_rng(0).integers(0, spec.vocab_size, (spec.batch_size, spec.seq_len + 1), dtype=np.int32)
    tokens_per_step = spec.batch_size * spec.seq_len
    trainers = {
        "lmzoo": common.Isolated(lmzoo_trainer, spec, tokens),
        "torch": common.Isolated(torch_trainer, spec, tokens),
    }
    compile_s = {name: common.timed(lambda t=t: t.run(1)) for name, t in trainers.items()}
    for trainer in trainers.values():
        trainer.run(1)
    initial_loss = {name: t.loss for name, t in trainers.items()}
    per_round = []
    for r in range(rounds):
        order = list(trainers) if r % 2 == 0 else list(trainers)[::-1]
        row = {}
        for name in order:
            seconds = common.timed(lambda t=trainers[name]: t.run(spec.steps_per_round))
            row[name] = tokens_per_step * spec.steps_per_round / seconds
        row["peak_gflops"] = max(common.matmul_peak(repeats=3).values())
        row["ratio"] = row["lmzoo"] / row["torch"]
        row["mfu"] = spec.flops_per_token() * row["lmzoo"] / (row["peak_gflops"] * 1e9)
        row["torch_mfu"] = spec.flops_per_token() * row["torch"] / (row["peak_gflops"] * 1e9)
        per_round.append(row)
        print(f"  train round {r + 1}/{rounds}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    for trainer in trainers.values():
        trainer.close()
    return {
        "rounds": per_round,
        "compile_s": compile_s,
        "loss_after_warmup": initial_loss,
        "flops_per_token": spec.flops_per_token(),
        **{f"median_{k}": common.median(row[k] for row in per_round) for k in per_round[0]},
    }


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

    def decode(use_cache: bool) -> np.ndarray:
        return np.asarray(
            decoding.generate(
                model,
                params,
                prompt,
                rng=jax.random.key(0),
                max_new_tokens=spec.new_tokens,
                temperature=0.0,
                use_cache=use_cache,
            )
        )

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

    # Decoding runs many small ops, which torch's 2 OpenMP threads can slow down many-fold when other processes
    # hold the cores: HF decodes with whichever of 1 or 2 threads is faster on a short greedy probe.
    probe_tokens, probe_s = max(spec.new_tokens // 4, 1), {}
    hf_generate(probe_tokens)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        probe_s[threads] = common.timed(lambda: hf_generate(probe_tokens))
    hf_threads = min(probe_s, key=probe_s.get)
    torch.set_num_threads(hf_threads)

    modes = {"cache": lambda: decode(True), "recompute": lambda: decode(False), "hf": hf_generate}
    outputs = {name: run() for name, run in modes.items()}  # first call: jit compile (lmzoo)
    per_round = []
    for r in range(rounds):
        order = list(modes) if r % 2 == 0 else list(modes)[::-1]
        row = {name: spec.new_tokens / common.timed(modes[name]) for name in order}
        row["speedup"] = row["cache"] / row["recompute"]
        row["vs_hf"] = row["cache"] / row["hf"]
        per_round.append(row)
        print(f"  decode round {r + 1}/{rounds}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    return {
        "rounds": per_round,
        "hf_threads": hf_threads,
        "greedy_tokens_agree": {
            name: float(np.mean(outputs["cache"] == outputs[name])) for name in ("recompute", "hf")
        },
        **{f"median_{k}": common.median(row[k] for row in per_round) for k in per_round[0]},
    }


TRAIN_COLUMNS = [
    ("lmzoo tok/s", "lmzoo", "{:.0f}"),
    ("torch tok/s", "torch", "{:.0f}"),
    ("lmzoo/torch", "ratio", "{:.3f}"),
    ("peak GFLOP/s", "peak_gflops", "{:.1f}"),
    ("lmzoo MFU", "mfu", "{:.1%}"),
    ("torch MFU", "torch_mfu", "{:.1%}"),
]
DECODE_COLUMNS = [
    ("cache tok/s", "cache", "{:.1f}"),
    ("recompute tok/s", "recompute", "{:.1f}"),
    ("HF generate tok/s", "hf", "{:.1f}"),
    ("cache/recompute", "speedup", "{:.2f}"),
    ("cache/HF", "vs_hf", "{:.2f}"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny config, 1 round (smoke test)")
    args = parser.parse_args()
    spec, rounds = (QUICK, 1) if args.quick else (MATMUL_BOUND, args.rounds)
    load = common.announce("llama", "quick" if args.quick else "matmul-bound", spec, rounds)

    peak = common.matmul_peak(sizes=(1024,) if args.quick else (1024, 2048))
    print("matmul peak (f32, best of 5): " + ", ".join(f"{n}: {g:.1f} GFLOP/s" for n, g in peak.items()), flush=True)
    train = bench_train(spec, rounds)
    decode = bench_decode(spec, rounds)
    load["end"] = os.getloadavg()[0]

    compile_s, loss = train["compile_s"], train["loss_after_warmup"]
    print(
        f"\ntrain: B={spec.batch_size} T={spec.seq_len} ({spec.batch_size * spec.seq_len} tokens/step), "
        f"{spec.steps_per_round} steps/round, {train['flops_per_token'] / 1e6:.1f} MFLOP/token; "
        f"compile+1st step s: lmzoo {compile_s['lmzoo']:.1f}, torch {compile_s['torch']:.1f}; "
        f"loss after warm-up: lmzoo {loss['lmzoo']:.3f}, torch {loss['torch']:.3f}"
    )
    print_table(train, TRAIN_COLUMNS)
    agree = decode["greedy_tokens_agree"]
    print(
        f"\ndecode: batch 1, prompt {spec.prompt_len}, {spec.new_tokens} new tokens, greedy; HF on "
        f"{decode['hf_threads']} torch thread(s); cache tokens agree with recompute {agree['recompute']:.1%}, "
        f"with HF {agree['hf']:.1%}"
    )
    print_table(decode, DECODE_COLUMNS)

    results = {
        "train_ratio": train["median_ratio"],
        "decode_speedup": decode["median_speedup"],
        "decode_vs_hf": decode["median_vs_hf"],
    }
    print(f"\nload average (1 min) at start {load['start']:.2f}, at end {load['end']:.2f}")
    print("targets (medians):")
    for name, target in TARGETS.items():
        print(f"  {name:<19} {results[name]:>8.3f}  target >= {target:<5}  {verdict(results[name], target)}")
    record = {
        "bench": "llama",
        "config": "quick" if args.quick else "matmul-bound",
        "spec": dataclasses.asdict(spec),
        "matmul_peak_gflops": {str(n): g for n, g in peak.items()},
        "train": train,
        "decode": decode,
        "load_average": load,
        "targets": {
            name: {"value": results[name], "target": t, "pass": results[name] >= t} for name, t in TARGETS.items()
        },
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
