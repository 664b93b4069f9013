"""configs/llama_sft.py end to end, shrunk (`:tiny`): the base stage, LoRA SFT over it on HH-RLHF's dialogues as chat
rows (`chat.hh_rows`, what scripts/hh_chat.py writes), then LoRA DPO from the SFT run. What each stage promises is
checked on the runs it wrote: the loss is on the assistant turns only, training moves the adapters and leaves the base
as the base run saved it, the DPO reference is the SFT run's merged model, and the DPO run loads merged."""

import json
import math
import pathlib
import types

import jax
import numpy as np
import pytest
from flax import traverse_util

import lmzoo
from lmzoo import config as config_lib
from lmzoo import lora, tokenizers
from lmzoo.data import chat, comparisons
from lmzoo.train import loop
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
HH = ROOT.parent / "shared" / "data" / "hh_rlhf" / "harmless-base_test.jsonl.gz"
ASSISTANT_HEADER, END_OF_TURN = b"<|start_header_id|>assistant<|end_header_id|>\n\n", b"<|eot_id|>"

pytestmark = pytest.mark.skipif(not HH.is_file(), reason="needs ../shared/data/hh_rlhf")


def recipe(variant: str, workdir: pathlib.Path, **fields):
    """configs/llama_sft.py:`variant` with two steps (one checkpoint, one evaluation of one batch) and `fields`."""
    config = config_lib.load_config_file(ROOT / "configs" / "llama_sft.py", variant)
    config.train.update(steps=2, eval_every=2, checkpoint_every=2, log_every=1)
    config.optim.decay_steps, config.eval.max_batches = 2, 1
    for key, value in fields.items():
        section, name = key.split(".") if "." in key else (None, key)
        (config[section] if section else config)[name] = value
    loop.train_and_evaluate(config, str(workdir))
    return workdir


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The three runs of the recipe, on the chat rows of HH-RLHF's first 96 comparisons."""
    root = tmp_path_factory.mktemp("llama_sft")
    rows = [chat.hh_rows(c) for c in comparisons.read_comparisons(str(HH))[:96]]
    for name, column in (("conversations.jsonl", 0), ("pairs.jsonl", 1)):
        (root / name).write_text("".join(json.dumps(row[column]) + "\n" for row in rows))
    base = recipe("tiny,base", root / "base")
    sft = recipe("tiny", root / "sft", init_from=f"ckpt:{base}", **{"data.path": str(root / "conversations.jsonl")})
    dpo = recipe("tiny,dpo", root / "dpo", **{"objective.sft": f"ckpt:{sft}", "data.path": str(root / "pairs.jsonl")})
    return types.SimpleNamespace(base=str(base), sft=str(sft), dpo=str(dpo))


def test_an_hh_comparison_becomes_a_conversation_and_a_pair():
    dialogue = "\n\nHuman: hi there\n\nAssistant: Hello.\n\nHuman: Bye?\n\nAssistant:"
    conversation, pair = chat.hh_rows(comparisons.Comparison(dialogue, " Bye!", " No."))
    prompt = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye?"},
    ]
    assert conversation == {"messages": [*prompt, {"role": "assistant", "content": "Bye!"}]}
    assert pair == {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "Bye!"}],
        "rejected": [{"role": "assistant", "content": "No."}],
    }
    with pytest.raises(ValueError, match="starts with"):
        chat.hh_messages("Human: no leading blank line")


def assistant_bytes(sequence: np.ndarray) -> np.ndarray:
    """1 on each byte of an assistant turn of a Llama 3 chat rendering: its content and <|eot_id|>, read here from the
    bytes (a turn cut by the row's end runs to it)."""
    text, mark = bytes(sequence.astype(np.uint8).tolist()), np.zeros(len(sequence), np.float32)
    start = text.find(ASSISTANT_HEADER)
    while start >= 0:
        start += len(ASSISTANT_HEADER)
        end = text.find(END_OF_TURN, start)
        end = len(text) if end < 0 else end + len(END_OF_TURN)
        mark[start:end] = 1
        start = text.find(ASSISTANT_HEADER, end)
    return mark


def test_sft_weights_exactly_the_assistant_turns(chain):
    run = run_lib.build(run_lib.load_saved(chain.sft), chain.sft)
    run.close()
    raw = run.objective.read()["train"]
    rows = run.objective.examples(tokenizers.build_tokenizer("byte"), raw, "train split")
    segments = 0
    for r in range(rows["inputs"].shape[0]):
        for segment in set(rows["segment_ids"][r].tolist()) - {0}:
            at = rows["segment_ids"][r] == segment
            sequence = np.append(rows["inputs"][r, at], rows["targets"][r, at][-1])
            # the target at t is byte t + 1: weighted exactly when that byte is the assistant's
            np.testing.assert_array_equal(rows["weights"][r, at], assistant_bytes(sequence)[1:])
            segments += 1
    assert segments >= 0.9 * len(raw)  # the few whose first reply begins past the window are skipped, with a count
    assert 0 < rows["weights"].sum() < (rows["segment_ids"] > 0).sum()  # users' turns and headers are not trained on


def test_sft_trains_the_adapters_and_leaves_the_base(chain):
    saved = run_lib.load_saved(chain.sft)
    adapted = lora.from_config(saved)
    run = run_lib.build(saved, chain.sft)
    _, state, _ = run.checkpointer.restore_latest(run.abstract_state)
    run.close()
    adapters = traverse_util.flatten_dict(jax.device_get(state.params))
    assert {path[-1] for path in adapters} == {"lora_a", "lora_b"}  # the checkpoint holds the adapters alone
    assert len(adapters) == 2 * 7 * saved.model.num_layers  # all seven projections of every layer
    assert all(np.abs(leaf).max() > 0 for path, leaf in adapters.items() if path[-1] == "lora_b")  # B starts at 0

    base, merged = lmzoo.load(chain.base).params, lmzoo.load(chain.sft).params
    expected = jax.device_get(lora.merge(base, jax.device_get(state.params), adapted))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), merged, expected)
    targets = {path[:-1] for path in adapters}
    flat_base, flat_merged = traverse_util.flatten_dict(base), traverse_util.flatten_dict(merged)
    untouched = [path for path in flat_base if path[:-1] not in targets]
    assert any("embed" in "/".join(path) for path in untouched)
    for path in untouched:  # embeddings and norms: the base run's, bit for bit
        np.testing.assert_array_equal(flat_merged[path], flat_base[path])


def test_dpo_starts_from_the_sft_model_as_its_reference(chain):
    run = run_lib.build(run_lib.load_saved(chain.dpo), chain.dpo)
    reference = jax.device_get(run_lib.load_frozen(run)["reference"])
    run.close()
    sft = lmzoo.load(chain.sft).params
    jax.tree.map(np.testing.assert_array_equal, reference, sft)
    first = json.loads((pathlib.Path(chain.dpo) / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["split"] == "train"
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference: every margin is 0


def test_the_dpo_run_loads_as_the_sft_model_plus_its_adapters(chain):
    saved = run_lib.load_saved(chain.dpo)
    run = run_lib.build(saved, chain.dpo)
    step, state, _ = run.checkpointer.restore_latest(run.abstract_state)
    run.close()
    loaded = lmzoo.load(chain.dpo)
    assert step == loaded.step == 2 and loaded.config.objective.name == "dpo"
    sft = lmzoo.load(chain.sft).params
    expected = jax.device_get(lora.merge(sft, jax.device_get(state.params), lora.from_config(saved)))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), loaded.params, expected)
    moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(sft), strict=True)]
    assert max(moved) > 0
