"""GPT-2 benchmark: lmzoo's production train step vs HuggingFace GPT-2 + torch AdamW, MFU, KV-cache decode.

    python bench/gpt2_bench.py [--rounds 3] [--quick] [--torch_kept_buffers]

Measures (1) the f32 matmul peak, (2) train tokens/s of the same model in lmzoo (the step that
`lmzoo.train.loop` jits: same step builder, shardings and donation) and in torch eager, each in a
process of its own as train.py and a torch script run (`common.Isolated`), in interleaved rounds
because the machine's speed drifts, (3) lmzoo's MFU against the peak measured
in the same round and (4) greedy decode tokens/s with and without the KV cache. Targets are
printed as PASS/MISS, never asserted; the last line is one JSON record of every number.
--torch_kept_buffers gives torch's process lmzoo's malloc setting (`host_memory`), which torch users do
not have: it measures how much of the difference is the allocator.
"""

import dataclasses
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from lmzoo import config as config_lib  # noqa: E402
from lmzoo import models  # noqa: E402
from lmzoo.kernels import host_memory  # noqa: E402
from lmzoo.objectives import tasks  # noqa: E402

transformers.logging.set_verbosity_error()  # here, so the trainers' own processes get it too

TARGETS = {"train_ratio": 1.25, "mfu_minus_torch_mfu": 0.0, "decode_speedup": 5.0}  # PASS when the value is >= target


@dataclasses.dataclass(frozen=True)
class Spec:
    vocab_size: int
    emb_dim: int
    num_heads: int
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
            num_layers=self.num_layers,
            mlp_dim=self.mlp_dim,
            dropout_rate=0.0,
            attention_dropout_rate=0.0,
        )

    def flops_per_token(self) -> float:
        """6 * N_matmul + 12 * L * T * D, N_matmul = block kernels + the tied head (V * D)."""
        d, f, layers = self.emb_dim, self.mlp_dim, self.num_layers
        n_matmul = layers * (4 * d * d + 2 * d * f) + self.vocab_size * d
        return 6 * n_matmul + 12 * layers * self.seq_len * d


MATMUL_BOUND = Spec(8192, 256, 4, 4, 1024, seq_len=256, batch_size=16, steps_per_round=6, prompt_len=16, new_tokens=256)
QUICK = Spec(512, 64, 2, 2, 256, seq_len=64, batch_size=4, steps_per_round=3, prompt_len=8, new_tokens=32)


def torch_trainer(spec: Spec, tokens: np.ndarray) -> common.TorchTrainer:
    """HF GPT2LMHeadModel (sdpa attention) + torch AdamW as lmzoo trains; loss over the same B*T next tokens."""
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(
        vocab_size=spec.vocab_size,
        n_positions=spec.seq_len,
        n_embd=spec.emb_dim,
        n_layer=spec.num_layers,
        n_head=spec.num_heads,
        n_inner=spec.mlp_dim,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.GPT2LMHeadModel._from_config(hf_config, attn_implementation="sdpa")
    # T inputs, loss over the same T next tokens as lmzoo (shift_labels stops HF's internal shift).
    inputs = {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1], "shift_labels": tokens[:, 1:]}
    return common.TorchTrainer(
        model,
        inputs,
        config_lib.base_config().optim,
        decays=lambda name, param: param.ndim == 2 and not name.startswith(("transformer.wte", "transformer.wpe")),
    )


def lmzoo_trainer(spec: Spec, tokens: np.ndarray) -> common.LmzooTrainer:
    """lmzoo's GPT-2 train step on next-token targets of `tokens` [B, T + 1]."""
    model = models.build_model("gpt2", spec.model_fields(max_len=spec.seq_len))
    return common.LmzooTrainer(
        tasks.causal_lm_task(model), common.next_token_batch(tokens), config_lib.base_config().optim
    )


def torch_trainer_kept_buffers(spec: Spec, tokens: np.ndarray) -> common.TorchTrainer:
    """`torch_trainer` in a process given lmzoo's malloc setting (mmap off, heaps padded by 1 GB): not what a
    torch user runs, but it shows how much of lmzoo's lead is the allocator."""
    host_memory.keep_freed_buffers_mapped(1 << 30)
    return torch_trainer(spec, tokens)


def bench_decode(spec: Spec, rounds: int) -> dict:
    model = models.build_model("gpt2", spec.model_fields(max_len=spec.prompt_len + spec.new_tokens))
    prompt = np.random.default_rng(1).integers(0, spec.vocab_size, (1, spec.prompt_len), dtype=np.int32)
    params = jax.jit(model.init)(jax.random.key(0), jnp.asarray(prompt))["params"]

    modes = {
        "cache": lambda: common.greedy_decode(model, params, prompt, spec.new_tokens, use_cache=True),
        "recompute": lambda: common.greedy_decode(model, params, prompt, spec.new_tokens, use_cache=False),
    }
    outputs = {name: run() for name, run in modes.items()}

    def measure(r: int) -> dict[str, float]:
        row = common.rates(modes, dict.fromkeys(modes, spec.new_tokens), r)
        row["speedup"] = row["cache"] / row["recompute"]
        return row

    per_round = common.measure_rounds("decode round", rounds, measure)
    return common.summary(per_round, greedy_tokens_agree=float(np.mean(outputs["cache"] == outputs["recompute"])))


DECODE_COLUMNS = [
    ("cache tok/s", "cache", "{:.1f}"),
    ("recompute tok/s", "recompute", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}"),
]


def main():
    parser = common.rounds_parser(__doc__, "tiny config, 1 round (smoke test)")
    parser.add_argument("--torch_kept_buffers", action="store_true", help="torch's process gets lmzoo's malloc setting")
    args = parser.parse_args()
    spec, rounds = (QUICK, 1) if args.quick else (MATMUL_BOUND, args.rounds)
    load = common.announce("gpt2", "quick" if args.quick else "matmul-bound", spec, rounds)

    peak = common.print_matmul_peak(sizes=(1024,) if args.quick else (1024, 2048))
    reference = torch_trainer_kept_buffers if args.torch_kept_buffers else torch_trainer
    train = common.train_vs_torch(spec, rounds, lmzoo_trainer, reference)
    decode = bench_decode(spec, rounds)
    load["end"] = os.getloadavg()[0]

    common.print_train_vs_torch(spec, train)
    print(
        f"\ndecode: batch 1, prompt {spec.prompt_len}, {spec.new_tokens} new tokens, greedy; "
        f"cache/recompute tokens agree: {decode['greedy_tokens_agree']:.1%}"
    )
    common.print_table(decode, DECODE_COLUMNS)

    results = {
        "train_ratio": train["median_ratio"],
        "mfu_minus_torch_mfu": train["median_mfu"] - train["median_torch_mfu"],
        "decode_speedup": decode["median_speedup"],
    }
    print(f"\nload average (1 min) at start {load['start']:.2f}, at end {load['end']:.2f}")
    caveat = " torch ran with lmzoo's malloc setting, not as the reference" if args.torch_kept_buffers else ""
    print("targets (medians):" + caveat)
    targets = common.report_targets(results, TARGETS)
    record = {
        "bench": "gpt2",
        "config": "quick" if args.quick else "matmul-bound",
        "torch_kept_buffers": args.torch_kept_buffers,
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
