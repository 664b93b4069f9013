"""Tiny configs and batches shared by the tests (B=2, T=8, D=16, N=2, vocab 32)."""

import json
import os
import subprocess
import sys
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import numpy as safetensors_numpy

from lmzoo import models, storage

# XLA's quickest CPU pipeline (LLVM unoptimised, the older loop emitters), which tests/conftest.py sets for the suite:
# the tiny programs tests run are compiled far more often than they run long, and LLVM's optimisations were most of
# the suite's time. tests/test_compile_flags.py checks that the default pipeline trains to the same losses.
FAST_COMPILE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def accepted_xla_flags(flags: Sequence[str]) -> list[str]:
    """Those of `flags` this jaxlib's XLA accepts. XLA ends a process whose XLA_FLAGS name a flag it does not know
    (exit status 1, its one line lost under pytest's output capture), and XLA versions add and drop flags: each is
    tried by starting the CPU backend in a child process, all together first."""

    def accepted(candidate: Sequence[str]) -> bool:
        env = {**os.environ, "XLA_FLAGS": " ".join(candidate), "JAX_PLATFORMS": "cpu"}
        child = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True)
        return child.returncode == 0

    return list(flags) if accepted(flags) else [flag for flag in flags if accepted([flag])]


def default_pipeline_xla_flags() -> list[str]:
    """This process's XLA_FLAGS without FAST_COMPILE_XLA_FLAGS: for a child process that compiles as users do."""
    return [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag not in FAST_COMPILE_XLA_FLAGS]


TINY_GPT2 = dict(
    vocab_size=32,
    max_len=16,
    emb_dim=16,
    num_heads=2,
    num_layers=2,
    mlp_dim=32,
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
)


def tiny_gpt2(**overrides):
    """(model, unboxed params) of a 2-layer GPT-2 with random weights."""
    model = models.build_model("gpt2", {**TINY_GPT2, **overrides})
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["params"])
    return model, params


def random_tokens(shape=(2, 8), vocab_size: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, size=shape).astype(np.int32)


def tiny_word_corpus_config(
    folder,
    config_file: str,
    *,
    num_words: int = 14,
    lines: tuple[int, int] = (64, 16),
    words_per_line: tuple[int, int] = (2, 8),
    ptb_spacing: bool = False,
):
    """configs/<config_file>.py:tiny on random sentences of `num_words` words and <unk>, written to
    <folder>/ptb.{train,valid}.txt (`lines` sentences each, lengths in [low, high)), vocab_size set to fit
    (the words, <unk> and <eos>). ptb_spacing: lines start with a space and end with " \\n", as in PTB's files.
    Returns (config, {"train": text, "valid": text})."""
    import pathlib

    from lmzoo import config as config_lib

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(num_words)] + ["<unk>"]
    texts = {}
    for name, count in zip(("train", "valid"), lines, strict=True):
        sentences = (" ".join(rng.choice(words, size=rng.integers(*words_per_line))) for _ in range(count))
        texts[name] = "".join(f" {s} \n" if ptb_spacing else f"{s}\n" for s in sentences)
        storage.write_text(f"{folder}/ptb.{name}.txt", texts[name])
    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / f"{config_file}.py"
    config = config_lib.load_config_file(path, "tiny")
    config.data.train_path, config.data.validation_path = (
        str(pathlib.Path(folder) / f"ptb.{n}.txt") for n in ("train", "valid")
    )
    config.model.vocab_size = num_words + 2
    return config, texts


def tiny_config(objective: str = "causal_lm", **train):
    """configs/default.py:tiny (a 1-layer GPT-2 on 5 standard-library files, 4 steps) with `objective`
    and config.train fields replaced."""
    import pathlib

    from lmzoo import config as config_lib
    from lmzoo import objectives

    config = config_lib.load_config_file(pathlib.Path(__file__).resolve().parents[1] / "configs" / "default.py", "tiny")
    if objective != config.objective.name:
        config.objective = objectives.objective_section(objective)
    config.train.update(train)
    return config


def save_hf_checkpoint(folder, hf_config: dict, state_dict: dict, *, shards: int = 2) -> str:
    """An HF checkpoint folder (local or in a bucket): config.json and the tensors spread over `shards` safetensors
    files with their index, as `save_pretrained` shards them; returns its `hf:` spec."""
    folder = os.fspath(folder)
    storage.write_text(f"{folder}/config.json", json.dumps(hf_config))
    weight_map, names = {}, list(state_dict)
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state_dict[name] for name in names[i::shards]}
        storage.write_bytes(f"{folder}/{file}", safetensors_numpy.save(part))
        weight_map |= dict.fromkeys(part, file)
    index = json.dumps({"metadata": {}, "weight_map": weight_map})
    storage.write_text(f"{folder}/model.safetensors.index.json", index)
    return f"hf:{folder}"
