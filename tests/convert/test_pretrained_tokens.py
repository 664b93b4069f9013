"""A checkpoint's special tokens, chat template and generation settings, read from its files as transformers reads
them (tokenizer_config.json, special_tokens_map.json, generation_config.json), and written back by the export, so
that transformers' AutoTokenizer + apply_chat_template + generate work on the export as on the original. The
checkpoint is llama3_folder.py's: a tiny random Llama with a Llama-3-style tokenizer (<|begin_of_text|>,
<|eot_id|> as eos, <|end_of_text|> a second eos id in generation_config.json, no pad token)."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
import tokenizers as hf
from llama3_folder import MODEL, write_folder  # tests/convert/llama3_folder.py

from lmzoo import tokenizers, weights
from lmzoo.convert import export
from lmzoo.data import chat
from lmzoo.models import build_model, make_config

transformers = pytest.importorskip("transformers")
MESSAGES = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Tell me a story."},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, special ids by name) of a checkpoint whose model always says <|end_of_text|>: the eos id only
    generation_config.json names."""
    folder = tmp_path_factory.mktemp("llama3")
    return folder, write_folder(folder, says="<|end_of_text|>")


def test_special_tokens_come_from_the_checkpoints_files(checkpoint, tmp_path):
    folder, ids = checkpoint
    tokenizer = weights.pretrained_tokenizer(f"hf:{folder}")
    assert (tokenizer.bos_id, tokenizer.eos_id) == (ids["bos"], ids["eot"])
    assert tokenizer.eos_ids == (ids["eot"], ids["end_of_text"])  # generation_config.json's list, eos_token first
    assert tokenizer.pad_id == ids["reserved_0"] != tokenizer.eos_id  # no pad token: the first reserved one
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert (reference.bos_token_id, reference.eos_token_id) == (tokenizer.bos_id, tokenizer.eos_id)
    # The chat rows of a run are the ids transformers' apply_chat_template gives.
    ids_here, _ = chat.tokenize(chat.load_template(str(folder)), tokenizer, [*MESSAGES[:2]], where="test")
    assert ids_here == reference.apply_chat_template(MESSAGES[:2], tokenize=True, return_dict=True)["input_ids"]
    # As a run's workdir keeps it (tokenizer/spec.json) and reads it back.
    spec = json.loads(json.dumps(tokenizer.save(str(tmp_path / "saved"))))
    loaded = tokenizers.from_spec(spec, str(tmp_path / "saved"))
    assert (loaded.special_ids, loaded.eos_ids) == (tokenizer.special_ids, tokenizer.eos_ids)
    assert loaded.chat_template == tokenizer.chat_template == reference.chat_template


def _word_tokenizer(*specials: str) -> hf.Tokenizer:
    tok = hf.Tokenizer(hf.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.add_special_tokens(list(specials))
    return tok


def test_without_a_pad_token_pad_is_a_pad_named_token_then_a_reserved_one_then_unk_then_eos():
    config = {"tokenizer_config.json": {"eos_token": "<e>", "bos_token": {"content": "<s>"}}}
    tok = _word_tokenizer("<s>", "<e>", "<|reserved_special_token_0|>", "<|finetune_right_pad_id|>")
    ids, eos_ids = tokenizers.pretrained_special_ids(tok, config)
    assert ids == {"bos": 3, "eos": 4, "pad": 6} and eos_ids == (4,)
    ids, _ = tokenizers.pretrained_special_ids(_word_tokenizer("<s>", "<e>", "<|reserved_special_token_0|>"), config)
    assert ids["pad"] == 5
    with_unk = {"tokenizer_config.json": {**config["tokenizer_config.json"], "unk_token": "[UNK]"}}
    ids, _ = tokenizers.pretrained_special_ids(_word_tokenizer("<s>", "<e>"), with_unk)
    assert ids["pad"] == ids["unk"] == 2  # Llama 2's pad_token = unk_token
    ids, _ = tokenizers.pretrained_special_ids(_word_tokenizer("<s>", "<e>"), config)
    assert ids["pad"] == ids["eos"] == 4  # HF users' pad_token = eos_token
    given = {"tokenizer_config.json": {**config["tokenizer_config.json"], "pad_token": "<s>"}}
    assert tokenizers.pretrained_special_ids(tok, given)[0]["pad"] == 3
    # eos from generation_config.json alone (one id or a list); special_tokens_map.json where tokenizer_config is silent
    files = {"special_tokens_map.json": {"bos_token": "<s>"}, "generation_config.json": {"eos_token_id": [5, 4]}}
    ids, eos_ids = tokenizers.pretrained_special_ids(tok, files)
    assert (ids["bos"], ids["eos"], eos_ids) == (3, 5, (5, 4))
    assert tokenizers.HFTokenizer(tok, files=files).eos_ids == (5, 4)
    # without the files, the fixed names, as before: no pad
    named = tokenizers.HFTokenizer(_word_tokenizer("<s>", "</s>")).special_ids
    assert named == {"eos": 4, "bos": 3, "unk": 2, "sep": 4, "cls": 3}


def test_the_export_writes_them_back_for_transformers(checkpoint, tmp_path):
    import torch

    folder, ids = checkpoint
    saved = tmp_path / "workdir_tokenizer"  # the tokenizer as a run saved it
    spec = weights.pretrained_tokenizer(f"hf:{folder}").save(str(saved))
    tokenizer = tokenizers.from_spec(spec, str(saved))
    fields = dict(MODEL, vocab_size=tokenizer.vocab_size)
    model = build_model("llama", make_config("llama", fields))
    target = jax.device_get(nn.unbox(model.init(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))["params"]))
    params = weights.read_params(f"hf:{folder}", "llama", fields, target)
    out = tmp_path / "exported"
    assert export.export_hf("llama", fields, params, str(out), tokenizer)["tokenizer"]

    original, exported = (transformers.AutoTokenizer.from_pretrained(str(f)) for f in (folder, out))
    for add in (False, True):
        prompt = MESSAGES if add else MESSAGES[:2]
        text = original.apply_chat_template(prompt, add_generation_prompt=add, tokenize=False)
        assert exported.apply_chat_template(prompt, add_generation_prompt=add, tokenize=False) == text
        assert exported(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    assert (exported.bos_token, exported.eos_token) == (original.bos_token, original.eos_token)
    assert exported.pad_token == "<|reserved_special_token_0|>" and original.pad_token is None
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids["eot"], ids["end_of_text"]]
    assert (generation["pad_token_id"], generation["temperature"]) == (ids["reserved_0"], 0.6)  # its settings kept

    # generate stops at <|end_of_text|>, an eos id only generation_config.json names, on both
    prompt = original.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    replies = []
    for where in (folder, out):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32).eval()
        with torch.no_grad():
            replies.append(model.generate(**prompt, max_new_tokens=6, do_sample=False)[0].tolist())
    new = replies[1][prompt["input_ids"].shape[1] :]
    assert replies[0] == replies[1] and new == [ids["end_of_text"]]

    # a run's own template (config.objective.chat_template) replaces the checkpoint's
    other = tmp_path / "other"
    other.mkdir()
    export.save_tokenizer(tokenizer, other, chat_template="{{ messages[0]['content'] }}")
    reread = transformers.AutoTokenizer.from_pretrained(str(other))
    assert reread.apply_chat_template(MESSAGES, tokenize=False) == MESSAGES[0]["content"]
    assert "chat_template" not in json.loads((other / "tokenizer_config.json").read_text())
