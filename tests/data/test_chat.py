"""Chat rows (lmzoo.data.chat): token ids and assistant masks equal to transformers' `apply_chat_template(...,
return_assistant_tokens_mask=True)` (what trl's SFT `assistant_only_loss` trains on; trl is not a test requirement) on
templates with and without `{% generation %}` blocks, DPO pairs equal to trl's preparation (written out here with
transformers), a few SFT steps on chat rows through the training loop, and the refusals of bad input."""

import gzip
import json
import math
import pathlib
import re

import numpy as np
import pytest

from lmzoo import config as config_lib
from lmzoo import objectives, tokenizers
from lmzoo.data import chat, readers
from lmzoo.objectives import dpo
from lmzoo.train import loop

transformers = pytest.importorskip("transformers", reason="the parity checks need transformers")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<pad>",
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
ROWS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Say café ☕ twice"},
        {"role": "assistant", "content": "café ☕ café ☕"},
    ],
    [{"role": "user", "content": "  leading spaces\nand a newline"}, {"role": "assistant", "content": " ok\n"}],
    [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "thanks"},
    ],
]

# ChatML (Qwen's form) without generation blocks: the assistant's text is found render by render.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The same text, the assistant's marked: its content, <|im_end|> and the newline (what CHATML's renders add).
CHATML_MARKED = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# transformers' documented example: the newline after <|im_end|> is outside the block.
CHATML_DOCS = (
    "{% for message in messages %}{% if (message['role'] != 'assistant') %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% elif (message['role'] == 'assistant')%}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% generation %}{{message['content'] + '<|im_end|>'}}{% endgeneration %}{{'\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama 3's form: bos_token from tokenizer_config.json, trimmed contents.
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA3_MARKED = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> pathlib.Path:
    """A byte-level BPE (GPT-2's pipeline) of 400 ids trained here on the rows, with the templates' special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] for row in ROWS for m in row] + ["system user assistant what is plus the answer is"] * 3
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


def checkpoint_folder(root: pathlib.Path, tokenizer_json: pathlib.Path, template: str, **specials) -> pathlib.Path:
    """An HF tokenizer folder: tokenizer.json and a tokenizer_config.json holding `template`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = {"chat_template": template, "eos_token": "<|endoftext|>", "pad_token": "<pad>", **specials}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def write_jsonl(path: pathlib.Path, rows: list) -> str:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


# ---------------------------------------------------------------------------------------------------------------------
# Ids and assistant masks against transformers


@pytest.mark.parametrize(
    "ours, reference, specials",
    [
        (CHATML_MARKED, CHATML_MARKED, {}),
        (CHATML_DOCS, CHATML_DOCS, {}),
        (CHATML, CHATML_MARKED, {}),
        (LLAMA3, LLAMA3_MARKED, {"bos_token": "<|begin_of_text|>"}),
    ],
    ids=["generation_blocks", "generation_blocks_docs_form", "chatml_render_by_render", "llama3_render_by_render"],
)
def test_ids_and_assistant_masks_equal_transformers(tmp_path, tokenizer_json, ours, reference, specials):
    tokenizer = tokenizers.build_tokenizer("hf_json", path=str(tokenizer_json))
    template = chat.load_template(str(checkpoint_folder(tmp_path / "ours", tokenizer_json, ours, **specials)))
    assert template.has_generation == (ours == reference)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(
        checkpoint_folder(tmp_path / "reference", tokenizer_json, reference, **specials)
    )
    for number, messages in enumerate(ROWS, 1):
        ids, mask = chat.tokenize(template, tokenizer, messages, where=f"row {number}")
        expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(expected["input_ids"]), number
        assert mask == list(expected["assistant_masks"]), number
        assert 0 < sum(mask) < len(mask)


def test_the_date_a_template_prints_is_the_same_every_day(tmp_path, tokenizer_json):
    dated = (
        "{{ bos_token }}Today Date: {{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    folder = checkpoint_folder(tmp_path, tokenizer_json, dated, bos_token="<|begin_of_text|>")
    text, _ = chat.load_template(str(folder)).render(ROWS[2][:2], where="row 1")
    assert text == "<|begin_of_text|>Today Date: 26 Jul 20242 + 2?4"


def test_a_template_file_beside_the_config_wins_and_named_templates_pick_default(tmp_path, tokenizer_json):
    folder = checkpoint_folder(tmp_path, tokenizer_json, "{{ 'from the config' }}")
    (folder / "chat_template.jinja").write_text(CHATML)
    assert chat.load_template(str(folder)).source == str(folder / "chat_template.jinja")  # as transformers reads it
    config = folder / "tokenizer_config.json"
    config.write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]})
    )
    assert chat.load_template(str(config)).text == CHATML


