"""Training curves of a run as PNGs, read from its TensorBoard event files: one figure per metric group.

The training loop logs every scalar as `<split>/<metric>` (tensorboardX, `<workdir>/tb/events.out.tfevents.*`).
The event files are TFRecord files, read here without TensorFlow or TensorBoard: each record is
`uint64 length | uint32 masked CRC-32C of the length | data | uint32 masked CRC-32C of the data`
(little-endian), the data an `Event` protocol buffer. A group figure has one panel per metric, each
with its train and validation series; the expert loads of a mixture-of-experts model (`expert_load/L_E`) have
one panel per layer instead, a line per expert.
"""

import collections
import dataclasses
import io
import os
import re
import struct
from collections.abc import Iterator

from absl import logging

from lmzoo import metrics as metrics_lib
from lmzoo import storage

SPLIT_COLORS = {"train": "C0", "validation": "C1"}  # the same in every panel
# Sizes of what an evaluation read, not curves.
COUNTS = frozenset(
    {
        "tokens",
        "examples",
        "evaluated_batches",
        "pairs",
        "generated_examples",
        "reconstruct_examples",
        "iw_samples",
        "beam_size",
    }
)
# (group, metric names it takes), the first match wins; a metric none matches is a group of its own, and
# a name with a "/" (PPO's "loss/policy", "objective/kl") goes to the group before its first "/".
GROUPS = (
    ("loss", re.compile(r"loss|.*_loss|perplexity|.*_perplexity|bits_per_.*|reconstruction|kl")),
    ("accuracy", re.compile(r".*accuracy|.*f1|exact_match")),
    ("generation", re.compile(r"bleu|rouge.*")),
    ("schedule", re.compile(r"learning_rate|kl_weight")),
    ("throughput", re.compile(r".*_per_sec")),
    ("gradients", re.compile(r"grad_norm")),
)
# expert_load/L_E: the fraction of layer L's assignments that expert E received (lmzoo/models/experts.py).
EXPERT_LOAD = re.compile(r"expert_load/(\d+)_(\d+)")
Points = list[tuple[int, float]]  # [(step, value), ...] by step
Series = dict[str, dict[str, Points]]  # metric -> split -> points


@dataclasses.dataclass(frozen=True)
class Panel:
    """One axes of a group figure.

    Attributes:
        title: the panel's title.
        lines: (label, color or None for the next of the axes' cycle, points) of each line.
        reference: (label, height) of a dashed horizontal line, or None.
        yscale: matplotlib's y scale.
    """

    title: str
    lines: list[tuple[str, str | None, Points]]
    reference: tuple[str, float] | None = None
    yscale: str = "linear"


