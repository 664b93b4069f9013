"""Curves and samples of PPO runs: per-iteration metrics as one PNG, and responses to held-out prompts.

    PYTHONPATH=$PWD python scripts/rlhf_report.py --run ppo=runs/hh_ppo --run nokl=runs/hh_ppo_nokl --samples 4

Reads each run's metrics.jsonl for the curves (<out>/ppo_curves.png; --out defaults to the first run's
WORKDIR/report; docs/rlhf/ppo_curves.png was made with --out docs/rlhf). For the samples it restores
the run's last checkpoint (the frozen SFT reference and reward model are read again from their paths),
samples one response per held-out prompt with a fixed key and prints each with its normalised
reward-model score and its KL to the reference (Σ_t log π − log π_ref), as Markdown.
"""

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lmzoo.evaluation import alignment  # noqa: E402
from lmzoo.train import run as run_lib  # noqa: E402

CURVES = (
    ("objective/scores", "mean RM score (normalised)"),
    ("objective/kl", "KL to reference (nats / response)"),
    ("objective/kl_coef", "β"),
    ("policy/approxkl", "approx KL between iterations"),
    ("policy/clipfrac", "clip fraction"),
    ("value/explained_variance", "value explained variance"),
    ("policy/entropy", "token entropy"),
    ("tokens/response_len", "response length"),
)


def plot(runs: dict[str, str], path: pathlib.Path) -> None:
    fig, axes = plt.subplots(2, 4, figsize=(18, 7))
    for name, workdir in runs.items():
        rows = [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r["split"] == "train"]
        for ax, (key, title) in zip(axes.flat, CURVES, strict=True):
            values = [r.get(key, float("nan")) for r in rows]  # GRPO logs no value metrics
            ax.plot([r["step"] for r in rows], values, label=name)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("PPO iteration")
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"wrote {path}")


def samples(name: str, workdir: str, count: int) -> None:
    run = run_lib.open_run(workdir)
    _, state = run_lib.restore_step(run)
    run.close()
    judge = alignment.PolicyJudge(run, state, [next(iter(run.eval_batches("validation")))])
    rollout = judge.rollouts(state.params["decoder"])
    print(
        f"\n### {name} ({workdir}, step {int(state.step)}): held-out prompts, mean score "
        f"{rollout['scores'].mean():.3f}, mean KL {rollout['sequence_kl'].mean():.2f}\n"
    )
    print("\n".join(judge.sample_lines(rollout, count)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, help="NAME=WORKDIR of a ppo run (repeatable)")
    parser.add_argument("--out", default=None, help="folder for the PNG (default: the first run's WORKDIR/report)")
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()
    runs = dict(spec.split("=", 1) for spec in args.run)
    out = pathlib.Path(args.out or pathlib.Path(next(iter(runs.values()))) / "report")
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, out / "ppo_curves.png")
    for name, workdir in runs.items():
        samples(name, workdir, args.samples)


if __name__ == "__main__":
    main()
