"""A DPO step and a GRPO iteration of lmzoo against trl's DPOTrainer and GRPOTrainer, on the same shapes in the same
run, with PASS/MISS against issue 51's target: lmzoo >= 1.5x trl (trl's time over lmzoo's, medians).

    PYTHONPATH=$PWD python bench/preference_bench.py                              # lmzoo only
    PYTHONPATH=$PWD venv-trl/bin/python bench/preference_bench.py --trl     # + trl (its venv: see bench/ppo_bench.py)

DPO: configs/hh_dpo.py's step, 16 pairs x 2 replies of 256 tokens (a 128-byte prompt, a 127-byte reply and EOS),
as it runs by default (both rows whole) and with objective.max_prompt_len=128 (each prompt run once for its replies),
the policy's forward and backward and the frozen reference's forward, AdamW, on the GPT-2 of 4 layers x 128 of the
alignment configs. trl's DPOTrainer gets the same model config, batch and strings (it appends the EOS itself), the
reference's log-probs computed in each step as lmzoo does (`precompute_ref_log_probs=False`).
GRPO: configs/hh_ppo.py:grpo's iteration, 8 prompts x 4 samples of 64 + 32 tokens, one update, split into the phases
of `bench/ppo_bench.py` (whose lmzoo and trl timings this reuses), against trl's GRPOTrainer on the same shapes.

Random weights (nothing is read). lmzoo's DPO step runs as train.py runs it (`DpoStep`: compiled ahead, the state
donated, the step's temporaries kept mapped, in a process set up as train.py's), each step timed with
`block_until_ready` after two warm-up steps; trl's per step from its trainer callbacks, the first step (warm-up)
dropped, in this process, with the C library's default malloc as its users run it. torch uses every core, as XLA does.
The GRPO phases are jitted and timed here (`common.interleaved_ms`), with default malloc settings too.
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402
import ppo_bench  # noqa: E402

from lmzoo import config as config_lib  # noqa: E402
from lmzoo import kernels, objectives, sharding  # noqa: E402
from lmzoo.kernels import host_memory  # noqa: E402
from lmzoo.train import run as run_lib  # noqa: E402
from lmzoo.trainers import base as trainer_lib  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPT_LEN = 128  # bytes; the reply fills the rest of data.seq_len, its last token the EOS
EOS_ID = 256


def hh_dpo_config(tiny: bool):
    config = config_lib.load_config_file(ROOT / "configs" / "hh_dpo.py", "tiny" if tiny else None)
    config.objective.sft = "ckpt:unused"
    return run_lib.validate(config)


def dpo_texts(config, count: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """`count` (prompt, chosen, rejected) of random letters, prompt ⊕ reply ⊕ EOS exactly data.seq_len bytes."""
    rng = np.random.default_rng(seed)
    prompt_len = min(PROMPT_LEN, config.data.seq_len // 2)
    reply_len = config.data.seq_len - prompt_len - 1

    def text(n):
        return "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz "), n))

    return [(text(prompt_len), text(reply_len), text(reply_len)) for _ in range(count)]


class DpoStep:
    """configs/hh_dpo.py's train step as train.py runs it, on one batch of `dpo_texts`: compiled through
    `compile_trainer` ahead of its first call (the state donated, the batch on the mesh), its temporaries kept mapped
    from before that call (`host_memory.StepBuffers`), in a process set up as train.py's (`common.Isolated`)."""

    def __init__(self, tiny: bool, prompt_once: bool):
        config = hh_dpo_config(tiny)
        if prompt_once:  # each prompt run once for its two replies (the texts' prompts are PROMPT_LEN bytes)
            config.objective.max_prompt_len = min(PROMPT_LEN, config.data.seq_len // 2)
        objective = objectives.build(config)
        self.compiled = trainer_lib.compile_trainer(
            objective.trainer(objective.model()), mesh=sharding.make_mesh(), rules=sharding.axis_rules(), seed=0
        )
        rows = dpo_texts(config, config.train.batch_size)
        tokens = np.array(
            [
                [[ord(c) for c in prompt + reply] + [EOS_ID] for reply in (chosen, rejected)]
                for prompt, chosen, rejected in rows
            ],
            np.int32,
        )  # [B, 2, seq_len]
        batch = {"tokens": tokens, "prompt_lengths": np.full(len(rows), len(rows[0][0]), np.int32)}
        with self.compiled.context():
            self.state = self.compiled.init(jax.random.key(0))
            self.batch = sharding.put_batch(batch, self.compiled.batch_sharding)
            self.program = self.compiled.step.lower(self.state, self.batch).compile()
        host_memory.StepBuffers(kernels.platform()).before_call(self.program, self.state, self.batch)

    def run(self, steps: int) -> list[float]:
        """Milliseconds of each of `steps` steps, each waited for."""
        times = []
        for _ in range(steps):
            began = time.perf_counter()
            self.state, metrics = jax.block_until_ready(self.program(self.state, self.batch))
            times.append(1e3 * (time.perf_counter() - began))
        return times


def lmzoo_dpo_ms(tiny: bool, repeats: int) -> dict[str, float]:
    """Median ms of the DPO step, "dpo step" (both rows whole) and "dpo step, prompt once", each in a process of its
    own (`DpoStep`), after two warm-up steps, the two timed in alternating order so the machine's drift hits both
    alike."""
    variants = {"dpo step": False, "dpo step, prompt once": True}
    steps = {name: common.Isolated(DpoStep, tiny, prompt_once) for name, prompt_once in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    try:
        for step in steps.values():
            step.run(2)
        for r in range(repeats):
            for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
                times[name] += steps[name].run(1)
    finally:
        for step in steps.values():
            step.close()
    return {name: statistics.median(ms) for name, ms in times.items()}


def trl_dpo_seconds(config, steps: int) -> list[float]:
    """Seconds per step of trl's DPOTrainer on the shapes and strings of `lmzoo_dpo_ms` (the first step dropped)."""
    import datasets
    import torch
    import transformers
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(os.cpu_count())
    tokenizer = common.hf_byte_tokenizer()
    torch.manual_seed(0)
    workdir, policy_dir = common.trl_policy("trl_dpo_", common.hf_gpt2_config(config.model), tokenizer)
    batch = config.train.batch_size
    rows = dpo_texts(config, batch) * (steps + 1)  # every step the same batch, as for lmzoo
    args = DPOConfig(
        output_dir=workdir,
        **common.TRL_ON_CPU,
        per_device_train_batch_size=batch,
        max_length=config.data.seq_len,
        learning_rate=config.optim.learning_rate,
        max_grad_norm=config.optim.grad_clip,
        beta=config.objective.beta,
        max_steps=steps + 1,
        seed=0,
        dataloader_num_workers=0,
        precompute_ref_log_probs=False,
    )
    trainer = DPOTrainer(
        model=policy_dir,
        args=args,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_dict(
            {"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows], "rejected": [r[2] for r in rows]}
        ),
    )
    ends = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            ends.append(("begin", time.perf_counter()))

        def on_step_end(self, *args, **kwargs):
            ends.append(("end", time.perf_counter()))

    trainer.add_callback(StepTimes())
    trainer.train()
    begins = [t for kind, t in ends if kind == "begin"]
    finished = [t for kind, t in ends if kind == "end"]
    return [e - b for b, e in zip(begins, finished, strict=True)][1:]


TARGET = 1.5  # issue 51: lmzoo's DPO step and GRPO iteration at least 1.5x trl's speed


def speedup_verdict(lmzoo_ms: float, trl_ms: float) -> str:
    ratio = trl_ms / lmzoo_ms
    return f"{ratio:.2f}x {common.verdict(ratio >= TARGET)}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="the 1-layer models of the :tiny configs")
    parser.add_argument("--trl", action="store_true", help="also time trl's DPOTrainer and GRPOTrainer")
    args = parser.parse_args()
    dpo_config = hh_dpo_config(args.tiny)
    grpo_config = ppo_bench.hh_ppo_config("grpo", args.tiny, 0.0)
    m = dpo_config.model
    common.announce("preference", "dpo + grpo", f"GPT-2 emb_dim {m.emb_dim}, {m.num_layers} layers", 1)
    print("f32 matmul peak (GFLOP/s): " + ", ".join(f"{n}: {g:.0f}" for n, g in common.matmul_peak().items()))
    s = objectives.build(grpo_config).fields
    print(
        f"DPO: {dpo_config.train.batch_size} pairs x 2 x {dpo_config.data.seq_len} tokens; GRPO: "
        f"{grpo_config.train.batch_size} prompts x {s.samples_per_prompt} samples x ({s.prompt_len} + {s.response_len}) "
        f"tokens, {s.epochs} epoch x {s.minibatches} minibatch"
    )
    lmzoo = lmzoo_dpo_ms(args.tiny, args.repeats)
    lmzoo |= {f"grpo {part}": ms[1] for part, ms in ppo_bench.lmzoo_parts(grpo_config, args.repeats).items()}
    columns = {"lmzoo": lmzoo}
    if args.trl:
        import trl

        trl_ms = {"dpo step": 1e3 * statistics.median(trl_dpo_seconds(dpo_config, args.repeats))}
        trl_ms["dpo step, prompt once"] = trl_ms["dpo step"]  # the same strings: trl runs both rows whole
        seconds = ppo_bench.trl_iterations(grpo_config, args.repeats)
        trl_ms |= {f"grpo {part}": 1e3 * statistics.median(v) for part, v in seconds.items()}
        columns[f"trl {trl.__version__}"] = trl_ms
    print(f"median ms; load average now {os.getloadavg()[0]:.2f}")
    print(f"{'part':22s}" + "".join(f"{name:>14s}" for name in columns) + ("   trl / lmzoo" if args.trl else ""))
    for part in ("dpo step", "dpo step, prompt once", "grpo rollout", "grpo scoring", "grpo update", "grpo step"):
        label = "grpo whole iteration" if part == "grpo step" else part
        line = f"{label:22s}" + "".join(f"{column[part]:14.1f}" for column in columns.values())
        if args.trl:
            ours, theirs = (column[part] for column in columns.values())
            judged = part.startswith("dpo step") or part == "grpo step"
            line += f"   {speedup_verdict(ours, theirs) if judged else f'{theirs / ours:.2f}x'}"
        print(line)
    if args.trl:
        print(f"target: lmzoo >= {TARGET}x trl (trl's median time over lmzoo's) on the DPO step and the GRPO iteration")


if __name__ == "__main__":
    main()
