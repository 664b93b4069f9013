"""Streamed HF loading (`safetensors_reader.read_safetensors_dir` + `mapping.place`): any box of a converted leaf
equals that box of the whole conversion, a streamed load equals a whole-file load bit for bit, each parameter is built
in its target's sharding on 8 simulated devices, host memory grows by the parameters plus about one tensor, and a bad
checkpoint (an integer weight, an impossible config.json) is refused in one line naming its file.

Checkpoints are written by lmzoo's own exporters (no torch). The multi-device checks run in a subprocess with 8
CPU devices, or in two processes of 4 (as two hosts): this file is also their script (`python
test_streamed_loading.py sharded|rss FOLDER`, `two_hosts FOLDER PROCESS PORT`).
"""

import itertools
import json
import math
import os
import pathlib
import socket
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lmzoo import sharding, testing, weights
from lmzoo.convert import gpt2, hf, llama, mapping, safetensors_reader, tables
from lmzoo.models import build_model, make_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Every mesh axis divides what it shards: heads 4, mlp 48 / 64, vocab 64, embed 32.
LLAMA = dict(vocab_size=64, max_len=16, emb_dim=32, num_heads=4, num_kv_heads=2, num_layers=2, mlp_dim=48)
GPT2 = dict(vocab_size=64, max_len=16, emb_dim=32, num_heads=4, num_layers=2, mlp_dim=64)
FAMILIES = {"llama": (llama, LLAMA), "gpt2": (gpt2, GPT2)}
MESHES = ((1, 8, 1), (1, 2, 4), (2, 2, 2))  # FSDP over 8 devices; FSDP 2 x tensor 4; data 2 (replicas) x both
# The memory check: a Llama of 35M parameters stored in bfloat16, loaded as float32 onto an FSDP mesh.
RSS_LLAMA = dict(vocab_size=4096, max_len=16, emb_dim=512, num_heads=8, num_kv_heads=2, num_layers=8, mlp_dim=2048)
RSS_SLACK = 40 << 20  # bytes: allocator and import noise


def abstract_params(family: str, cfg) -> dict:
    """The boxed parameter tree of `cfg` as ShapeDtypeStructs (logical axis names kept)."""
    model = build_model(family, cfg)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])


def save_random(folder: pathlib.Path, family: str, fields: dict, *, dtype=ml_dtypes.bfloat16, **kwargs) -> str:
    """A checkpoint of random weights of lmzoo's `family` with `fields`, stored in `dtype`."""
    module, _ = FAMILIES[family]
    cfg = make_config(family, fields)
    rng = np.random.default_rng(0)
    state_dict = module.to_hf(
        jax.tree.map(
            lambda leaf: rng.normal(size=leaf.shape).astype(np.float32), nn.unbox(abstract_params(family, cfg))
        ),
        cfg,
    )
    state_dict = {name: tensor.astype(dtype) for name, tensor in state_dict.items()}
    return testing.save_hf_checkpoint(folder, module.config_to_hf(cfg), state_dict, **kwargs)


def test_large_copies_split_over_threads_give_every_element_once():
    """`_copy_all` of parts that come to more than `_PARALLEL_BYTES`: transposed bfloat16 sources (HF's [out, in]),
    a cast to float32 and an odd first axis, split over the copy threads, equal np.copyto's result exactly."""
    rng = np.random.default_rng(0)
    source = rng.normal(size=(2053, 1531)).astype(ml_dtypes.bfloat16)  # [out, in], 6.3 MB
    outs = [np.empty((1531, 2053), ml_dtypes.bfloat16), np.empty((765, 2053), np.float32), np.empty((3, 7), np.float32)]
    srcs = [source.T, source.T[766:], source.T[:3, :7]]
    assert sum(out.nbytes for out in outs) >= mapping._PARALLEL_BYTES
    mapping._copy_all(list(zip(outs, srcs, strict=True)))
    assert mapping._split_axis(source.T) == 1  # each thread's part keeps the axis the source is contiguous in whole
    for out, src in zip(outs, srcs, strict=True):
        np.testing.assert_array_equal(out, np.asarray(src, out.dtype))


