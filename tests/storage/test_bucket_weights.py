"""`hf:` weights read from a bucket (the GCS and S3 servers of tests/storage/conftest.py, and a local folder): a
sharded safetensors checkpoint loads bit for bit as from the local folder, its headers in one round of requests and
its tensors' ranged reads in flight together rather than one after another."""

import pathlib
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lmzoo import storage, testing, weights
from lmzoo.convert import llama, mapping
from lmzoo.models import build_model, make_config

# 3 layers, so that a scanned leaf is read in several pieces; every mesh-free shape odd enough to catch a transpose.
FIELDS = dict(vocab_size=96, max_len=16, emb_dim=48, num_heads=4, num_kv_heads=2, num_layers=3, mlp_dim=80)
GET_SECONDS = 0.01  # each ranged GET is held this long, so that reads in flight together overlap measurably


def _shapes(cfg) -> dict:
    model = build_model("llama", cfg)
    return nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]))


def _save_sharded(folder: pathlib.Path, shards: int = 3) -> None:
    """A random bf16 Llama of FIELDS as an HF folder of `shards` safetensors files with their index."""
    cfg = make_config("llama", FIELDS)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda leaf: rng.normal(size=leaf.shape).astype(np.float32), _shapes(cfg))
    state_dict = {name: tensor.astype(ml_dtypes.bfloat16) for name, tensor in llama.to_hf(params, cfg).items()}
    testing.save_hf_checkpoint(folder, llama.config_to_hf(cfg), dict(sorted(state_dict.items())), shards=shards)


@pytest.mark.parametrize("on_devices", [False, True], ids=["host", "accelerator_way"])
def test_sharded_checkpoint_in_a_bucket_loads_as_the_local_folder_with_reads_in_flight_together(
    root, tmp_path, monkeypatch, on_devices
):
    local = tmp_path / "hf"
    _save_sharded(local)
    for file in sorted(local.iterdir()):
        storage.upload(file, f"{root}/hf/{file.name}")
    cfg = make_config("llama", FIELDS | {"scan_layers": True, "param_dtype": "float32"})
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device), _shapes(cfg))
    expected = mapping.flatten(jax.device_get(weights.merge_pretrained(target, f"hf:{local}", "llama", cfg)))

    header_rounds, in_flight, most = [], [0], [0]
    lock, read_range, read_ranges_of = threading.Lock(), storage.read_range, storage.read_ranges_of

    def held_read_range(*args, **kwargs):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            time.sleep(GET_SECONDS)
            return read_range(*args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    def counted_read_ranges_of(requests):
        header_rounds.append(len(requests))
        return read_ranges_of(requests)

    monkeypatch.setattr(storage, "read_range", held_read_range)
    monkeypatch.setattr(storage, "read_ranges_of", counted_read_ranges_of)
    if on_devices:
        monkeypatch.setattr(mapping, "_assembled_on_devices", lambda sharding: True)
    loaded = mapping.flatten(jax.device_get(weights.merge_pretrained(target, f"hf:{root}/hf", "llama", cfg)))
    assert loaded.keys() == expected.keys()
    for path, leaf in loaded.items():
        np.testing.assert_array_equal(leaf, expected[path], err_msg=path)
    assert header_rounds == [3], header_rounds  # the 3 shards' headers, one round of requests
    if root.startswith(("gs://", "s3://")):
        assert most[0] > 1, "the tensors' ranged reads went one after another"
    else:
        assert most[0] == 0  # local files are read directly, one read ahead
