"""Fine-tuning benchmark: lmzoo's full fine-tuning step against its LoRA step (float32 and bfloat16 base) on
bench/llama_bench.py's shape, and with `--trl` the LoRA step against trl's SFTTrainer + peft on the same model,
adapters and token batch, in the same run, with PASS/MISS against the target lmzoo LoRA >= 1.5x trl + peft (tokens/s).

    python bench/finetune_bench.py [--rounds 3] [--quick]                     # lmzoo: full vs LoRA
    venv-trl/bin/python bench/finetune_bench.py --trl [--rounds 3] [--quick]   # + trl + peft (bench/ppo_bench.py: venv)

`--quick` is llama_bench's tiny shape and 1 round (a smoke run, under a minute). Random weights, nothing is read.

lmzoo: the step `lmzoo.train.loop` runs (`common.LmzooTrainer`): `causal_lm_task` of the Llama, AdamW over every
parameter (full), or through `lmzoo.lora.lora_task`, what a run with `config.lora.targets` set trains: rank-r
adapters on query, key, value, out, wi_0, wi_1 and wo of every layer over the frozen base (`base_dtype` None, then
"bfloat16"), AdamW over the adapters alone. Timed in the trainer's process around `steps_per_round` steps, which end
in fetching the loss (the step has finished).
trl + peft: `trl.SFTTrainer` on an HF LlamaForCausalLM (sdpa) of the same config, with a `peft.LoraConfig` of the
same rank, alpha and the same seven projections (q/k/v/o_proj, gate/up/down_proj: lmzoo's converter names them), the
same [B, T] inputs as a tokenized dataset (HF shifts them itself, so its loss covers T - 1 of each row's T tokens),
AdamW with lmzoo's hyper-parameters, no activation checkpointing (trl's default is on; lmzoo does not recompute) and
float32 (`common.TRL_ON_CPU`). Each round builds a fresh trainer and runs steps_per_round + 1 steps, on 1 and then on
2 torch threads (in turn first), and keeps the faster: torch's 2 OpenMP threads slow down many-fold when other
processes take a core, even for a moment, and XLA's threads do not (a choice made once, as
`common.fastest_torch_threads` makes it for decoding, is undone by the next job that starts). The seconds per step
come from the trainer's callbacks (on_step_begin to on_step_end), the first step (warm-up) dropped, as
bench/preference_bench.py does.

Every trainer runs in a process of its own (`common.Isolated`), in interleaved rounds (`common.round_order`), the
matmul peak measured in each round. Memory is each process's peak RSS (`ru_maxrss`: its whole life, compilation
included) and, as the part the training adds, that peak less the RSS after the framework's imports (before the model
is built); for lmzoo also XLA's own account of the compiled step's buffers (arguments + outputs + temporaries, less
what the donated state aliases), the memory an accelerator would hold. The last line is one JSON record.
"""

import dataclasses
import json
import os
import pathlib
import re
import resource
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from lmzoo import config as config_lib  # noqa: E402
from lmzoo import models  # noqa: E402
from lmzoo.lora import peft as peft_convert  # noqa: E402
from lmzoo.models import lora  # noqa: E402
from lmzoo.objectives import tasks  # noqa: E402

TARGETS = "query|key|value|out|wi_0|wi_1|wo"  # every attention and feed-forward kernel of each layer
LORA_BASES = {"lora": None, "lora_bf16": "bfloat16"}  # variant -> LoraConfig.base_dtype
# PASS when the value is >= target: lmzoo's LoRA step (float32 base) against trl + peft, tokens/s.
TARGET = {"lora_vs_trl": 1.5}


def rss_bytes() -> int:
    """The process's resident set now (VmRSS)."""
    status = pathlib.Path("/proc/self/status").read_text()
    return 1024 * int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))


def peak_rss_bytes() -> int:
    """The process's peak resident set over its life (Linux reports ru_maxrss in KiB)."""
    return 1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class Measured:
    """A trainer in its own process (`common.Isolated`): `train(steps)` runs the steps and returns {"step_s": seconds
    per step, "loss", ...}; `run(steps)` adds the process's peak RSS so far, its RSS after imports and `fixed`."""

    def __init__(self, train: Callable[[int], dict], imports_rss: int, **fixed):
        self.train, self.imports_rss, self.fixed = train, imports_rss, fixed
        self.loss = None

    def run(self, steps: int) -> dict:
        result = self.train(steps)
        self.loss = result.pop("loss")
        return {**result, **self.fixed, "peak_rss": peak_rss_bytes(), "imports_rss": self.imports_rss}


