"""Scale-out on CPU: training is mesh-independent, two processes train together, checkpoints
reshard on restore, and kill -9 / SIGTERM / a corrupt checkpoint all resume to the exact state of
an uninterrupted run.

Every multi-device or multi-process run is a subprocess (this process keeps one device). They
share a persistent XLA compilation cache, so a rerun of a config skips compilation.
"""

import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from run_config import sample_from_checkpoint  # tests/scaleout is on sys.path (rootdir-relative imports)

from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT = 150  # seconds for any one subprocess: a hang fails instead of blocking CI
# configs/default.py:tiny with every mesh axis dividing what it shards (heads, mlp, vocab, batch).
OVERRIDES = {
    "model.num_heads": 4,
    "model.vocab_size": 264,
    "train.batch_size": 8,
    "train.log_every": 1,
    "train.checkpoint_every": 2,
    "train.eval_every": 1000,
    "train.sample_tokens": 0,
}
MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2), (1, 8, 1)]
STEPS = 16

pytestmark = pytest.mark.slow


class Run:
    """A subprocess started at once, output to `log`; `result()` waits for it."""

    def __init__(self, args: list[str], env: dict, log: pathlib.Path):
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)

    def result(self, returncode: int = 0) -> str:
        try:
            self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"{self.proc.args} hung for {TIMEOUT} s:\n{self.log.read_text()[-3000:]}")
        output = self.log.read_text()
        assert self.proc.returncode == returncode, f"{self.proc.args} exited {self.proc.returncode}:\n{output[-3000:]}"
        return output

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def train_cmd(workdir: pathlib.Path, **overrides) -> list[str]:
    flags = {**OVERRIDES, **{k.replace("__", "."): v for k, v in overrides.items()}}
    return [sys.executable, "train.py", "--config=configs/default.py:tiny", f"--workdir={workdir}"] + [
        f"--config.{k}={v}" for k, v in flags.items()
    ]


def helper_cmd(devices: int, jobs: list[dict]) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "tests" / "scaleout" / "run_config.py"),
        str(devices),
        json.dumps(jobs, default=str),
    ]


def helper_stats(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.startswith('{"step"')]