def read_records(path: str | os.PathLike) -> Iterator[bytes]:
    """The data of each whole record of a TFRecord file, in order.

    A truncated last record (a run killed mid-write) ends the file with a warning naming it; a record
    whose CRC does not match is a ValueError naming the file and the record's byte offset.
    """
    with metrics_lib.tensorboardx_without_torch():
        from tensorboardX.record_writer import masked_crc32c

    data = storage.read_bytes(path)
    offset = 0
    while offset < len(data):
        header = data[offset : offset + 12]
        if len(header) < 12:
            logging.warning(
                "%s: truncated record at byte %d (%d bytes of its header); read up to it", path, offset, len(header)
            )
            return
        (length,), (length_crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
        if masked_crc32c(header[:8]) != length_crc:
            raise ValueError(f"{path}: damaged record at byte {offset} (the CRC of its length does not match)")
        body = data[offset + 12 : offset + 16 + length]
        if len(body) < length + 4:
            logging.warning(
                "%s: truncated record at byte %d (%d of its %d bytes); read up to it",
                path,
                offset,
                12 + len(body),
                16 + length,
            )
            return
        if masked_crc32c(body[:length]) != struct.unpack("<I", body[length:])[0]:
            raise ValueError(f"{path}: damaged record at byte {offset} (the CRC of its {length} bytes does not match)")
        yield body[:length]
        offset += 16 + length


def read_events(workdir: str) -> Series:
    """Every logged scalar of `<workdir>/tb` but the COUNTS, as {metric: {split: [(step, value), ...]}}.

    Event files are read in the order they were written. Like TensorBoard, a resumed run's start marker
    (SessionLog.START at step s, tensorboardX's purge_step) drops the points at steps >= s, and a point
    at a step at or before its series' last one drops that series' points from that step on, so every
    step appears once, with the value of the run that continued.
    """
    with metrics_lib.tensorboardx_without_torch():
        from tensorboardX.proto.event_pb2 import Event, SessionLog

    directory = storage.path(workdir) / "tb"
    files = [
        directory / name for name in sorted(storage.file_sizes(directory)) if name.startswith("events.out.tfevents.")
    ]
    if not files:
        raise FileNotFoundError(
            f"no TensorBoard event files in {directory}: --plot reads the events a train.py run writes there"
        )
    series: Series = collections.defaultdict(lambda: collections.defaultdict(list))

    def drop_from(points: list[tuple[int, float]], step: int) -> None:
        points[:] = [p for p in points if p[0] < step]

    for path in files:
        for record in read_records(path):
            event = Event.FromString(record)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for splits in series.values():
                    for points in splits.values():
                        drop_from(points, event.step)
            for value in event.summary.value:
                split, _, name = value.tag.partition("/")
                if not name or name in COUNTS or not value.HasField("simple_value"):
                    continue
                points = series[name][split]
                if points and points[-1][0] >= event.step:
                    drop_from(points, event.step)
                points.append((event.step, value.simple_value))
    found = {name: {split: points for split, points in splits.items() if points} for name, splits in series.items()}
    found = {name: splits for name, splits in found.items() if splits}
    if not found:
        raise ValueError(f"the event files in {directory} hold no scalars yet")
    return found


def metric_group(name: str) -> str:
    """The figure metric `name` is drawn in (see GROUPS)."""
    if "/" in name:
        return name.split("/", 1)[0]
    return next((group for group, pattern in GROUPS if pattern.fullmatch(name)), name)


def metric_panels(metrics: Series) -> list[Panel]:
    """One panel per metric, its splits in their colours."""
    return [
        Panel(
            name,
            [(split, SPLIT_COLORS.get(split, "C2"), points) for split, points in sorted(splits.items())],
            yscale="log" if "perplexity" in name else "linear",
        )
        for name, splits in sorted(metrics.items())
    ]


def expert_load_panels(metrics: Series) -> list[Panel]:
    """One panel per layer: each expert's share of the layer's assignments in the training windows (one point per
    log_every steps), and the uniform share 1/E dashed. Layers and experts in numeric order."""
    loads: dict[int, dict[int, Points]] = collections.defaultdict(dict)
    for name, splits in metrics.items():
        layer, expert = map(int, EXPERT_LOAD.fullmatch(name).groups())
        loads[layer][expert] = splits["train"]
    return [
        Panel(
            f"layer {layer}: each expert's share",
            [(f"expert {expert}", None, points) for expert, points in sorted(experts.items())],
            reference=(f"uniform 1/{len(experts)}", 1 / len(experts)),
        )
        for layer, experts in sorted(loads.items())
    ]


def palette_png(png: bytes) -> bytes:
    """The PNG re-encoded with a palette of 256 colours: a figure has a few dozen and their anti-aliased blends, and
    the file is about a fifth of matplotlib's 24-bit one (small enough to keep in docs/)."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE)
    out = io.BytesIO()
    image.save(out, format="png", optimize=True)
    return out.getvalue()


def plot_metrics(workdir: str, out_dir: str | None = None) -> list[str]:
    """Writes `<out_dir or workdir/plots>/<group>.png` for every metric group of the run's event files
    (one panel per metric, its splits together, or per layer for expert loads; either folder local or in a bucket);
    returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, Series] = collections.defaultdict(dict)
    for name, splits in read_events(workdir).items():
        groups[metric_group(name)][name] = splits
    out = storage.path(out_dir) if out_dir else storage.path(workdir) / "plots"
    written = []
    for group, metrics in sorted(groups.items()):
        panels = expert_load_panels(metrics) if group == "expert_load" else metric_panels(metrics)
        columns = min(len(panels), 3)
        rows = -(-len(panels) // columns)
        legends = {tuple(label for label, _, _ in panel.lines) for panel in panels}
        figure, axes = plt.subplots(
            rows, columns, figsize=(4.5 * columns, 3.5 * rows), squeeze=False, layout="constrained"
        )
        for ax, panel in zip(axes.flat, panels, strict=False):
            for label, color, points in panel.lines:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="o" if len(points) < 20 else None, label=label, color=color)
            if panel.reference is not None:
                label, height = panel.reference
                ax.axhline(height, color="black", linestyle="--", linewidth=1, label=label)
            ax.set(xlabel="step", title=panel.title, yscale=panel.yscale)
            ax.grid(alpha=0.3)
            if len(legends) > 1:
                ax.legend()
        if len(legends) == 1:  # the same lines in every panel: one legend beside them, covering none
            figure.legend(*axes.flat[0].get_legend_handles_labels(), loc="outside right upper")
        for ax in axes.flat[len(panels) :]:
            ax.set_visible(False)
        figure.suptitle(f"{storage.path(workdir).name}: {group}")
        image = io.BytesIO()
        figure.savefig(image, format="png", dpi=100)
        plt.close(figure)
        storage.write_bytes(out / f"{group}.png", palette_png(image.getvalue()))
        written.append(os.fspath(out / f"{group}.png"))
    return written
