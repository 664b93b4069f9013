"""Workdir lock between real processes, atomic files and folders, staged run state."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from lmzoo import workdir

HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from lmzoo import workdir
    lock = workdir.lock(sys.argv[1])
    print("locked", flush=True)
    time.sleep(60)
    """
)


def _start_holder(path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_process_is_refused_naming_the_holder_then_takes_over_after_a_crash(tmp_path):
    holder = _start_holder(tmp_path)
    try:
        with pytest.raises(workdir.WorkdirLockedError, match=f"in use by pid {holder.pid} on "):
            workdir.lock(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with workdir.lock(tmp_path) as lock:
        assert lock.stale_holder is not None and lock.stale_holder.pid == holder.pid
        assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()


def test_released_lock_leaves_no_lock_file_and_no_stale_info(tmp_path):
    workdir.lock(tmp_path).release()
    assert not (tmp_path / "lock").exists()
    with workdir.lock(tmp_path) as lock:
        assert lock.stale_holder is None
    assert not (tmp_path / "lock").exists()


def test_failed_start_removes_only_what_taking_the_lock_added(tmp_path):
    new = tmp_path / "new"
    lock = workdir.lock(new)
    (new / "checkpoints").mkdir()
    lock.release(failed_start=True)
    assert not new.exists()
    used = tmp_path / "used"
    workdir.lock(used).release()
    (used / "config.json").write_text("{}")
    lock = workdir.lock(used)
    (used / "checkpoints").mkdir()
    lock.release(failed_start=True)
    assert sorted(p.name for p in used.iterdir()) == ["config.json"]


def test_a_run_that_waited_on_a_removed_lock_file_locks_the_new_one(tmp_path):
    first = workdir.lock(tmp_path / "run")
    first.path.unlink()  # as a failed start does, while holding the lock
    second = workdir.lock(tmp_path / "run")  # opens a new file; the old inode is no longer the lock
    with pytest.raises(workdir.WorkdirLockedError):
        workdir.lock(tmp_path / "run")
    first.release()  # leaves the second run's file, which is the lock now
    with pytest.raises(workdir.WorkdirLockedError):
        workdir.lock(tmp_path / "run")
    second.release()
    assert not (tmp_path / "run" / "lock").exists()


def test_lock_is_exclusive_within_one_process_too(tmp_path):
    with workdir.lock(tmp_path):
        with pytest.raises(workdir.WorkdirLockedError, match=f"pid {os.getpid()}"):
            workdir.lock(tmp_path)


def test_failed_start_leaves_the_workdir_as_it_was(tmp_path):
    (tmp_path / "config.json").write_text("good")
    with pytest.raises(ValueError, match="validation failed"):
        with workdir.StagedRunState(tmp_path) as stage:
            stage.write_text("config.json", "bad")
            stage.path("tokenizer").mkdir()
            raise ValueError("validation failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert (tmp_path / "config.json").read_text() == "good"


def test_commit_moves_every_staged_entry(tmp_path):
    (tmp_path / "config.json").write_text("old")
    with workdir.StagedRunState(tmp_path) as stage:
        stage.write_text("config.json", "new")
        stage.path("tokenizer").mkdir()
        (stage.path("tokenizer") / "spec.json").write_text("{}")
        assert stage.commit() == ["config.json", "tokenizer"]
    assert (tmp_path / "config.json").read_text() == "new"
    assert (tmp_path / "tokenizer" / "spec.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "tokenizer"]


def test_remove_leftovers_of_a_crashed_start(tmp_path):
    (tmp_path / ".staging-123" / "tokenizer").mkdir(parents=True)
    (tmp_path / ".config.json.0123456789ab.tmp").write_text("half")  # storage.write_bytes's temporary file
    (tmp_path / ".tokenizer.old-123").mkdir()
    (tmp_path / "config.json").write_text("good")
    assert workdir.remove_leftovers(tmp_path) == [".config.json.0123456789ab.tmp", ".staging-123", ".tokenizer.old-123"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