def train_losses(workdir: pathlib.Path) -> dict[int, float]:
    """step -> training loss from metrics.jsonl (the last entry wins when a resumed run repeats steps)."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if row["split"] == "train"}


def restore_latest(workdir: pathlib.Path, mesh_shape=None):
    """(step, state) of the latest checkpoint, restored here on one device as a resumed run would."""
    config = run_lib.load_saved(str(workdir))
    if mesh_shape is not None:
        config.sharding.mesh_shape = mesh_shape
    run = run_lib.build(config, str(workdir))
    state, data_state = run_lib.restore_or_init(run)
    run.close()
    return data_state["step"], jax.device_get(state)


def assert_same_final_state(workdir: pathlib.Path, reference: pathlib.Path) -> None:
    step, state = restore_latest(workdir)
    ref_step, ref_state = restore_latest(reference)
    assert step == ref_step == STEPS
    jax.tree.map(np.testing.assert_array_equal, state, ref_state)


def wait_for(path: pathlib.Path, run: Run) -> None:
    deadline = time.time() + TIMEOUT
    while not path.exists():
        assert run.proc.poll() is None, (
            f"exited {run.proc.returncode} before {path} appeared:\n{run.log.read_text()[-3000:]}"
        )
        assert time.time() < deadline, f"{path} did not appear within {TIMEOUT} s"
        time.sleep(0.005)


def mesh_name(mesh) -> str:
    return "x".join(map(str, mesh))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return tmp_path_factory.mktemp("scaleout")


@pytest.fixture(scope="module")
def env(workspace):
    # Device counts come from the configs, not from the caller's XLA_FLAGS.
    flags = [flag for flag in os.environ["XLA_FLAGS"].split() if "device_count" not in flag]
    return dict(
        os.environ,
        XLA_FLAGS=" ".join(flags),
        PYTHONPATH=str(ROOT),
        JAX_COMPILATION_CACHE_DIR=str(workspace / "xla_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


@pytest.fixture(scope="module")
def reference(workspace, env):
    """Uninterrupted single-device run: the losses and final state every other run must reproduce."""
    run = Run(train_cmd(workspace / "reference", train__steps=STEPS), env, workspace / "reference.log")
    yield run
    run.stop()


@pytest.fixture(scope="module")
def mesh_runs(workspace, env):
    """3 steps on 8 simulated devices per mesh, two meshes per process, both processes at once; the
    (2,2,2) run also writes the params its checkpoint restores to (`2x2x2.npz`) and a sample drawn in
    that mesh from its sharded params (`2x2x2_sample.npz`)."""
    runs = {}
    for meshes in (MESHES[:2], MESHES[2:]):
        jobs = [
            {
                "workdir": workspace / mesh_name(m),
                "train": {**OVERRIDES, "train.steps": 3, "train.checkpoint_every": 3, "sharding.mesh_shape": m},
            }
            | ({"npz": workspace / "2x2x2.npz", "sample": workspace / "2x2x2_sample.npz"} if m == (2, 2, 2) else {})
            for m in meshes
        ]
        run = Run(helper_cmd(8, jobs), env, workspace / f"{mesh_name(meshes[0])}.log")
        runs.update({m: (run, i) for i, m in enumerate(meshes)})
    yield runs
    for run, _ in runs.values():
        run.stop()


def test_losses_and_param_bytes_across_meshes(reference, mesh_runs, workspace):
    reference.result()
    ref = train_losses(workspace / "reference")
    stats = {m: helper_stats(run.result())[i] for m, (run, i) in mesh_runs.items()}
    for mesh in MESHES:
        losses = train_losses(workspace / mesh_name(mesh))
        assert sorted(losses) == [1, 2, 3]
        for step, loss in losses.items():
            assert loss == pytest.approx(ref[step], rel=1e-5), (mesh, step)
    total = stats[(8, 1, 1)]["param_bytes"]
    for (_, fsdp, tensor), s in stats.items():
        assert s["step"] == 3 and s["param_bytes"] == total
        # Each device holds 1/(fsdp*tensor) of the params, plus the small replicated norms and biases.
        assert total / (fsdp * tensor) <= s["param_bytes_device0"] <= 1.2 * total / (fsdp * tensor)


def test_two_processes_match_one_and_resume_alone(reference, workspace, env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = workspace / "two_processes"
    runs = [
        Run(
            train_cmd(
                workdir,
                train__steps=3,
                sharding__mesh_shape=(2, 1, 2),
                distributed__coordinator_address=f"127.0.0.1:{port}",
                distributed__num_processes=2,
                distributed__process_id=i,
                distributed__cpu_devices_per_process=2,
            ),
            env,
            workspace / f"two_processes_{i}.log",
        )
        for i in range(2)
    ]
    try:
        for run in runs:
            run.result()
    finally:
        for run in runs:
            run.stop()
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "3"]
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {
        p.name for p in (workdir / "checkpoints" / "3" / "state").iterdir()
    }
    # One process, one device, continues the two-process run.
    resumed = Run(train_cmd(workdir, train__steps=4), env, workspace / "two_processes_resumed.log").result()
    assert f"resumed from {workdir}/checkpoints/3" in resumed
    reference.result()
    ref, losses = train_losses(workspace / "reference"), train_losses(workdir)
    assert sorted(losses) == [1, 2, 3, 4]
    for step, loss in losses.items():
        assert loss == pytest.approx(ref[step], rel=1e-5), step


def test_restore_reshards_bit_exactly(mesh_runs, workspace, env):
    run, _ = mesh_runs[(2, 2, 2)]
    run.result()
    workdir = workspace / "2x2x2"
    saved = dict(np.load(workspace / "2x2x2.npz"))
    jobs = [{"workdir": workdir, "mesh": [1, 2, 1], "npz": workspace / "restored_2dev.npz"}]
    (stats,) = helper_stats(Run(helper_cmd(2, jobs), env, workspace / "restore_2dev.log").result())
    assert stats["step"] == 3 and stats["param_bytes_device0"] < stats["param_bytes"]  # sharded over fsdp=2
    restored = dict(np.load(workspace / "restored_2dev.npz"))
    step, state = restore_latest(workdir, mesh_shape=(1, 1, 1))
    one_device = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    assert step == 3 and saved.keys() == restored.keys() == one_device.keys()
    for name, value in saved.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)
        np.testing.assert_array_equal(one_device[name], value, err_msg=name)


def test_kill9_then_rerun_matches_uninterrupted(reference, workspace, env):
    workdir = workspace / "killed"
    kill_at = random.choice(range(2, STEPS - 3, 2))
    run = Run(train_cmd(workdir, train__steps=STEPS), env, workspace / "killed.log")
    wait_for(workdir / "checkpoints" / str(kill_at), run)
    run.proc.send_signal(signal.SIGKILL)
    run.result(returncode=-signal.SIGKILL)
    rerun = Run(train_cmd(workdir, train__steps=STEPS), env, workspace / "killed_rerun.log").result()
    resumed = int(re.search(r"resumed from .*/checkpoints/(\d+)", rerun)[1])
    assert kill_at <= resumed < STEPS, (kill_at, resumed)
    reference.result()
    assert_same_final_state(workdir, workspace / "reference")


def test_sigterm_checkpoints_exits_cleanly_and_resumes(reference, workspace, env):
    workdir = workspace / "terminated"
    run = Run(train_cmd(workdir, train__steps=STEPS), env, workspace / "terminated.log")
    wait_for(workdir / "checkpoints" / "2", run)
    run.proc.send_signal(signal.SIGTERM)
    stopped = int(re.search(r"preempted: saved checkpoint (\d+)", run.result(returncode=75))[1])
    assert 2 <= stopped < STEPS and (workdir / "checkpoints" / str(stopped)).is_dir()
    rerun = Run(train_cmd(workdir, train__steps=STEPS), env, workspace / "terminated_rerun.log").result()
    assert f"resumed from {workdir}/checkpoints/{stopped}" in rerun
    reference.result()
    assert_same_final_state(workdir, workspace / "reference")


def test_corrupt_latest_checkpoint_warns_and_resumes_from_previous(reference, workspace, env):
    reference.result()
    workdir = workspace / "corrupt"
    shutil.copytree(workspace / "reference", workdir)
    for f in (workdir / "checkpoints" / str(STEPS) / "state" / "d").iterdir():
        os.truncate(f, f.stat().st_size // 2)
    rerun = Run(train_cmd(workdir, train__steps=STEPS), env, workspace / "corrupt_rerun.log").result()
    assert f"checkpoint {workdir}/checkpoints/{STEPS} is unreadable" in rerun
    assert f"resumed from {workdir}/checkpoints/{STEPS - 2}" in rerun
    assert_same_final_state(workdir, workspace / "reference")


def test_sampling_in_the_mesh_equals_one_device(mesh_runs, workspace):
    run, _ = mesh_runs[(2, 2, 2)]
    run.result()
    sharded = dict(np.load(workspace / "2x2x2_sample.npz"))
    config = run_lib.load_saved(str(workspace / "2x2x2"))
    config.sharding.mesh_shape = (1, 1, 1)
    one_device = run_lib.build(config, str(workspace / "2x2x2"))
    state, _ = run_lib.restore_or_init(one_device)
    one_device.close()
    expected = sample_from_checkpoint(one_device, state.params)
    np.testing.assert_array_equal(sharded["tokens"], expected["tokens"])
    np.testing.assert_allclose(sharded["log_probs"], expected["log_probs"], atol=1e-5)
    assert np.all(expected["log_probs"] < 0)


def test_grouped_query_attention_trains_tensor_parallel_with_fewer_kv_heads_than_the_tensor_axis(workspace, env):
    """configs/llama.py:tiny with one kv head on a (data 4, tensor 2) mesh of 8 devices: the kv heads take their
    own (replicated) rule, query heads, MLP and vocabulary shard over the tensor axis, and the losses are the
    single device's."""
    one, eight = llama_tiny_losses(workspace, env, "llama", ["--config.model.num_kv_heads=1"], "(4,1,2)")
    assert sorted(eight) == [1, 2, 3, 4]
    for step, loss in one.items():
        assert eight[step] == pytest.approx(loss, rel=1e-5), step


