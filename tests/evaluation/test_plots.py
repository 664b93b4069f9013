"""eval.py --plot's reader of TensorBoard event files: a real resumed run reads back metrics.jsonl's values,
a truncated last record is read up to, a damaged one is refused by file name; metric groups."""

import json
import pathlib
import shutil
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
from tensorboardX import SummaryWriter

from lmzoo import metrics, testing
from lmzoo.evaluation import plots
from lmzoo.train import loop


def jsonl_series(workdir) -> plots.Series:
    """metrics.jsonl as {metric: {split: [(step, value as float32), ...]}} without the COUNTS."""
    series: plots.Series = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        step, split = row.pop("step"), row.pop("split")
        for name, value in row.items():
            if name not in plots.COUNTS:
                series.setdefault(name, {}).setdefault(split, []).append((step, float(np.float32(value))))
    return series


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """A 4-step run whose last checkpoint is lost, then resumed from step 2: two event files, the second
    purging steps 3 and 4 of the first (tokens_per_sec differs between the two runs)."""
    workdir = tmp_path_factory.mktemp("plots") / "run"
    loop.train_and_evaluate(testing.tiny_config(log_every=1), str(workdir))
    shutil.rmtree(workdir / "checkpoints" / "4")
    loop.train_and_evaluate(testing.tiny_config(log_every=1), str(workdir))
    return workdir


def test_reading_events_does_not_import_torch(resumed_run):
    """tensorboardX imports torch whenever it is installed; eval.py --plot needs only its protobufs and CRC."""
    code = f"import sys; from lmzoo.evaluation import plots; assert plots.read_events({str(resumed_run)!r}); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_resumed_run_reads_back_the_jsonl_values_each_step_once(resumed_run):
    assert len(list((resumed_run / "tb").glob("events.out.tfevents.*"))) == 2
    series = plots.read_events(str(resumed_run))
    assert series == jsonl_series(resumed_run)
    assert [step for step, _ in series["tokens_per_sec"]["train"]] == [1, 2, 3, 4]
    assert [step for step, _ in series["loss"]["validation"]] == [2, 4] and "tokens" not in series


def test_plots_are_one_png_per_group(resumed_run, tmp_path):
    written = plots.plot_metrics(str(resumed_run), str(tmp_path))
    written = [pathlib.Path(p) for p in written]
    assert {p.name for p in written} == {"accuracy.png", "gradients.png", "loss.png", "schedule.png", "throughput.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_a_truncated_last_record_is_read_up_to_with_a_warning_naming_the_file(resumed_run, tmp_path):
    shutil.copytree(resumed_run / "tb", tmp_path / "tb")
    last = sorted((tmp_path / "tb").glob("events.out.tfevents.*"))[-1]
    whole = plots.read_events(str(tmp_path))
    records = list(plots.read_records(last))
    last.write_bytes(last.read_bytes()[:-5])  # cut inside the final record (its data CRC)
    with mock.patch.object(plots.logging, "warning") as warning:
        cut = plots.read_events(str(tmp_path))
    assert list(plots.read_records(last)) == records[:-1]
    assert str(last) in str(warning.call_args) and "truncated" in warning.call_args[0][0]
    assert cut != whole and cut["loss"]["train"] == whole["loss"]["train"][: len(cut["loss"]["train"])]


def test_a_damaged_record_is_refused_naming_the_file_and_offset(resumed_run, tmp_path):
    shutil.copytree(resumed_run / "tb", tmp_path / "tb")
    first = sorted((tmp_path / "tb").glob("events.out.tfevents.*"))[0]
    data = bytearray(first.read_bytes())
    data[20] ^= 0xFF  # inside the first record's data
    first.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{first}: damaged record at byte 0"):
        plots.read_events(str(tmp_path))


def test_a_restart_marker_and_a_rewritten_step_keep_the_latest_values(tmp_path):
    writer = SummaryWriter(str(tmp_path / "tb"), filename_suffix=".a")
    for step in (1, 2, 3):
        writer.add_scalar("train/loss", 10.0 + step, step)
    writer.add_scalar("train/loss", 0.5, 2)  # a restart from scratch rewrites step 2 (no marker)
    writer.close()
    writer = SummaryWriter(str(tmp_path / "tb"), purge_step=3, filename_suffix=".b")  # resumed at step 2
    writer.add_scalar("train/loss", 7.0, 4)
    writer.close()
    assert plots.read_events(str(tmp_path)) == {"loss": {"train": [(1, 11.0), (2, 0.5), (4, 7.0)]}}


def test_a_run_resumed_within_the_second_its_first_run_began_writes_its_own_event_file(tmp_path):
    """tensorboardX names an event file by the second it began: without lmzoo's numbered suffix the resumed run
    would write into the first run's file."""
    with mock.patch("time.time", return_value=1_800_000_000.0):
        first = metrics.MetricWriter(str(tmp_path))
        first.write(1, {"loss": 3.0}, "train")
        first.write(2, {"loss": 2.0}, "train")
        first.close()
        resumed = metrics.MetricWriter(str(tmp_path), resume_step=1)
        resumed.write(2, {"loss": 1.5}, "train")
        resumed.close()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.1800000000.*"))) == 2
    assert plots.read_events(str(tmp_path)) == {"loss": {"train": [(1, 3.0), (2, 1.5)]}}


def test_expert_loads_are_a_panel_per_layer_with_a_line_per_expert_and_the_uniform_share(tmp_path):
    writer = SummaryWriter(str(tmp_path / "tb"))
    for step in (100, 200):
        for layer in (0, 10, 2):  # drawn in numeric order, not the names' order
            for expert in range(3):
                writer.add_scalar(f"train/expert_load/{layer}_{expert}", (expert + layer + step / 100) / 16, step)
        writer.add_scalar("train/loss", 2.0, step)
    writer.add_scalar("validation/expert_load/0_0", 0.5, 200)  # the training windows are drawn, not evaluations
    writer.close()
    series = plots.read_events(str(tmp_path))
    panels = plots.expert_load_panels(
        {name: s for name, s in series.items() if plots.metric_group(name) == "expert_load"}
    )
    assert [panel.title for panel in panels] == [f"layer {layer}: each expert's share" for layer in (0, 2, 10)]
    assert [label for label, _, _ in panels[1].lines] == ["expert 0", "expert 1", "expert 2"]
    assert panels[1].lines[2] == ("expert 2", None, [(100, 5 / 16), (200, 6 / 16)])
    assert all(panel.reference == ("uniform 1/3", 1 / 3) for panel in panels)
    written = plots.plot_metrics(str(tmp_path), str(tmp_path / "plots"))
    assert sorted(pathlib.Path(p).name for p in written) == ["expert_load.png", "loss.png"]


def test_no_event_files_is_an_error_naming_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tb")):
        plots.read_events(str(tmp_path))


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("loss", "loss"),
        ("perplexity", "loss"),
        ("bits_per_char", "loss"),
        ("distill_loss", "loss"),
        ("kl", "loss"),
        ("accuracy", "accuracy"),
        ("sentence_accuracy", "accuracy"),
        ("macro_f1", "accuracy"),
        ("rougeL", "generation"),
        ("learning_rate", "schedule"),
        ("kl_weight", "schedule"),
        ("tokens_per_sec", "throughput"),
        ("grad_norm", "gradients"),
        ("loss/policy", "loss"),
        ("objective/kl", "objective"),
        ("expert_load/3_7", "expert_load"),
        ("table_fill", "table_fill"),
    ],
)
def test_metric_groups(name, group):
    assert plots.metric_group(name) == group
