"""PPO, RLOO, GRPO and DPO side by side: one SFT checkpoint, one reward model, the same number of policy updates,
judged on held-out HH-RLHF prompts.

    PYTHONPATH=$PWD python scripts/preference_compare.py [--out runs/preference_compare] [--sft DIR --rm DIR]

1. Unless --sft and --rm name finished runs: SFT (configs/hh_sft.py, --sft_steps) and the reward model from it
   (configs/hh_rm.py, --rm_steps). Every run goes through train.py's run layer (`loop.train_and_evaluate`) in
   this process, into a workdir under --out.
2. Each method is a run from that SFT checkpoint (the RL methods against that reward model). The budget is the
   number of optimizer updates of the policy (--updates), the same for every method, with a checkpoint every
   --updates / --checkpoints updates: configs/hh_ppo.py makes epochs x minibatches = 8 updates per rollout of 32
   prompts, hh_ppo.py:rloo 2 per rollout of 8 prompts x 4 samples, hh_ppo.py:grpo 1 per rollout of 8 prompts x 4
   samples, and hh_dpo.py 1 per 16 pairs.
3. The SFT policy (update 0) and every checkpoint's decoder are judged on the held-out prompts with the same keys
   (`lmzoo.evaluation.alignment.PolicyJudge`, the PPO trainer's rollout): mean reward-model score (normalised so SFT
   samples on training prompts score mean 0, std 1; no missing-EOS penalty), KL to the SFT policy (Σ_t log π − log
   π_ref on the policy's own samples, nats per reply), and the win rate against the SFT policy's reply to the same
   prompt with the same key, judged by the reward model (ties ½).

Writes into --out: score_vs_kl.png, results.md (the table, every checkpoint, samples) and results.json. A rerun
resumes: a finished run is not trained again. --tiny: the 1-layer configs and 16 updates (a smoke run).
"""

import argparse
import datetime
import json
import os
import pathlib
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import common  # noqa: E402

from lmzoo import config as config_lib  # noqa: E402
from lmzoo.evaluation import alignment  # noqa: E402
from lmzoo.kernels import host_memory  # noqa: E402
from lmzoo.train import loop  # noqa: E402
from lmzoo.train import run as run_lib  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
METHODS = {"ppo": "hh_ppo.py", "rloo": "hh_ppo.py:rloo", "grpo": "hh_ppo.py:grpo", "dpo": "hh_dpo.py"}
DEFAULTS = {"sft_steps": 200, "rm_steps": 130, "updates": 128, "checkpoints": 4}  # 24 min on 2 shared cores
TINY = {"sft_steps": 4, "rm_steps": 4, "updates": 16, "checkpoints": 2}


def with_tiny(spec: str, tiny: bool) -> str:
    """configs/<file>[:variants], with `tiny` added to the variants when asked."""
    if not tiny:
        return spec
    return spec + ("," if ":" in spec else ":") + "tiny"


def load_config(spec: str, tiny: bool):
    name, _, variants = with_tiny(spec, tiny).partition(":")
    return config_lib.load_config_file(ROOT / "configs" / name, variants or None)


def updates_per_step(config) -> int:
    """Optimizer updates of the policy in one train step: epochs x minibatches per rollout (`PPOTrainer.update`, every
    algorithm), one for DPO."""
    o = config.objective
    return 1 if o.name == "dpo" else o.epochs * o.minibatches


def budget_unit(config) -> str:
    """What one train step of `config` consumes, in words."""
    o, b = config.objective, config.train.batch_size
    if o.name == "dpo":
        return f"{b} pairs"
    return f"{b} prompts x {o.samples_per_prompt} samples"


def train(name: str, spec: str, workdir: pathlib.Path, steps: int, overrides: dict, args) -> dict[str, float]:
    """Trains configs/`spec` (with `overrides`, dotted config keys -> values) to `steps` steps in `workdir` through the
    run layer train.py calls (`loop.train_and_evaluate`), unless a checkpoint of that step is there; returns the wall
    clock ("seconds") of the run that trained it and the load average ("load") at its start and end (recorded in
    workdir/wall.json)."""
    record = workdir / "wall.json"
    if (workdir / "checkpoints" / str(steps)).is_dir() and record.exists():
        print(f"{name}: {workdir} already trained to step {steps}")
        return json.loads(record.read_text())
    config = load_config(spec, args.tiny)
    overrides = {"train.steps": steps, "optim.decay_steps": steps, **overrides}
    if args.data:
        overrides["data.path"] = args.data
    for key, value in overrides.items():
        *sections, field = key.split(".")
        node = config
        for section in sections:
            node = node[section]
        node[field] = value
    print(f"{name}: configs/{with_tiny(spec, args.tiny)} in {workdir}, {overrides}", flush=True)
    start, load = time.perf_counter(), os.getloadavg()[0]
    loop.train_and_evaluate(config, str(workdir))
    wall = {"seconds": time.perf_counter() - start, "load": [load, os.getloadavg()[0]]}
    record.write_text(json.dumps(wall))
    return wall