def lmzoo_trainer(model_fields: dict, tokens: np.ndarray, lora_config: lora.LoraConfig | None) -> Measured:
    """lmzoo's Llama train step on next-token targets of `tokens` [B, T + 1]: every parameter trained, or adapters of
    `lora_config` over the frozen base (`lmzoo.lora.lora_task`, as `objectives.base` wraps a run's task)."""
    imports_rss = rss_bytes()
    task = tasks.causal_lm_task(models.build_model("llama", model_fields))
    if lora_config is not None:
        task = lora.lora_task(task, lora_config)
    trainer = common.LmzooTrainer(task, common.next_token_batch(tokens), config_lib.base_config().optim)
    memory = trainer.compiled.step.lower(trainer.state, trainer.batch).compile().memory_analysis()
    step_bytes = (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
    )

    def train(steps: int) -> dict:
        return {"step_s": common.timed(lambda: trainer.run(steps)) / steps, "loss": trainer.loss}

    trained = sum(leaf.size for leaf in jax.tree.leaves(trainer.state.params))
    return Measured(train, imports_rss, trained=trained, step_bytes=step_bytes)


def trl_trainer(hf_config, tokens: np.ndarray, rank: int, alpha: float, hf_targets: list[str]) -> Measured:
    """trl's SFTTrainer with a peft LoraConfig (rank, alpha, `hf_targets`) on an HF LlamaForCausalLM of `hf_config`,
    on the inputs lmzoo trains on, `tokens[:, :-1]` [B, T], every step the same batch. Each `run(steps)` trains a
    fresh trainer on a fresh model (trl wraps it with peft) for steps + 1 steps, dropping the first, on 1 and on 2
    torch threads, and reports the faster."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    imports_rss = rss_bytes()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")  # peft asks it each build
    datasets.disable_progress_bars()
    optim = config_lib.base_config().optim
    batch_size, seq_len = tokens[:, :-1].shape
    rows = tokens[:, :-1].tolist()
    tokenizer = common.hf_byte_tokenizer()  # trl pads with its pad id; every row is T long, so nothing is padded
    workdir = tempfile.mkdtemp(prefix="trl_sft_")

    class StepTimes(transformers.TrainerCallback):
        def __init__(self):
            self.begins, self.ends = [], []

        def on_step_begin(self, *args, **kwargs):
            self.begins.append(time.perf_counter())

        def on_step_end(self, *args, **kwargs):
            self.ends.append(time.perf_counter())

    def train(steps: int) -> dict:
        torch.manual_seed(0)
        args = trl.SFTConfig(
            output_dir=workdir,
            **common.TRL_ON_CPU,
            activation_checkpointing=False,
            disable_tqdm=True,
            per_device_train_batch_size=batch_size,
            max_length=seq_len,
            max_steps=steps + 1,
            learning_rate=optim.learning_rate,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.b1,
            adam_beta2=optim.b2,
            adam_epsilon=optim.eps,
            max_grad_norm=optim.grad_clip,
            seed=0,
            dataloader_num_workers=0,
        )
        trainer = trl.SFTTrainer(
            model=transformers.LlamaForCausalLM._from_config(hf_config, attn_implementation="sdpa"),
            args=args,
            processing_class=tokenizer,
            train_dataset=datasets.Dataset.from_dict({"input_ids": rows * (steps + 1)}),
            peft_config=peft.LoraConfig(
                r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=hf_targets, task_type="CAUSAL_LM"
            ),
        )
        trainer.remove_callback(transformers.PrinterCallback)  # it would print the run's summary
        times = StepTimes()
        trainer.add_callback(times)
        loss = trainer.train().training_loss
        seconds = [end - begin for begin, end in zip(times.begins, times.ends, strict=True)][1:]
        return {
            "step_s": float(np.mean(seconds)),
            "loss": loss,
            "trained": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        }

    calls = []  # the thread orders so far

    def train_on_faster_threads(steps: int) -> dict:
        """`train(steps)` on 1 and on 2 torch threads (in turn first): the faster's, with the seconds of both."""
        order = (1, 2) if len(calls) % 2 == 0 else (2, 1)
        calls.append(order)
        runs = {}
        for threads in order:
            torch.set_num_threads(threads)
            runs[threads] = train(steps)
        faster = min(runs, key=lambda threads: runs[threads]["step_s"])
        return {**runs[faster], "torch_threads": faster, "step_s_by_threads": {n: r["step_s"] for n, r in runs.items()}}

    return Measured(train_on_faster_threads, imports_rss)


def hf_target_modules(model_fields: dict) -> list[str]:
    """peft's target_modules for TARGETS: the HF names of the adapted linears, from lmzoo's converter table."""
    linears = peft_convert.linears("llama", model_fields)
    return sorted(
        {linear.key.rsplit(".", 1)[-1] for path, linear in linears.items() if re.fullmatch(TARGETS, path[-1])}
    )


def round_columns(names: list[str]) -> list[tuple[str, str, str]]:
    columns = [(f"{name} tok/s", name, "{:.0f}") for name in names]
    columns += [("lora/full", "lora_vs_full", "{:.3f}"), ("bf16/f32 base", "bf16_vs_f32", "{:.3f}")]
    if "trl" in names:
        columns += [("lora/trl", "lora_vs_trl", "{:.3f}"), ("torch threads", "trl_threads", "{:.0f}")]
    return columns + [("peak GFLOP/s", "peak_gflops", "{:.1f}")]