def llama_tiny_losses(workspace, env, name: str, flags: list[str], mesh_shape: str) -> tuple[dict, dict]:
    """Training losses {step: loss} of train.py on configs/llama.py:tiny with `flags`, logged every step: on one
    device (workdir `name`_1) and on 8 devices in `mesh_shape` (`name`_8)."""
    flags = [*flags, "--config.train.log_every=1", "--config.train.sample_tokens=0"]
    losses = []
    for workdir, mesh in (
        (f"{name}_1", ()),
        (f"{name}_8", ("--config.distributed.cpu_devices_per_process=8", f"--config.sharding.mesh_shape={mesh_shape}")),
    ):
        command = [sys.executable, "train.py", "--config=configs/llama.py:tiny", f"--workdir={workspace / workdir}"]
        Run(command + flags + list(mesh), env, workspace / f"{workdir}.log").result()
        losses.append(train_losses(workspace / workdir))
    return losses[0], losses[1]


def test_lora_with_dropout_trains_the_same_on_an_fsdp_and_tensor_mesh(workspace, env):
    """LoRA adapters (dropout 0.1 on their inputs) over a frozen configs/llama.py:tiny base on an (fsdp 4, tensor 2)
    mesh of 8 devices: the losses are the single device's (the dropout masks do not depend on the sharding), and the
    adapters trained (B, zero at the start, moved)."""
    import flax.linen as nn
    import jax.numpy as jnp

    from lmzoo import config as config_lib
    from lmzoo.convert import export
    from lmzoo.models import build_model

    config = config_lib.load_config_file(ROOT / "configs" / "llama.py", "tiny")
    model = build_model("llama", config.model.to_dict())
    params = jax.device_get(nn.unbox(model.init(jax.random.key(5), jnp.zeros((1, 8), jnp.int32))["params"]))
    base = workspace / "llama_base"
    export.export_hf("llama", config.model.to_dict(), jax.tree.map(np.asarray, params), str(base))
    flags = [
        f"--config.init_from=hf:{base}",
        "--config.lora.targets=query|value|wi_0|wo",
        "--config.lora.rank=2",
        "--config.lora.dropout=0.1",
    ]
    one, eight = llama_tiny_losses(workspace, env, "lora", flags, "(1,4,2)")
    assert sorted(eight) == sorted(one) and len(one) >= 3
    for step, loss in one.items():
        assert eight[step] == pytest.approx(loss, rel=1e-5), step
    _, state = restore_latest(workspace / "lora_8", mesh_shape=(1, 1, 1))
    trained = {"/".join(map(str, path)): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    assert any("lora_b" in path and np.abs(leaf).max() > 0 for path, leaf in trained.items()), sorted(trained)
