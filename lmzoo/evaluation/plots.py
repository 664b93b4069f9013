"""Training curves of a run as PNGs: one figure per metric, its train and validation series together."""

import collections
import json
import pathlib

COUNTS = frozenset({"tokens", "examples", "evaluated_batches"})  # how much an evaluation read: not curves


def read_metrics(workdir: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{metric: {split: [(step, value), ...]}} from `<workdir>/metrics.jsonl` (written by the training loop)."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: --plot reads the metrics a train.py run writes to its workdir")
    series: dict[str, dict[str, list[tuple[int, float]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step, split = int(row.pop("step")), str(row.pop("split"))
        except (json.JSONDecodeError, KeyError, ValueError) as e:
            raise ValueError(f"{path}:{number}: not a metrics line ({e})") from None
        for name, value in row.items():
            if isinstance(value, int | float) and name not in COUNTS:
                series[name][split].append((step, float(value)))
    if not series:
        raise ValueError(f"{path} holds no metrics yet")
    return series


def plot_metrics(workdir: str, out_dir: str | None = None) -> list[pathlib.Path]:
    """Writes `<out_dir or workdir/plots>/<metric>.png` for every metric (not the COUNTS); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(out_dir) if out_dir else pathlib.Path(workdir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, splits in sorted(read_metrics(workdir).items()):
        figure, axes = plt.subplots(figsize=(6, 4))
        for split, points in sorted(splits.items()):
            steps, values = zip(*sorted(points), strict=True)
            axes.plot(steps, values, marker="o" if len(points) < 20 else None, label=split)
        axes.set(xlabel="step", ylabel=name, title=f"{pathlib.Path(workdir).name}: {name}")
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        path = out / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written