def train_methods(args, sft: str, rm: str) -> dict[str, dict]:
    """Each method trained to args.updates policy updates -> name: {"workdir", "wall", "per_step", "steps", "unit"}."""
    runs = {}
    for name in args.methods.split(","):
        spec = METHODS[name]
        config = load_config(spec, args.tiny)
        per_step = updates_per_step(config)
        if args.updates % (per_step * args.checkpoints):
            raise SystemExit(
                f"error: --updates={args.updates} must be a multiple of {name}'s {per_step} updates per step x "
                f"--checkpoints={args.checkpoints}"
            )
        steps = args.updates // per_step
        overrides = {
            "objective.sft": f"ckpt:{sft}",
            "train.checkpoint_every": steps // args.checkpoints,
            "train.eval_every": steps,
            "train.keep_checkpoints": args.checkpoints,
        }
        if config.objective.name != "dpo":
            overrides["objective.reward_model"] = f"ckpt:{rm}"
        workdir = pathlib.Path(args.out) / name
        wall = train(name, spec, workdir, steps, overrides, args)
        runs[name] = {"workdir": str(workdir), "wall": wall, "per_step": per_step, "steps": steps}
        runs[name]["unit"] = budget_unit(config)
    return runs


def make_judge(args, sft: str, rm: str) -> alignment.PolicyJudge:
    """A PPO run of configs/hh_ppo.py against `sft` and `rm` in out/judge (never trained): its trainer's rollout
    and frozen models judge every policy, on all held-out prompts (or --eval_batches batches of them)."""
    config = load_config(METHODS["ppo"], args.tiny)
    config.objective.update(sft=f"ckpt:{sft}", reward_model=f"ckpt:{rm}", missing_eos_penalty=0.0)
    if args.data:
        config.data.path = args.data
    run = run_lib.build(config, str(pathlib.Path(args.out) / "judge"))
    state, _ = run_lib.restore_or_init(run)
    run.close()
    batches = list(run.eval_batches("validation"))[: args.eval_batches]
    return alignment.PolicyJudge(run, state, batches, samples_per_prompt=args.samples_per_prompt)


def judge_checkpoints(judge: alignment.PolicyJudge, runs: dict[str, dict], samples: int) -> tuple[list, dict]:
    """Rows {"method", "updates", "score", "kl", "win_rate", "response_len", "samples"} of the SFT policy (method
    "sft", update 0) and of every checkpoint of every run, and Markdown sample lines of each run's last one."""
    metrics, rollout = judge.judge(judge.state.frozen["reference"])
    rows = [{"method": "sft", "updates": 0, **metrics}]
    lines = {"sft": judge.sample_lines(rollout, samples)}
    for name, info in runs.items():
        run = run_lib.open_run(info["workdir"], batches=False)
        try:
            for step in run.checkpointer.steps():
                _, state = run_lib.restore_step(run, step, frozen=False)  # the judge holds the frozen models
                params = run.compiled.host_params(state)
                decoder = params if run.config.objective.name == "dpo" else params["decoder"]
                metrics, rollout = judge.judge(decoder)
                rows.append({"method": name, "updates": step * info["per_step"], **metrics})
                print(f"{name} step {step}: {json.dumps(rows[-1])}", flush=True)
            lines[name] = judge.sample_lines(rollout, samples)
        finally:
            run.close()
    return rows, lines


