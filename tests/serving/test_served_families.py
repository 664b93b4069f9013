"""`python -m lmzoo.cli.serve --init_from=hf:FOLDER` reads each decoder family's HF folder: the family from config.json's
model_type (`convert.hf.family_of`), the model's fields from the folder, its weights converted, and the engine serves
what `decoding.generate` would (tiny random models exported by lmzoo, with a Llama 3-style tokenizer.json)."""

import importlib.util
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import config as config_lib
from lmzoo import decoding
from lmzoo.cli import serve
from lmzoo.convert import export, hf
from lmzoo.models import build_model
from lmzoo.serving import engine

pytest.importorskip("tokenizers")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _llama3_folder():
    spec = importlib.util.spec_from_file_location("llama3_folder", ROOT / "tests" / "convert" / "llama3_folder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (lmzoo family, the config file whose `tiny` model is exported, the model_type its folder gets)
CASES = [
    ("deepseek", "deepseek_v3.py", "deepseek_v3"),
    ("qwen3_5", "qwen3_5.py", "qwen3_5_text"),
    ("llama", "gpt_oss.py", "gpt_oss"),
]


@pytest.mark.parametrize(("family", "config_file", "model_type"), CASES, ids=[c[2] for c in CASES])
def test_a_folder_of_each_decoder_family_is_served_as_generate_would(tmp_path, family, config_file, model_type):
    folder = tmp_path / model_type
    folder.mkdir()
    tokenizer = _llama3_folder().build_tokenizer()
    config = config_lib.load_config_file(ROOT / "configs" / config_file, "tiny")
    fields = dict(config.model.to_dict(), vocab_size=tokenizer.get_vocab_size(), max_len=64)
    model = build_model(family, fields)
    params = jax.tree.map(np.asarray, nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]))
    export.export_hf(family, fields, params, str(folder))
    tokenizer.save(str(folder / "tokenizer.json"))

    served = serve.load_pretrained(f"hf:{folder}")
    assert hf.family_of(model_type) == family and type(served.model) is type(model)
    ids = np.asarray([tokenizer.encode("What is the capital of France?").ids])
    np.testing.assert_allclose(
        served.model.apply({"params": served.params}, ids), model.apply({"params": params}, ids), atol=1e-5
    )

    prompts = [tokenizer.encode(text).ids for text in ("Hello, how are you", "The quick brown fox jumps")]
    requests = [engine.Request(tuple(p), max_tokens=5, temperature=0.0) for p in prompts]
    tickets = engine.Engine(served.model, served.params, slots=2, chunk=3, length=32).generate(requests)
    width = max(map(len, prompts))
    tokens, mask = np.zeros((2, width), np.int32), np.zeros((2, width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    expected = decoding.generate(
        model, params, tokens, prompt_mask=mask, rng=jax.random.key(0), max_new_tokens=5, temperature=0.0
    )
    assert [t.outputs[0].tokens for t in tickets] == [[int(t) for t in row] for row in np.asarray(expected)]


def test_an_encoder_folder_is_refused_naming_the_served_model_types(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(
        ValueError, match=r"model_type 'bert'; the server reads the decoders gpt2, llama, .*deepseek_v3"
    ):
        serve.load_pretrained(f"hf:{tmp_path}")
