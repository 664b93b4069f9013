"""Training curves of a run as PNGs, read from its TensorBoard event files: one figure per metric group.

The training loop logs every scalar as `<split>/<metric>` (tensorboardX, `<workdir>/tb/events.out.tfevents.*`).
The event files are TFRecord files, read here without TensorFlow or TensorBoard: each record is
`uint64 length | uint32 masked CRC-32C of the length | data | uint32 masked CRC-32C of the data`
(little-endian), the data an `Event` protocol buffer. A group figure has one panel per metric, each
with its train and validation series.
"""

import collections
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
Series = dict[str, dict[str, list[tuple[int, float]]]]  # metric -> split -> [(step, value), ...] by step


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


def plot_metrics(workdir: str, out_dir: str | None = None) -> list[str]:
    """Writes `<out_dir or workdir/plots>/<group>.png` for every metric group of the run's event files
    (one panel per metric, its splits together; either folder local or in a bucket); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, Series] = collections.defaultdict(dict)
    for name, splits in read_events(workdir).items():
        groups[metric_group(name)][name] = splits
    out = storage.path(out_dir) if out_dir else storage.path(workdir) / "plots"
    written = []
    for group, metrics in sorted(groups.items()):
        columns = min(len(metrics), 3)
        rows = -(-len(metrics) // columns)
        figure, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.5 * rows), squeeze=False)
        for panel, (name, splits) in zip(axes.flat, sorted(metrics.items()), strict=False):
            for split, points in sorted(splits.items()):
                steps, values = zip(*points, strict=True)
                panel.plot(
                    steps,
                    values,
                    marker="o" if len(points) < 20 else None,
                    label=split,
                    color=SPLIT_COLORS.get(split, "C2"),
                )
            panel.set(xlabel="step", title=name, yscale="log" if "perplexity" in name else "linear")
            panel.grid(alpha=0.3)
            panel.legend()
        for panel in axes.flat[len(metrics) :]:
            panel.set_visible(False)
        figure.suptitle(f"{storage.path(workdir).name}: {group}")
        figure.tight_layout()
        image = io.BytesIO()
        figure.savefig(image, format="png", dpi=100)
        plt.close(figure)
        storage.write_bytes(out / f"{group}.png", image.getvalue())
        written.append(os.fspath(out / f"{group}.png"))
    return written
