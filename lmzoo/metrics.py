"""Metric reduction and writers (TensorBoard via tensorboardX, plus a JSON-lines file)."""

import contextlib
import json
import math
import pathlib
import sys

import jax
import numpy as np


def accumulate(total: dict | None, metrics: dict) -> dict:
    """Adds (sum, count) metric pairs; works on device arrays without a host sync."""
    return metrics if total is None else jax.tree.map(lambda a, b: a + b, total, metrics)


def summarize(total: dict, *, token_nll: bool = True) -> dict[str, float]:
    """(sum, count) pairs -> means on the host; adds perplexity and bits per token when "loss" is a token NLL."""
    host = jax.device_get(total)
    out = {name: float(s) / max(float(c), 1e-12) for name, (s, c) in host.items()}
    if "loss" in out and token_nll:
        out["perplexity"] = math.exp(min(out["loss"], 50.0))
        out["bits_per_token"] = out["loss"] / math.log(2)
    return out


def all_finite(summary: dict[str, float]) -> bool:
    return all(np.isfinite(v) for v in summary.values())


def _row_step(line: str) -> float:
    """The step of a metrics.jsonl row; infinity for a line cut short by a killed run (dropped on resume)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


@contextlib.contextmanager
def tensorboardx_without_torch():
    """A block in which tensorboardX is imported without torch (unless torch is loaded already): tensorboardX imports
    torch whenever it is installed (only to accept torch tensors), which costs a process ~200 MiB and a second."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
    try:
        yield
    finally:
        del sys.modules["torch"]


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch."""
    with tensorboardx_without_torch():
        from tensorboardX import SummaryWriter
    return SummaryWriter


class MetricWriter:
    """Writes scalars to TensorBoard (`<workdir>/tb`) and `<workdir>/metrics.jsonl`; process 0 only.

    resume_step: the step a run resumes from; rows and events of later steps (written after that
    checkpoint by a run that then stopped) are dropped, so every step appears once.
    """

    def __init__(self, workdir: str, *, enabled: bool = True, resume_step: int = 0):
        self.enabled = enabled
        if enabled:
            from lmzoo import workdir as workdir_lib

            path = pathlib.Path(workdir) / "metrics.jsonl"
            if path.exists():
                kept = [line for line in path.read_text().splitlines(keepends=True) if _row_step(line) <= resume_step]
                workdir_lib.atomic_write_text(path, "".join(kept))
            self.tb = _summary_writer_class()(
                str(pathlib.Path(workdir) / "tb"), purge_step=resume_step + 1 if resume_step else None
            )
            self.jsonl = open(path, "a")

    def write(self, step: int, scalars: dict[str, float], prefix: str) -> None:
        if not self.enabled:
            return
        for name, value in scalars.items():
            self.tb.add_scalar(f"{prefix}/{name}", value, step)
        self.jsonl.write(json.dumps({"step": step, "split": prefix, **scalars}) + "\n")
        self.jsonl.flush()
        self.tb.flush()

    def close(self) -> None:
        if self.enabled:
            self.tb.close()
            self.jsonl.close()