def print_variants(result: dict, memory: dict[str, dict], tokens_per_step: int) -> None:
    """One line per trainer: median ms/step and tokens/s, trained parameters, peak RSS and XLA's step buffers."""
    print(
        f"{'variant':>10} {'ms/step':>9} {'tokens/s':>9} {'trained':>10} {'peak RSS':>9} "
        f"{'- imports':>9} {'XLA step':>9}"
    )
    for name, report in memory.items():
        rate = result[f"median_{name}"]
        step = "-" if report.get("step_bytes") is None else f"{report['step_bytes'] / 2**20:.0f} MiB"
        print(
            f"{name:>10} {1e3 * tokens_per_step / rate:>9.1f} {rate:>9.0f} {report['trained']:>10,} "
            f"{report['peak_rss'] / 2**20:>5.0f} MiB {(report['peak_rss'] - report['imports_rss']) / 2**20:>5.0f} MiB "
            f"{step:>9}"
        )


def main():
    parser = common.rounds_parser(__doc__, "llama_bench's tiny shape, 1 round (smoke test)")
    parser.add_argument("--trl", action="store_true", help="also time trl's SFTTrainer + peft (run in venv-trl)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank r (lmzoo's config.lora default)")
    parser.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scale alpha / r)")
    args = parser.parse_args()
    # Imported here, not at the top: each trainer's process imports this module again, and lmzoo's processes must
    # not load torch (llama_bench imports it), which would add to their RSS.
    from bench import llama_bench

    spec, rounds = (llama_bench.QUICK, 1) if args.quick else (llama_bench.MATMUL_BOUND, args.rounds)
    load = common.announce("finetune", "quick" if args.quick else "llama_bench shape", spec, rounds)
    peak = common.print_matmul_peak(sizes=(1024,) if args.quick else (1024, 2048))

    model_fields = spec.model_fields(max_len=spec.seq_len)
    tokens = np.random.default_rng(0).integers(0, spec.vocab_size, (spec.batch_size, spec.seq_len + 1), np.int32)
    trainers = {"full": common.Isolated(lmzoo_trainer, model_fields, tokens, None)}
    for name, base_dtype in LORA_BASES.items():
        adapted = lora.LoraConfig(TARGETS, rank=args.rank, alpha=args.alpha, base_dtype=base_dtype)
        trainers[name] = common.Isolated(lmzoo_trainer, model_fields, tokens, adapted)
    hf_targets = hf_target_modules(model_fields)
    if args.trl:
        hf_config = spec.hf_config(spec.seq_len)
        trainers["trl"] = common.Isolated(trl_trainer, hf_config, tokens, args.rank, args.alpha, hf_targets)
    tokens_per_step = spec.batch_size * spec.seq_len
    memory = {}  # name -> the last run's report

    def measure(r: int) -> dict[str, float]:
        row = {}
        for name in common.round_order(list(trainers), r):
            memory[name] = trainers[name].run(spec.steps_per_round)
            row[name] = tokens_per_step / memory[name]["step_s"]
        if args.trl:
            row["trl_threads"] = memory["trl"]["torch_threads"]
        row["lora_vs_full"] = row["lora"] / row["full"]
        row["bf16_vs_f32"] = row["lora_bf16"] / row["lora"]
        if args.trl:
            row["lora_vs_trl"] = row["lora"] / row["trl"]
        row["peak_gflops"] = max(common.matmul_peak(repeats=3).values())
        return row

    result = common.trainer_rounds(trainers, "round", rounds, measure, tokens_per_step=tokens_per_step)
    load["end"] = os.getloadavg()[0]
    memory = {name: memory[name] for name in trainers}

    versions = ""
    if args.trl:
        import peft
        import trl

        versions = f"; trl {trl.__version__}, peft {peft.__version__}, torch on the faster of 1 or 2 threads each round"
    compile_s, loss = result["compile_s"], result["loss_after_warmup"]
    print(
        f"\nB={spec.batch_size} T={spec.seq_len} ({tokens_per_step} tokens/step), {spec.steps_per_round} steps/round; "
        f"LoRA r {args.rank}, alpha {args.alpha:g} on {TARGETS} (HF {', '.join(hf_targets)}){versions}"
    )
    print("first call s: " + ", ".join(f"{name} {s:.1f}" for name, s in compile_s.items()))
    print("loss after warm-up: " + ", ".join(f"{name} {value:.3f}" for name, value in loss.items()))
    common.print_table(result, round_columns(list(trainers)))
    print("\nmedians; peak RSS: the process's, its whole life; '- imports': less its RSS after the imports")
    print_variants(result, memory, tokens_per_step)
    print(f"\nload average (1 min) at start {load['start']:.2f}, at end {load['end']:.2f}")
    targets = {}
    if args.trl:
        print("target (median):")
        targets = common.report_targets({"lora_vs_trl": result["median_lora_vs_trl"]}, TARGET)
    record = {
        "bench": "finetune",
        "config": "quick" if args.quick else "llama_bench shape",
        "spec": dataclasses.asdict(spec),
        "lora": {"targets": TARGETS, "hf_targets": hf_targets, "rank": args.rank, "alpha": args.alpha},
        "matmul_peak_gflops": {str(n): g for n, g in peak.items()},
        "train": result,
        "memory": memory,
        "load_average": load,
        "targets": targets,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
