"""The persistent compilation cache train.py and eval.py turn on: a second run of a config in a new workdir compiles
nothing the first compiled; the cache can be moved and turned off; a folder that cannot be written is one warning."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def environment(cache: str) -> dict:
    """The suite's environment without its own JAX cache (conftest's), with lmzoo's cache setting `cache`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAX_PERSISTENT_CACHE") and k != "JAX_COMPILATION_CACHE_DIR"
    }
    return {**env, "LMZOO_COMPILATION_CACHE": cache}


def entries(folder: pathlib.Path) -> set[str]:
    return {p.name for p in folder.glob("*-cache")}


def train(workdir: pathlib.Path, cache: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "train.py"), "--config=configs/default.py:tiny", f"--workdir={workdir}"]
    return subprocess.run(command, env=environment(cache), cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_a_second_run_in_a_new_workdir_compiles_nothing_new(tmp_path):
    cache = tmp_path / "xla"
    first = train(tmp_path / "first", str(cache))
    assert first.returncode == 0, first.stderr[-2000:]
    compiled = entries(cache)
    assert len(compiled) >= 3  # the train step, the evaluation and the sampler, at least
    second = train(tmp_path / "second", str(cache))
    assert second.returncode == 0, second.stderr[-2000:]
    assert entries(cache) == compiled  # every program read from the cache


def enable(cache: str | None, tmp_path) -> subprocess.CompletedProcess:
    """compilation_cache.enable() in a fresh process with LMZOO_COMPILATION_CACHE=cache (None: unset) and
    LMZOO_CACHE=tmp_path/lmzoo."""
    code = "from lmzoo.train import compilation_cache; print(compilation_cache.enable())"
    env = {**environment(cache or ""), "LMZOO_CACHE": str(tmp_path / "lmzoo")}
    if cache is None:
        del env["LMZOO_COMPILATION_CACHE"]
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


def test_the_default_folder_moved_off_and_an_unwritable_folder(tmp_path):
    default = enable(None, tmp_path)
    assert default.returncode == 0, default.stderr[-2000:]
    assert default.stdout.strip() == str(tmp_path / "lmzoo" / "xla") and (tmp_path / "lmzoo" / "xla").is_dir()
    moved = enable(str(tmp_path / "elsewhere"), tmp_path)
    assert moved.stdout.strip() == str(tmp_path / "elsewhere") and (tmp_path / "elsewhere").is_dir()
    off = enable("off", tmp_path)
    assert off.stdout.strip() == "None" and not off.stderr
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    unusable = enable(str(blocked / "xla"), tmp_path)
    assert unusable.returncode == 0 and unusable.stdout.strip() == "None"
    warning = unusable.stderr.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"warning: the compilation cache {blocked / 'xla'} cannot be")