def test_parquet_and_gzipped_jsonl_read_as_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": messages} for messages in ROWS[:2]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    from_jsonl = chat.read_conversations(write_jsonl(tmp_path / "chat.jsonl.gz", rows))
    from_parquet = chat.read_conversations(str(tmp_path / "chat.parquet"))
    assert [c[:3] for c in from_parquet] == [c[:3] for c in from_jsonl]
    assert from_parquet[1].where == f"{tmp_path / 'chat.parquet'}: row 2"
    assert from_jsonl[0].prompt == tuple(ROWS[0][:4]) and from_jsonl[0].chosen == (ROWS[0][4],)  # cut at the last reply
    assert chat.is_chat_file(str(tmp_path / "chat.jsonl.gz"))
    hh = write_jsonl(
        tmp_path / "hh.jsonl", [{"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"}]
    )
    assert not chat.is_chat_file(hh)


def test_sft_rows_weight_exactly_the_targets_that_are_assistant_tokens(tmp_path, tokenizer_json):
    tokenizer = tokenizers.build_tokenizer("hf_json", path=str(tokenizer_json))
    template = chat.load_template(str(checkpoint_folder(tmp_path / "ours", tokenizer_json, CHATML)))
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(
        checkpoint_folder(tmp_path / "ref", tokenizer_json, CHATML_MARKED)
    )
    raw = chat.read_conversations(write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in ROWS]))
    rows = chat.sft_rows(raw, template, tokenizer, seq_len=128, vocab_size=tokenizer.vocab_size, where="train split")
    expected = {}
    for c in raw:  # the shifted reference: the target at t is token t + 1, weighted when that token is the assistant's
        out = hf.apply_chat_template(
            [*c.prompt, *c.chosen], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        expected[tuple(out["input_ids"][:-1])] = (out["input_ids"][1:], out["assistant_masks"][1:])
    found = 0
    for r in range(rows["inputs"].shape[0]):
        for segment in set(rows["segment_ids"][r].tolist()) - {0}:
            at = rows["segment_ids"][r] == segment
            targets, weights = expected[tuple(rows["inputs"][r, at].tolist())]
            np.testing.assert_array_equal(rows["targets"][r, at], targets)
            np.testing.assert_array_equal(rows["weights"][r, at], weights)
            np.testing.assert_array_equal(rows["positions"][r, at], np.arange(at.sum()))
            found += 1
    assert found == len(ROWS)
    assert rows["weights"][rows["segment_ids"] == 0].sum() == 0


# ---------------------------------------------------------------------------------------------------------------------
# DPO pairs against trl's preparation: maybe_extract_prompt, maybe_apply_chat_template, tokenize_row (written out)


def trl_dpo_tokens(hf, row: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) ids as trl's DPOTrainer builds them from a conversational pair: the common first
    messages as the prompt (maybe_extract_prompt), the prompt rendered with the generation prompt, each reply the rest
    of the rendered prompt ⊕ reply (maybe_apply_chat_template), each text tokenized alone and each reply closed by EOS
    (tokenize_row)."""
    chosen, rejected = row["chosen"], row["rejected"]
    if "prompt" in row:
        prompt = row["prompt"]
    else:
        shared = next(k for k, (a, b) in enumerate(zip(chosen, rejected)) if a != b)
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    prompt_text = hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    replies = [
        hf.apply_chat_template(prompt + reply, tokenize=False)[len(prompt_text) :] for reply in (chosen, rejected)
    ]
    encode = lambda text: hf(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(prompt_text), *(encode(reply) + [hf.eos_token_id] for reply in replies)


def test_dpo_pairs_equal_trls_preparation(tmp_path, tokenizer_json):
    tokenizer = tokenizers.build_tokenizer("hf_json", path=str(tokenizer_json))
    folder = checkpoint_folder(tmp_path / "checkpoint", tokenizer_json, CHATML)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    question = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Is tea hot?"}]
    pairs = [
        {
            "chosen": question + [{"role": "assistant", "content": "Yes, usually."}],
            "rejected": question + [{"role": "assistant", "content": "No."}],
        },
        {
            "prompt": ROWS[0][:4],
            "chosen": [{"role": "assistant", "content": "café café"}],
            "rejected": [{"role": "assistant", "content": "tea"}],
        },
    ]
    raw = chat.read_conversations(write_jsonl(tmp_path / "pairs.jsonl", pairs))
    assert raw[0].prompt == tuple(question)  # the implicit prompt: the messages both replies open with
    config = config_lib.load_config_file(ROOT / "configs" / "hh_dpo.py", "tiny")
    config.data.tokenizer.kind, config.data.tokenizer.path = "hf_json", str(folder / "tokenizer.json")
    config.model.vocab_size = tokenizer.vocab_size
    template = chat.template_for(config, lambda name: pytest.fail("no hf: folder to resolve"))
    assert template.source == str(folder / "tokenizer_config.json")  # found beside the run's tokenizer.json
    arrays = dpo.dpo_examples(chat.rendered_comparisons(raw, template), tokenizer, config, "train split")
    for i, row in enumerate(pairs):
        prompt, *replies = trl_dpo_tokens(hf, row)
        assert arrays["prompt_lengths"][i] == len(prompt)
        for k, reply in enumerate(replies):
            assert arrays["tokens"][i, k, : arrays["lengths"][i, k]].tolist() == prompt + reply


# ---------------------------------------------------------------------------------------------------------------------
# SFT on chat rows through the training loop


def test_sft_trains_on_chat_rows_with_the_template_beside_the_tokenizer(tmp_path, tokenizer_json):
    folder = checkpoint_folder(tmp_path / "checkpoint", tokenizer_json, CHATML)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"what is {a} plus {b}?"},
                {"role": "assistant", "content": f"the answer is {a + b}"},
            ]
        }
        for a in range(6)
        for b in range(4)
    ]
    config = config_lib.load_config_file(ROOT / "configs" / "hh_sft.py", "tiny")
    config.data.path = write_jsonl(tmp_path / "chat.jsonl", rows)
    config.data.tokenizer.kind, config.data.tokenizer.path = "hf_json", str(folder / "tokenizer.json")
    config.model.vocab_size = 400
    config.objective.heldout_fraction = 0.25
    config.train.update(steps=2, log_every=1, eval_every=2, checkpoint_every=2)
    workdir = tmp_path / "run"
    loop.train_and_evaluate(config, str(workdir))
    logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in logged if "loss" in row]
    assert losses and all(math.isfinite(loss) for loss in losses)
    splits = readers.CONVERSATIONS.splits(config)
    assert all(chat.holds_conversations(split) for split in splits.values())


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: one line naming the file and row


def test_a_template_that_fails_to_render_names_the_file_and_row(tmp_path, tokenizer_json):
    refuses_tools = (
        "{% for message in messages %}{% if message['role'] not in ('user', 'assistant') %}"
        "{{ raise_exception('roles must be user or assistant') }}{% endif %}{{ message['content'] }}{% endfor %}"
    )
    template = chat.load_template(str(checkpoint_folder(tmp_path / "checkpoint", tokenizer_json, refuses_tools)))
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": ROWS[1]}, {"messages": ROWS[0]}])
    raw = chat.read_conversations(path)
    tokenizer = tokenizers.build_tokenizer("hf_json", path=str(tokenizer_json))
    with pytest.raises(ValueError) as error:
        chat.sft_rows(raw, template, tokenizer, seq_len=64, vocab_size=400, where="train split")
    message = str(error.value)
    assert message.startswith(
        f"{path}: row 2: the chat template of {tmp_path / 'checkpoint' / 'tokenizer_config.json'}"
    )
    assert "TemplateError: roles must be user or assistant" in message and "\n" not in message
    with pytest.raises(ValueError, match=r"tokenizer_config.json: the chat template does not compile"):
        chat.load_template(str(checkpoint_folder(tmp_path / "broken", tokenizer_json, "{% for m in messages %}")))


def test_a_template_cannot_reach_python_internals(tmp_path, tokenizer_json):
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    template = chat.load_template(str(checkpoint_folder(tmp_path, tokenizer_json, escape)))
    with pytest.raises(ValueError, match=r"^row 1: the chat template of .* fails to render this row: SecurityError"):
        template.render(ROWS[1], where="row 1")
    namespace = "{% set ns = namespace() %}{% set ns._x = 1 %}{{ messages }}"
    template = chat.load_template(str(checkpoint_folder(tmp_path, tokenizer_json, namespace)))
    with pytest.raises(ValueError, match="SecurityError"):
        template.render(ROWS[1], where="row 1")


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            r"row 2: no assistant turn in 'messages' \(roles \['user'\]\)",
        ),
        (
            {"text": "hi"},
            r"row 2: no 'messages' \(nor 'chosen' and 'rejected', nor 'prompt'\) field; it has \['text'\]",
        ),
        (
            {"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
            r"row 2: no assistant turn in the chosen reply",
        ),
        (
            {"messages": [{"content": "hi"}]},
            r"row 2: 'messages' must be a list of messages, each an object with a string 'role'",
        ),
        ({"chosen": "\n\nHuman: a", "rejected": [{"role": "user", "content": "b"}]}, r"row 2: 'chosen' is a string"),
    ],
    ids=[
        "no_assistant_turn",
        "no_messages",
        "pair_without_assistant_reply",
        "message_without_role",
        "hh_string_in_chat_file",
    ],
)
def test_bad_rows_name_the_file_and_row(tmp_path, row, message):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": ROWS[1]}, row])
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: {message}") as error:
        chat.read_conversations(path)
    assert "\n" not in str(error.value)  # one line


def test_a_prompt_only_row_is_a_prompt_to_sample_from_and_refused_where_replies_are_trained(tmp_path, tokenizer_json):
    """trl's prompt-only form {"prompt": [messages]} (GRPO's datasets): a Conversation with no reply, which the policy
    methods sample from; SFT and DPO, which train on replies, refuse it naming the row."""
    template = chat.load_template(str(checkpoint_folder(tmp_path / "checkpoint", tokenizer_json, CHATML)))
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": ROWS[1][:1]}])
    assert chat.is_chat_file(path)
    (row,) = chat.read_conversations(path)
    assert row.prompt == tuple(ROWS[1][:1]) and row.chosen == () and row.rejected is None
    tokenizer = tokenizers.build_tokenizer("hf_json", path=str(tokenizer_json))
    with pytest.raises(ValueError, match=r"prompts.jsonl: row 1: a prompt-only row; sft trains on replies"):
        chat.sft_rows([row], template, tokenizer, seq_len=64, vocab_size=300, where="train")
    with pytest.raises(ValueError, match=r"prompts.jsonl: row 1: a prompt-only row; preference training reads pairs"):
        chat.rendered_comparisons([row], template)


def test_dpo_refuses_a_messages_row_and_a_run_without_a_template(tmp_path, tokenizer_json):
    template = chat.load_template(str(checkpoint_folder(tmp_path / "checkpoint", tokenizer_json, CHATML)))
    raw = chat.read_conversations(write_jsonl(tmp_path / "chat.jsonl", [{"messages": ROWS[1]}]))
    with pytest.raises(ValueError, match=r"chat.jsonl: row 1: a 'messages' row; preference training reads pairs"):
        chat.rendered_comparisons(raw, template)
    config = config_lib.load_config_file(ROOT / "configs" / "hh_sft.py", "tiny")  # a byte tokenizer: no folder
    config.data.path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": ROWS[1]}])
    with pytest.raises(ValueError, match=r"set config.objective.chat_template to a tokenizer_config.json"):
        objectives.build(config).check()  # when the config is checked, before a model is built
    config.objective.chat_template = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="missing' does not exist"):
        chat.template_for(config, str)
