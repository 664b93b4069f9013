"""`hf:ORG/NAME[@revision]`: a Hub id resolved in the local Hugging Face cache (never downloaded), its weights and,
with `data.tokenizer.kind="init_from"`, its tokenizer.json; an id not in the cache is one line saying how to fetch it.
The cache is laid out in the test as huggingface_hub writes it (models--ORG--NAME/refs and snapshots)."""

import pathlib
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import config as config_lib
from lmzoo import weights
from lmzoo.convert import export, hf
from lmzoo.models import build_model, make_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
BERT_TOKENIZER = ROOT.parent / "shared" / "data" / "tokenizers" / "bert_uncased" / "tokenizer.json"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding "lmzoo-tests/tiny-llama" at revision main (a commit) with a tokenizer.json."""
    config = config_lib.load_config_file(ROOT / "configs" / "llama.py", "tiny")
    model = build_model("llama", make_config("llama", config.model.to_dict()))
    params = nn.unbox(model.init(jax.random.key(3), jnp.zeros((1, 4), jnp.int32))["params"])
    repo = tmp_path / "hub" / "models--lmzoo-tests--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    export.export_hf("llama", config.model.to_dict(), jax.device_get(params), str(snapshot))
    shutil.copy(BERT_TOKENIZER, snapshot / "tokenizer.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return config, snapshot, params


@pytest.mark.skipif(not BERT_TOKENIZER.exists(), reason="../shared/data/tokenizers is not here")
def test_a_cached_hub_id_gives_its_weights_and_tokenizer(hub_cache, tmp_path):
    config, snapshot, params = hub_cache
    assert pathlib.Path(hf.resolve_folder("lmzoo-tests/tiny-llama")) == snapshot
    assert pathlib.Path(hf.resolve_folder(f"lmzoo-tests/tiny-llama@{COMMIT}")) == snapshot
    assert hf.resolve_folder(str(tmp_path)) == str(tmp_path)  # a folder is a folder, whatever its name
    loaded = weights.read_params("hf:lmzoo-tests/tiny-llama", "llama", config.model.to_dict(), jax.device_get(params))
    jax.tree.map(np.testing.assert_array_equal, loaded, jax.device_get(params))
    tokenizer = weights.pretrained_tokenizer("hf:lmzoo-tests/tiny-llama")
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
    assert tokenizer.vocab_size == 30522


def test_an_id_not_in_the_cache_says_how_to_fetch_it(hub_cache):
    with pytest.raises(FileNotFoundError, match=r"hf download lmzoo-tests/absent --revision v2 --include"):
        hf.resolve_folder("lmzoo-tests/absent@v2")
    with pytest.raises(FileNotFoundError, match="is neither a folder nor in the Hugging Face cache"):
        weights.read_params("hf:lmzoo-tests/absent", "llama", {}, {})


def test_tokenizer_kind_init_from_needs_init_from():
    config = config_lib.load_config_file(ROOT / "configs" / "llama.py", "tiny")
    config.data.tokenizer.kind = "init_from"
    with pytest.raises(ValueError, match=r"config.data.tokenizer.kind='init_from': 'init_from' reads the tokenizer of"):
        config_lib.check_values(config, data_parallel_size=1)
    config.data.tokenizer.kind = "bpe"
    with pytest.raises(ValueError, match=r"config.data.tokenizer.kind='bpe': choose one of char, byte, .*, init_from"):
        config_lib.check_values(config, data_parallel_size=1)