def test_every_box_of_a_converted_leaf_is_that_box_of_the_whole_conversion(tmp_path):
    """Transposed and split into heads, a head-split input axis, a third of a fused tensor, a [1, V] row: read from
    a file by boxes, as the shards of a mesh read them; a wide one is copied whole in several cache tiles."""
    rng = np.random.default_rng(0)
    stored = {
        "q.weight": rng.normal(size=(12, 8)).astype(np.float32),  # nn.Linear [N*H, D] -> (D, N, H)
        "wide.weight": rng.normal(size=(150, 300)).astype(np.float32),  # [N*H, D] -> (D, N, H), tiles 256 x 2 x 50
        "o.weight": rng.normal(size=(8, 12)).astype(np.float32),  # nn.Linear [D, N*H] -> (N, H, D)
        "qkv.weight": rng.normal(size=(8, 36)).astype(np.float32),  # Conv1D [D, 3*N*H], its key -> (D, N, H)
        "bias": rng.normal(size=(1, 10)).astype(np.float32),  # [1, V] -> (V,)
    }
    save_file(stored, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    _, tensors = safetensors_reader.read_safetensors_dir(tmp_path)
    entries = [
        *tables.linear("q", ("q",), 8, 12, out_shape=(3, 4), bias=False),
        *tables.linear("wide", ("wide",), 300, 150, out_shape=(3, 50), bias=False),
        *tables.linear("o", ("o",), 12, 8, in_shape=(3, 4), bias=False),
        tables.conv1d("qkv", ("k",), 8, 12, out_shape=(3, 4), part=(1, 3))[0],
        tables.Entry("bias", ("bias",), (1, 10), (10,)),
    ]
    whole = {
        "q": stored["q.weight"].T.reshape(8, 3, 4),
        "wide": stored["wide.weight"].T.reshape(300, 3, 50),
        "o": stored["o.weight"].T.reshape(3, 4, 8),
        "k": stored["qkv.weight"][:, 12:24].reshape(8, 3, 4),
        "bias": stored["bias"].reshape(10),
    }
    for entry in entries:
        leaf, expected = tables.Converted(tensors[entry.hf], entry), whole[entry.path[0]]
        np.testing.assert_array_equal(np.asarray(leaf), expected, err_msg=entry.hf)
        for _ in range(20):
            starts = [int(rng.integers(0, n)) for n in expected.shape]
            box = tuple(slice(start, int(rng.integers(start + 1, n + 1))) for start, n in zip(starts, expected.shape))
            np.testing.assert_array_equal(leaf[box], expected[box], err_msg=f"{entry.hf} {box}")


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("in_pieces", [False, True], ids=["whole", "rows_in_pieces"])
def test_streamed_load_equals_whole_file_load(tmp_path, monkeypatch, family, param_dtype, in_pieces):
    """In pieces: every tensor read by ranges of its rows, each read while the one before is copied out, as large
    ones are."""
    pieces = []
    if in_pieces:
        monkeypatch.setattr(mapping, "_ROWS_PIECE_BYTES", 100)
        read_while_copying = mapping._read_while_copying
        monkeypatch.setattr(
            mapping,
            "_read_while_copying",
            lambda reads, buffer: [pieces.append(len(reads)), read_while_copying(reads, buffer)],
        )
    spec = save_random(tmp_path / "ckpt", family, FAMILIES[family][1])
    module, fields = FAMILIES[family]
    cfg = make_config(family, fields | {"param_dtype": param_dtype})
    whole = {}
    for file in sorted((tmp_path / "ckpt").glob("*.safetensors")):
        whole |= load_file(file)
    expected = mapping.flatten(module.from_hf(whole, cfg))
    params, _ = hf.convert_pretrained(spec, family, cfg, nn.unbox(abstract_params(family, cfg)))
    streamed = mapping.flatten(params)
    assert streamed.keys() == expected.keys()
    for path, leaf in streamed.items():
        assert isinstance(leaf, np.ndarray) and leaf.dtype == jnp.dtype(param_dtype), path
        np.testing.assert_array_equal(leaf, expected[path].astype(param_dtype), err_msg=path)
    kernels_and_tables = sum(leaf.nbytes >= 1024 for leaf in streamed.values())
    assert not in_pieces or sum(count > 1 for count in pieces) >= kernels_and_tables, pieces


@pytest.mark.parametrize("family", list(FAMILIES))
def test_blocks_assembled_on_the_device_equal_the_host_load(tmp_path, monkeypatch, family):
    """An accelerator's way (`mapping._place_in_pieces`), taken here on the CPU device: scanned layers and 100-byte
    ranges of rows, each put on the device as stored (the checkpoint's bfloat16, HF's layout) and transposed,
    reshaped, cast to float32 and written into its block there, equal the host load bit for bit, put in many pieces,
    none a whole parameter."""
    spec = save_random(tmp_path / "ckpt", family, FAMILIES[family][1])
    cfg = make_config(family, FAMILIES[family][1] | {"scan_layers": True, "param_dtype": "float32"})
    shapes = nn.unbox(abstract_params(family, cfg))
    host, _ = hf.convert_pretrained(spec, family, cfg, shapes)
    params, inserts = load_as_an_accelerator(monkeypatch, spec, family, cfg, shapes)
    flat_host = mapping.flatten(host)
    for path, leaf in mapping.flatten(params).items():
        assert isinstance(leaf, jax.Array) and leaf.dtype == jnp.float32, path
        np.testing.assert_array_equal(np.asarray(leaf), flat_host[path], err_msg=path)
    sizes = [piece.size for _, piece, _ in inserts]
    assert len(sizes) > 2 * len(flat_host) and max(sizes) < max(leaf.size for leaf in flat_host.values())
    assert all(piece.dtype == jnp.bfloat16 for _, piece, _ in inserts)  # the host converted nothing
    transposed = any(entry.transpose for entry in FAMILIES[family][0].entries(cfg))  # HF's [out, in] kernels
    assert any(relayout is not None and relayout.transpose for _, _, relayout in inserts) == transposed


def load_as_an_accelerator(monkeypatch, spec: str, family: str, cfg, shapes) -> tuple[dict, list]:
    """`spec` loaded into `shapes` on the CPU device the way an accelerator's blocks are built
    (`mapping._place_in_pieces`, with 100-byte pieces), and (block, piece, relayout) of every piece put there."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device), shapes)
    monkeypatch.setattr(mapping, "_ROWS_PIECE_BYTES", 100)
    monkeypatch.setattr(mapping, "_assembled_on_devices", lambda sharding: True)
    inserts, insert = [], mapping._insert

    def recorded(block, piece, starts, relayout, shape):
        inserts.append((block, piece, relayout))
        return insert(block, piece, starts, relayout, shape)

    monkeypatch.setattr(mapping, "_insert", recorded)
    params, _ = hf.convert_pretrained(spec, family, cfg, target)
    assert all(leaf.sharding == device for leaf in jax.tree.leaves(params))
    return params, inserts


def test_each_parameter_is_built_in_its_sharding_on_8_devices(tmp_path):
    for family in FAMILIES:
        save_random(tmp_path / family, family, FAMILIES[family][1])
    child = subprocess.run(
        [sys.executable, __file__, "sharded", str(tmp_path)],
        env={
            **os.environ,
            "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=8",
            "JAX_PLATFORMS": "cpu",
        },
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0 and "sharded loads ok" in child.stdout, child.stdout[-3000:] + child.stderr[-3000:]


def check_sharded_loads(folder: pathlib.Path) -> None:
    """(The subprocess, 8 devices.) Each family's scanned, bfloat16 model loads into NamedShardings on each of
    MESHES: every parameter is a jax.Array in its target's sharding, each shard holding its box of the host load;
    merging into fresh sharded params keeps their shardings. Each also as an accelerator's blocks are built: put on
    the devices piece by piece and assembled there (`mapping._place_in_pieces`), reading the stored bytes once for
    all the devices, as many as the host's way reads (an 8-device host once read each byte once per device)."""
    read_bytes, read = [0], safetensors_reader.StoredTensor._read

    def counted(tensor, first, count, buffer):
        read_bytes[0] += count * tensor.dtype.itemsize
        return read(tensor, first, count, buffer)

    safetensors_reader.StoredTensor._read = counted
    for family, (_, fields) in FAMILIES.items():
        spec, cfg = (
            f"hf:{folder / family}",
            make_config(family, fields | {"scan_layers": True, "param_dtype": "bfloat16"}),
        )
        boxed = abstract_params(family, cfg)
        host, _ = hf.convert_pretrained(spec, family, cfg, nn.unbox(boxed))
        host_blocks = mapping._assembled_on_devices
        ways = ((mapping._ROWS_PIECE_BYTES, host_blocks), (100, host_blocks), (100, lambda sharding: True))
        reads = {}
        for shape, (piece_bytes, on_devices) in itertools.product(MESHES, ways):
            mapping._ROWS_PIECE_BYTES = piece_bytes  # 100: every tensor read by ranges of its rows, as large ones are
            mapping._assembled_on_devices = on_devices
            shardings = sharding.logical_to_sharding(boxed, sharding.make_mesh(shape), sharding.axis_rules())
            target = jax.tree.map(
                lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
                nn.unbox(boxed),
                shardings,
            )
            read_bytes[0] = 0
            params, _ = hf.convert_pretrained(spec, family, cfg, target)
            reads[shape, piece_bytes, on_devices is host_blocks] = read_bytes[0]
            flat_host, flat_target = mapping.flatten(host), mapping.flatten(target)
            for path, leaf in mapping.flatten(params).items():
                assert isinstance(leaf, jax.Array) and leaf.sharding == flat_target[path].sharding, (
                    family,
                    shape,
                    path,
                )
                assert leaf.dtype == jnp.bfloat16, (family, shape, path)
                for shard in leaf.addressable_shards:
                    np.testing.assert_array_equal(shard.data, flat_host[path][shard.index], err_msg=f"{shape} {path}")
            fresh = jax.tree.map(lambda t: jax.device_put(np.zeros(t.shape, t.dtype), t.sharding), target)
            merged = weights.merge_pretrained(fresh, spec, family, cfg)
            for path, leaf in mapping.flatten(merged).items():
                assert leaf.sharding == flat_target[path].sharding, (family, shape, path)
                np.testing.assert_array_equal(np.asarray(leaf), flat_host[path], err_msg=f"merged {shape} {path}")
        for shape in MESHES:
            assert reads[shape, 100, False] == reads[shape, 100, True] == reads[shape, ways[0][0], True], (
                family,
                reads,
            )
        mapping._assembled_on_devices = host_blocks
    print("sharded loads ok")


def test_two_processes_each_build_their_own_shards(tmp_path):
    """Two processes of 4 CPU devices each (one JAX runtime, 8 devices, as two hosts of a pod), an FSDP mesh over all
    8: each process builds only its devices' shards of every parameter, equal to the whole-file load, the host's way
    and an accelerator's way, reading the same bytes both ways and fewer than the checkpoint's tensors."""
    save_random(tmp_path / "llama", "llama", LLAMA)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "two_hosts", str(tmp_path / "llama"), str(process), str(port)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for process in range(2)
    ]
    outputs = []
    try:
        for child in children:
            outputs.append(child.communicate(timeout=120)[0])
    finally:
        for child in children:
            child.kill()
    reports = []
    for child, output in zip(children, outputs, strict=True):
        assert child.returncode == 0 and "two hosts ok" in output, output[-3000:]
        reports.append(json.loads(output.strip().splitlines()[-1]))
    for report in reports:
        assert report["shards"] == 4 * report["parameters"] * 2, report  # 4 devices, 2 ways
        # the rows only the other process's devices hold are not read (all of a kernel's rows are: FSDP cuts its
        # input axis, HF's columns)
        assert max(report["read"].values()) < report["tensor_bytes"], report
        assert report["read"]["host"] == report["read"]["accelerator"], report


