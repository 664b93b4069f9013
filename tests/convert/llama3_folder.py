"""A tiny random Llama checkpoint folder with a Llama-3-style tokenizer, as a released Llama 3 Instruct folder holds it
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json with the chat template, special_tokens_map.json,
generation_config.json with two eos ids), built here without a download: a byte-level BPE trained by the `tokenizers`
library on a few sentences, then Llama 3's special tokens in Llama 3's order, and no pad token.

Shared by tests/convert/test_pretrained_tokens.py and tests/train/test_from_pretrained.py (which loads it by path)."""

import json
import pathlib

import jax
import numpy as np

# Meta-Llama-3-8B-Instruct's chat template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Llama 3's first ten special tokens, in its order (128000..128009 there; after the BPE's own tokens here).
SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you.",
    "What is the capital of France? The capital of France is Paris.",
    "Tell me a story about a cat and a dog who were friends.",
] * 4
# The model: 2 layers, D 32, 4 query / 2 kv heads of 8, SwiGLU 64, untied, 256 positions.
MODEL = dict(emb_dim=32, num_heads=4, num_kv_heads=2, num_layers=2, mlp_dim=64, max_len=256, rope_theta=500_000.0)


def build_tokenizer():
    """A byte-level BPE (Llama 3's pre-tokenizer and decoder, 300 tokens) with SPECIALS added after it and Llama 3's
    post-processor, which adds <|begin_of_text|>."""
    import tokenizers as hf

    tok = hf.Tokenizer(hf.models.BPE())
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(vocab_size=300, initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(list(SPECIALS))
    bos = tok.token_to_id(SPECIALS[0])
    tok.post_processor = hf.processors.TemplateProcessing(
        single=f"{SPECIALS[0]} $A", pair=f"{SPECIALS[0]} $A {SPECIALS[0]} $B", special_tokens=[(SPECIALS[0], bos)]
    )
    return tok


def always_says(params: dict, token: int) -> dict:
    """`params` changed so that the model's most likely next token is `token` after any context: dimension 0 of the
    residual stream is the embedding's +1 for every token (no layer writes to it), the final norm reads only it, and
    the head maps it to `token` alone."""
    params = jax.tree.map(np.array, params)
    params["embed"]["embedding"][:, 0] = 1.0
    for layer in params["blocks"].values():
        layer["attn"]["out"]["kernel"][..., 0] = 0.0
        layer["mlp"]["wo"]["kernel"][:, 0] = 0.0
    params["norm"]["scale"][:] = 0.0
    params["norm"]["scale"][0] = 1.0
    params["lm_head"]["kernel"][:] = 0.0
    params["lm_head"]["kernel"][0, token] = 5.0
    return params


def write_folder(folder: pathlib.Path, *, seed: int = 0, says: str | None = None, **model) -> dict[str, int]:
    """Writes the checkpoint to `folder` (lmzoo's HF export of random params, then the tokenizer's files); returns the
    special ids by name ("bos", "end_of_text", "eot", "reserved_0"). says: a token the model then always predicts
    (`always_says`)."""
    import flax.linen as nn
    import jax.numpy as jnp

    from lmzoo.convert import export
    from lmzoo.models import build_model, make_config

    tok = build_tokenizer()
    ids = {
        "bos": tok.token_to_id("<|begin_of_text|>"),
        "end_of_text": tok.token_to_id("<|end_of_text|>"),
        "eot": tok.token_to_id("<|eot_id|>"),
        "reserved_0": tok.token_to_id("<|reserved_special_token_0|>"),
    }
    fields = dict(MODEL, vocab_size=tok.get_vocab_size(), **model)
    net = build_model("llama", make_config("llama", fields))
    params = jax.tree.map(np.asarray, nn.unbox(net.init(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]))
    if says is not None:
        params = always_says(params, tok.token_to_id(says))
    export.export_hf("llama", fields, params, str(folder))
    config = json.loads((folder / "config.json").read_text())
    config |= {"bos_token_id": ids["bos"], "eos_token_id": ids["eot"]}  # as Llama 3 Instruct's config.json
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tok.save(str(folder / "tokenizer.json"))
    added = {
        str(tok.token_to_id(name)): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for name in SPECIALS
    }
    tokenizer_config = {
        "added_tokens_decoder": added,
        "bos_token": "<|begin_of_text|>",
        "chat_template": LLAMA3_TEMPLATE,
        "clean_up_tokenization_spaces": True,
        "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, indent=2)
    )
    generation = {
        "bos_token_id": ids["bos"],
        "eos_token_id": [ids["end_of_text"], ids["eot"]],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return ids


def conversations(count: int) -> list[dict]:
    """`count` chat rows {"messages": [user, assistant]} and as many preference pairs {"prompt", "chosen",
    "rejected"}: (conversations, pairs)."""
    rows, pairs = [], []
    for i in range(count):
        question, answer = CORPUS[i % 4], CORPUS[(i + 1) % 4]
        prompt = [{"role": "user", "content": question}]
        rows.append({"messages": [*prompt, {"role": "assistant", "content": answer}]})
        pairs.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": CORPUS[(i + 2) % 4]}],
            }
        )
    return rows, pairs