def table(rows: list[dict], runs: dict[str, dict]) -> list[str]:
    """One Markdown row per method at its last checkpoint, the SFT policy first."""
    out = [
        "| method | budget (policy updates) | RM score | KL to SFT (nats) | win rate vs SFT | reply length | train wall (load) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ["sft", *runs]:
        last = [r for r in rows if r["method"] == name][-1]
        if name == "sft":
            budget, wall = "0 (the reference)", "-"
        else:
            info = runs[name]
            budget = f"{last['updates']} = {info['steps']} steps x {info['per_step']} (a step: {info['unit']})"
            wall = f"{info['wall']['seconds']:.0f} s (load {info['wall']['load'][0]:.1f}-{info['wall']['load'][1]:.1f})"
        out.append(
            f"| {name} | {budget} | {last['score']:+.3f} | {last['kl']:.3f} | {last['win_rate']:.3f} | "
            f"{last['response_len']:.1f} | {wall} |"
        )
    return out


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Score against KL, one curve per method over its checkpoints (each starting at the SFT policy)."""
    origin = rows[0]
    fig, ax = plt.subplots(figsize=(7, 5))
    for name in dict.fromkeys(r["method"] for r in rows[1:]):
        points = [origin] + [r for r in rows if r["method"] == name]
        ax.plot([r["kl"] for r in points], [r["score"] for r in points], marker="o", label=name)
        ax.annotate(str(points[-1]["updates"]), (points[-1]["kl"], points[-1]["score"]), fontsize=8)
    ax.set_xlabel("KL to the SFT policy (nats per reply, on held-out prompts)")
    ax.set_ylabel("mean RM score (normalised)")
    ax.set_title("held-out RM score vs KL over training (last point: policy updates)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def report(rows, runs, lines, judge, args, started: dict) -> str:
    cpu, _ = common.cpu_model_and_isa()
    prompts = int(len(judge.reference["scores"]) // args.samples_per_prompt)
    out = [
        f"Preference optimisation at a matched budget of {args.updates} policy updates ({started['date']}; {cpu}, "
        f"{os.cpu_count()} cores; load average {started['load']:.2f} at start, {os.getloadavg()[0]:.2f} at the end). "
        f"Judged on {prompts} held-out prompts x {args.samples_per_prompt} samples.",
        "",
        *table(rows, runs),
        "",
        "Every checkpoint:",
        "",
        "| method | updates | RM score | KL | win rate |",
        "|---|---|---|---|---|",
        *(
            f"| {r['method']} | {r['updates']} | {r['score']:+.3f} | {r['kl']:.3f} | {r['win_rate']:.3f} |"
            for r in rows
        ),
    ]
    for name, sample_lines in lines.items():
        out += ["", f"Samples, {name}:", "", *sample_lines]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/preference_compare", help="folder for the runs and the report")
    parser.add_argument("--sft", help="workdir of a finished hh_sft run (default: train one in OUT/sft)")
    parser.add_argument("--rm", help="workdir of a finished hh_rm run from --sft (default: train one in OUT/rm)")
    parser.add_argument("--data", help="the comparisons file (default: the configs' HH-RLHF file)")
    parser.add_argument("--sft_steps", type=int, help="default 200 (--tiny: 4)")
    parser.add_argument("--rm_steps", type=int, help="default 130, one epoch of the training pairs (--tiny: 4)")
    parser.add_argument("--updates", type=int, help="policy updates of every method (default 128; --tiny: 16)")
    parser.add_argument("--checkpoints", type=int, help="judged checkpoints per method (default 4; --tiny: 2)")
    parser.add_argument("--eval_batches", type=int, default=None, help="held-out prompt batches (default: all)")
    parser.add_argument("--samples_per_prompt", type=int, default=2)
    parser.add_argument("--samples", type=int, default=3, help="samples shown per method")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of " + ", ".join(METHODS))
    parser.add_argument("--tiny", action="store_true", help="1-layer configs, a few steps: a smoke run")
    args = parser.parse_args(argv)
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; choose from {list(METHODS)}")
    if bool(args.sft) != bool(args.rm):
        parser.error("give both --sft and --rm, or neither")
    started = {"date": datetime.date.today().isoformat(), "load": os.getloadavg()[0]}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sft, rm = args.sft, args.rm
    if not sft:
        sft, rm = str(out / "sft"), str(out / "rm")
        train("sft", "hh_sft.py", pathlib.Path(sft), args.sft_steps, {}, args)
        train("rm", "hh_rm.py", pathlib.Path(rm), args.rm_steps, {"init_from": f"ckpt:{sft}"}, args)
    runs = train_methods(args, sft, rm)
    judge = make_judge(args, sft, rm)
    rows, lines = judge_checkpoints(judge, runs, args.samples)
    plot(rows, out / "score_vs_kl.png")
    (out / "results.json").write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
    text = report(rows, runs, lines, judge, args, started)
    (out / "results.md").write_text(text)
    print(text)
    print(f"wrote {out / 'score_vs_kl.png'}, {out / 'results.md'}, {out / 'results.json'}")
    return rows


if __name__ == "__main__":
    host_memory.set_up_process()  # as train.py sets its process up, before JAX's CPU client exists
    main()