def check_two_hosts(folder: pathlib.Path, process: int, port: int) -> None:
    """(One of two subprocesses.) Joins a 2-process runtime of 4 CPU devices each and loads `folder` onto an FSDP
    mesh over all 8 devices, each way; checks every addressable shard against the whole-file load and prints
    (as JSON) the shards checked and the bytes this process read each way."""
    jax.config.update("jax_num_cpu_devices", 4)
    sharding.initialize_distributed(f"127.0.0.1:{port}", 2, process)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    cfg = make_config("llama", LLAMA | {"scan_layers": True, "param_dtype": "float32"})
    boxed = abstract_params("llama", cfg)
    host, _ = hf.convert_pretrained(f"hf:{folder}", "llama", cfg, nn.unbox(boxed))
    flat_host = mapping.flatten(host)
    shardings = sharding.logical_to_sharding(boxed, sharding.make_mesh((1, 8, 1)), sharding.axis_rules())
    target = jax.tree.map(
        lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where), nn.unbox(boxed), shardings
    )
    read_bytes, read = [0], safetensors_reader.StoredTensor._read

    def counted(tensor, first, count, buffer):
        read_bytes[0] += count * tensor.dtype.itemsize
        return read(tensor, first, count, buffer)

    safetensors_reader.StoredTensor._read = counted
    reads, shards = {}, 0
    for way, on_devices in (("host", mapping._assembled_on_devices), ("accelerator", lambda where: True)):
        mapping._assembled_on_devices = on_devices
        read_bytes[0] = 0
        params, _ = hf.convert_pretrained(f"hf:{folder}", "llama", cfg, target)
        reads[way] = read_bytes[0]
        for path, leaf in mapping.flatten(params).items():
            assert not leaf.is_fully_addressable and len(leaf.addressable_shards) == 4, (way, path)
            for shard in leaf.addressable_shards:
                np.testing.assert_array_equal(shard.data, flat_host[path][shard.index], err_msg=f"{way} {path}")
                shards += 1
    _, tensors = safetensors_reader.read_safetensors_dir(folder)
    tensor_bytes = sum(math.prod(t.shape) * t.dtype.itemsize for t in tensors.values())
    print("two hosts ok")
    print(json.dumps({"read": reads, "tensor_bytes": tensor_bytes, "shards": shards, "parameters": len(flat_host)}))


