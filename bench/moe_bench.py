"""Mixture-of-experts benchmark: lmzoo's production train step of an MoE Llama, dropless and capacity forms, against
HF MixtralForCausalLM + torch AdamW of the same shape on the CPU.

    python bench/moe_bench.py [--rounds 3] [--steps 4]
    python bench/moe_bench.py --tiny          # smoke mode: a tiny model, 1 round of 2 steps

The model: 4 layers, D 256, 4 query / 2 kv heads, 8 SwiGLU experts of F 512 with Mixtral's top-2 renormalised
router, vocabulary 8,192, context 256, batch 16, float32. HF computes its load-balancing loss
(`output_router_logits`, coefficient 0.01) and lmzoo its own (the same coefficient, the z-loss off), so both steps do
the same work. Each trainer runs in a process of its own (`common.Isolated`), in interleaved rounds (the order rotates
each round); train tokens/s, lmzoo/torch (target >= 1.25x, as the dense benches) and dropless/capacity are printed
with PASS/MISS, never asserted, with the CPU model and the load average; the last line is one JSON record of every
number.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import sys

import numpy as np
import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from lmzoo import config as config_lib  # noqa: E402
from lmzoo import models  # noqa: E402
from lmzoo.objectives import tasks  # noqa: E402

transformers.logging.set_verbosity_error()

TARGETS = {"dropless_vs_torch": 1.25}
LOAD_BALANCE_COEF = 0.01


@dataclasses.dataclass(frozen=True)
class Spec:
    vocab_size: int
    emb_dim: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    num_experts: int
    experts_per_token: int
    expert_mlp_dim: int
    seq_len: int
    batch_size: int
    steps_per_round: int

    def model_fields(self, form: str) -> dict:
        return dict(
            vocab_size=self.vocab_size,
            max_len=self.seq_len,
            emb_dim=self.emb_dim,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            num_layers=self.num_layers,
            mlp_dim=self.expert_mlp_dim,
            num_experts=self.num_experts,
            experts_per_token=self.experts_per_token,
            moe_form=form,
            router_z_loss_coef=0.0,
            load_balance_coef=LOAD_BALANCE_COEF,
        )

    def hf_config(self) -> transformers.MixtralConfig:
        return transformers.MixtralConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.emb_dim,
            intermediate_size=self.expert_mlp_dim,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            num_local_experts=self.num_experts,
            num_experts_per_tok=self.experts_per_token,
            max_position_embeddings=self.seq_len,
            sliding_window=None,
            tie_word_embeddings=False,
            output_router_logits=True,
            router_aux_loss_coef=LOAD_BALANCE_COEF,
        )


FULL = Spec(8192, 256, 4, 2, 4, 8, 2, 512, seq_len=256, batch_size=16, steps_per_round=4)
TINY = Spec(512, 64, 4, 2, 2, 4, 2, 128, seq_len=32, batch_size=4, steps_per_round=2)


def lmzoo_trainer(spec: Spec, tokens: np.ndarray, form: str) -> common.LmzooTrainer:
    """lmzoo's Llama train step, MoE form `form`, on next-token targets of `tokens` [B, T + 1]."""
    model = models.build_model("llama", spec.model_fields(form))
    return common.LmzooTrainer(
        tasks.causal_lm_task(model), common.next_token_batch(tokens), config_lib.base_config().optim
    )


def torch_trainer(spec: Spec, tokens: np.ndarray) -> common.TorchTrainer:
    """HF MixtralForCausalLM (sdpa attention) + torch AdamW as lmzoo trains; loss over the same B*T next tokens."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM._from_config(spec.hf_config(), attn_implementation="sdpa")
    inputs = {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1], "shift_labels": tokens[:, 1:]}
    return common.TorchTrainer(
        model,
        inputs,
        config_lib.base_config().optim,
        decays=lambda name, param: param.ndim >= 2 and not name.startswith("model.embed_tokens"),
    )


COLUMNS = [
    ("dropless tok/s", "dropless", "{:.0f}"),
    ("capacity tok/s", "capacity", "{:.0f}"),
    ("torch tok/s", "torch", "{:.0f}"),
    ("dropless/torch", "dropless_vs_torch", "{:.3f}"),
    ("capacity/torch", "capacity_vs_torch", "{:.3f}"),
    ("dropless/capacity", "dropless_vs_capacity", "{:.3f}"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="train steps per round and trainer")
    parser.add_argument("--tiny", action="store_true", help="tiny model, 1 round (smoke test)")
    args = parser.parse_args()
    spec, rounds = (TINY, 1) if args.tiny else (FULL, args.rounds)
    if args.steps:
        spec = dataclasses.replace(spec, steps_per_round=args.steps)
    load = common.announce("moe", "tiny" if args.tiny else "full", spec, rounds)

    tokens = np.random.default_rng(0).integers(0, spec.vocab_size, (spec.batch_size, spec.seq_len + 1), dtype=np.int32)
    trainers = {
        "dropless": common.Isolated(lmzoo_trainer, spec, tokens, "dropless"),
        "capacity": common.Isolated(lmzoo_trainer, spec, tokens, "capacity"),
        "torch": common.Isolated(torch_trainer, spec, tokens),
    }
    tokens_per_step = spec.batch_size * spec.seq_len

    def measure(r: int) -> dict[str, float]:
        row = common.train_rates(
            trainers, dict.fromkeys(trainers, spec.steps_per_round), dict.fromkeys(trainers, tokens_per_step), r
        )
        row["dropless_vs_torch"] = row["dropless"] / row["torch"]
        row["capacity_vs_torch"] = row["capacity"] / row["torch"]
        row["dropless_vs_capacity"] = row["dropless"] / row["capacity"]
        return row

    train = common.trainer_rounds(trainers, "train round", rounds, measure)
    compile_s, loss = train["compile_s"], train["loss_after_warmup"]
    load["end"] = os.getloadavg()[0]

    print(
        f"\ntrain: B={spec.batch_size} T={spec.seq_len} ({tokens_per_step} tokens/step), {spec.steps_per_round} "
        f"steps/round; compile+1st step s: "
        + ", ".join(f"{name} {s:.1f}" for name, s in compile_s.items())
        + "; loss after warm-up: "
        + ", ".join(f"{name} {value:.3f}" for name, value in loss.items())
    )
    common.print_table(train, COLUMNS)
    print(f"\nload average (1 min) at start {load['start']:.2f}, at end {load['end']:.2f}")
    print("targets (medians):")
    targets = common.report_targets({"dropless_vs_torch": train["median_dropless_vs_torch"]}, TARGETS)
    cpu_model, isa = common.cpu_model_and_isa()
    record = {
        "bench": "moe",
        "config": "tiny" if args.tiny else "full",
        "spec": dataclasses.asdict(spec),
        "cpu": cpu_model,
        "isa": isa,
        "train": train,
        "load_average": load,
        "targets": targets,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