def test_host_memory_grows_by_the_parameters_and_about_one_tensor(tmp_path):
    """35M parameters in bfloat16 files (69 MB) loaded as float32 (138 MB) onto an FSDP mesh of 8 CPU devices,
    whose buffers are host memory: the peak grows by the parameters and at most two of the largest tensors (the
    whole-file path, then a device_put, grew by 338 MB)."""
    cfg = make_config("llama", RSS_LLAMA | {"scan_layers": True})
    rng = np.random.default_rng(0)
    state_dict = {
        f"model.{entry.hf}" if entry.hf != "lm_head.weight" else entry.hf: rng.standard_normal(
            entry.hf_shape, np.float32
        ).astype(ml_dtypes.bfloat16)
        for entry in llama.entries(cfg)
    }
    testing.save_hf_checkpoint(tmp_path / "ckpt", llama.config_to_hf(cfg), state_dict, shards=3)
    child = subprocess.run(
        [sys.executable, __file__, "rss", str(tmp_path / "ckpt")],
        env={
            **os.environ,
            "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=8",
            "JAX_PLATFORMS": "cpu",
        },
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    largest = max(4 * np.prod(entry.hf_shape) for entry in llama.entries(cfg))
    bound = measured["loaded_bytes"] + 2 * largest + RSS_SLACK
    assert measured["growth"] <= bound, f"peak RSS grew by {measured['growth'] / 1e6:.0f} MB > {bound / 1e6:.0f} MB"


def _rss_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process, from /proc (not getrusage's ru_maxrss, which keeps the peak of
    the process that forked this one across exec)."""
    line = next(line for line in pathlib.Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def measure_load_rss(folder: pathlib.Path) -> None:
    """(The subprocess, 8 devices.) Loads the checkpoint as float32 onto an FSDP mesh; prints the peak RSS growth
    and the bytes of the loaded parameters as JSON."""
    cfg = make_config("llama", RSS_LLAMA | {"scan_layers": True})
    boxed = abstract_params("llama", cfg)
    shardings = sharding.logical_to_sharding(boxed, sharding.make_mesh((1, 8, 1)), sharding.axis_rules())
    target = jax.tree.map(
        lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where), nn.unbox(boxed), shardings
    )
    before = _rss_bytes("VmRSS")
    params, _ = hf.convert_pretrained(f"hf:{folder}", "llama", cfg, target)
    jax.block_until_ready(params)
    growth = _rss_bytes("VmHWM") - before
    loaded = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    print(json.dumps({"growth": growth, "loaded_bytes": loaded}))


def test_integer_weight_is_refused_naming_tensor_file_and_dtype(tmp_path):
    for family, name in (
        ("gpt2", "transformer.h.0.mlp.c_fc.weight"),
        ("llama", "model.layers.1.self_attn.q_proj.weight"),
    ):
        module, fields = FAMILIES[family]
        cfg = make_config(family, fields)
        zeros = jax.tree.map(lambda leaf: np.zeros(leaf.shape, np.float32), nn.unbox(abstract_params(family, cfg)))
        state_dict = module.to_hf(zeros, cfg)
        state_dict[name] = np.ones(state_dict[name].shape, np.int32)
        spec = testing.save_hf_checkpoint(tmp_path / family, module.config_to_hf(cfg), state_dict, shards=1)
        file = tmp_path / family / "model-00001-of-00001.safetensors"
        with pytest.raises(ValueError) as error:
            hf.convert_pretrained(spec, family, cfg, nn.unbox(abstract_params(family, cfg)))
        message = str(error.value)
        assert "\n" not in message and f"{name} in {file} has dtype int32" in message, message
        assert "expected bfloat16, float16 or float32" in message, message


def test_kv_heads_not_dividing_heads_is_blamed_on_config_json(tmp_path):
    cfg = make_config("llama", LLAMA)
    hf_config = llama.config_to_hf(cfg) | {"num_key_value_heads": 3}
    spec = testing.save_hf_checkpoint(
        tmp_path / "ckpt", hf_config, {"model.norm.weight": np.ones(32, np.float32)}, shards=1
    )
    with pytest.raises(tables.ConfigError) as error:
        hf.convert_pretrained(spec, "llama", cfg, nn.unbox(abstract_params("llama", cfg)))
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'ckpt'}/config.json: HF llama config has num_key_value_heads=3"), message
    assert "num_attention_heads=4" in message and "config.model" not in message, message


if __name__ == "__main__":
    if sys.argv[1] == "two_hosts":
        check_two_hosts(pathlib.Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        {"sharded": check_sharded_loads, "rss": measure_load_rss}[sys.argv[1]](pathlib.Path(sys.argv[2]))
