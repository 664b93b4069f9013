"""HH-RLHF comparisons: parsing, held-out split, reward-model and SFT arrays."""

import gzip
import json
import pathlib

import numpy as np
import pytest

from lmzoo import tokenizers
from lmzoo.data import comparisons

REAL_FILE = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "hh_rlhf" / "harmless-base_test.jsonl.gz"
TOKENIZER = tokenizers.ByteTokenizer()
EOS, PAD = TOKENIZER.eos_id, TOKENIZER.pad_id

DIALOGUE = "\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: Tea?\n\nAssistant:"
ROWS = [
    {"chosen": DIALOGUE + " Sure.", "rejected": DIALOGUE + " No."},
    {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: OTHER\n\nAssistant: c"},  # no shared prompt
    {"chosen": "\n\nHuman: Why?\n\nAssistant: Because.", "rejected": "\n\nHuman: Why?\n\nAssistant: Dunno"},
]


def _write(path: pathlib.Path, lines: list[str]) -> str:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("name", ["pairs.jsonl", "pairs.jsonl.gz"])
def test_read_splits_at_the_last_assistant_turn_and_skips_unshared_prompts(tmp_path, name):
    path = _write(tmp_path / name, [json.dumps(row) for row in ROWS])
    read = comparisons.read_comparisons(path)
    assert read == [
        comparisons.Comparison(DIALOGUE, " Sure.", " No."),
        comparisons.Comparison("\n\nHuman: Why?\n\nAssistant:", " Because.", " Dunno"),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"chosen": "x"', "Expecting"),
        ('{"chosen": "\\n\\nAssistant: a"}', '"chosen" and "rejected"'),
        ('["a", "b"]', '"chosen" and "rejected"'),
        ('{"chosen": "\\n\\nAssistant: a", "rejected": "no turn"}', "rejected"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "bad.jsonl", [json.dumps(ROWS[0]), "", line])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{message}"):
        comparisons.read_comparisons(path)


def test_heldout_split_is_deterministic_and_keeps_prompts_together():
    pool = [comparisons.Comparison(f"prompt {i % 50}", f"a{i}", f"b{i}") for i in range(200)]
    train, heldout = comparisons.split_heldout(pool, 0.2, seed=1)
    assert len(train) + len(heldout) == 200 and 0 < len(heldout) < 100
    assert {c.prompt for c in train}.isdisjoint({c.prompt for c in heldout})
    assert comparisons.split_heldout(pool[::-1], 0.2, seed=1) == (train[::-1], heldout[::-1])
    assert comparisons.split_heldout(pool, 0.2, seed=2) != (train, heldout)


def test_reward_model_arrays_right_pad_prompt_response_eos():
    groups = [
        comparisons.as_ranked(comparisons.Comparison("Q:", " yes", " no")),
        comparisons.RankedResponses("P:", (" a", " bb", " c"), (1, 0, 1)),
    ]
    arrays = comparisons.reward_model_arrays(
        groups, TOKENIZER.encode, max_len=8, max_responses=3, pad_id=PAD, eos_id=EOS
    )
    assert arrays["tokens"].shape == (2, 3, 8)
    np.testing.assert_array_equal(arrays["tokens"][0, 0], [*b"Q: yes", EOS, PAD])
    np.testing.assert_array_equal(arrays["tokens"][0, 1], [*b"Q: no", EOS, PAD, PAD])
    np.testing.assert_array_equal(arrays["tokens"][0, 2], [PAD] * 8)
    np.testing.assert_array_equal(arrays["tokens"][1, 1], [*b"P: bb", EOS, PAD, PAD])
    np.testing.assert_array_equal(arrays["ranks"], [[0, 1, 0], [1, 0, 1]])
    np.testing.assert_array_equal(arrays["valid"], [[True, True, False], [True, True, True]])


def test_long_prompts_keep_their_end_and_long_responses_their_start():
    long_prompt = comparisons.RankedResponses("0123456789:", (" ab", " abcdefghijk"), (0, 1))
    tokens = comparisons.reward_model_arrays(
        [long_prompt], TOKENIZER.encode, max_len=10, max_responses=2, pad_id=PAD, eos_id=EOS
    )["tokens"]
    # The longest response needs the whole window, so the prompt keeps its last max_len // 2 = 5 ids,
    # the same for both responses; the long response keeps its start and ends in EOS.
    np.testing.assert_array_equal(tokens[0, 0], [*b"6789: ab", EOS, PAD])
    np.testing.assert_array_equal(tokens[0, 1], [*b"6789: abc", EOS])


def test_pad_must_differ_from_eos():
    with pytest.raises(ValueError, match="pad_id must differ"):
        comparisons.reward_model_arrays([], TOKENIZER.encode, max_len=8, max_responses=2, pad_id=EOS, eos_id=EOS)


def test_sft_arrays_weight_only_response_tokens():
    arrays = comparisons.sft_arrays(
        [comparisons.Comparison("Q:", " yes", " no")], TOKENIZER.encode, max_len=9, pad_id=PAD, eos_id=EOS
    )
    sequence = [*b"Q: yes", EOS]  # 7 ids -> 6 next-token examples
    np.testing.assert_array_equal(arrays["inputs"][0], sequence[:-1] + [PAD] * 3)
    np.testing.assert_array_equal(arrays["targets"][0], sequence[1:] + [PAD] * 3)
    # targets are ": yes<eos>"; only " yes<eos>" (the response) carries loss.
    np.testing.assert_array_equal(arrays["weights"][0], [0, 1, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(arrays["segment_ids"][0], [1] * 6 + [0] * 3)
    np.testing.assert_array_equal(arrays["positions"][0], [0, 1, 2, 3, 4, 5, 0, 0, 0])


@pytest.mark.skipif(not REAL_FILE.exists(), reason="shared HH-RLHF file absent")
def test_real_harmless_base_test_file():
    read = comparisons.read_comparisons(str(REAL_FILE))
    # 2,312 pairs; 5 of them (e.g. line 1255) are different dialogues before the last assistant turn.
    assert len(read) == 2312 - 5
    assert all(c.prompt.endswith(comparisons.ASSISTANT_TURN) and c.prompt.startswith("\n\nHuman:") for c in read)
    assert sum(c.chosen != c.rejected for c in read) > 2200
    train, heldout = comparisons.split_heldout(read, 0.1)
    assert 150 < len(heldout) < 320 and len(train) + len(heldout) == len(read)
    arrays = comparisons.reward_model_arrays(
        [comparisons.as_ranked(c) for c in heldout[:16]],
        TOKENIZER.encode,
        max_len=256,
        max_responses=2,
        pad_id=PAD,
        eos_id=EOS,
    )
    last = 255 - np.argmax(arrays["tokens"][..., ::-1] != PAD, axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(arrays["tokens"], last[..., None], axis=-1), EOS)


def test_packing_keeps_every_example_and_weights_only_the_replies():
    read = comparisons.read_comparisons(str(REAL_FILE))[:12]
    single = comparisons.sft_arrays(read, TOKENIZER.encode, max_len=1024, pad_id=PAD, eos_id=EOS)
    packed = comparisons.pack_examples(single, PAD)
    assert len(packed["inputs"]) < len(read)  # short examples share rows
    replies = []
    for row in range(len(packed["inputs"])):
        for segment in range(1, packed["segment_ids"][row].max() + 1):
            columns = packed["segment_ids"][row] == segment
            np.testing.assert_array_equal(packed["positions"][row, columns], np.arange(columns.sum()))
            weighted = packed["targets"][row, columns][packed["weights"][row, columns] > 0]
            assert weighted[-1] == EOS
            replies.append(weighted[:-1].tolist())
    padding = packed["segment_ids"] == 0
    assert np.all(packed["weights"][padding] == 0) and np.all(packed["inputs"][padding] == PAD)
    assert sorted(replies) == sorted(TOKENIZER.encode(c.chosen) for c in read)


def test_prompts_are_left_padded_and_keep_their_end():
    arrays = comparisons.prompt_arrays(["abc", "abcdefgh"], TOKENIZER.encode, prompt_len=5, pad_id=PAD)
    np.testing.assert_array_equal(arrays["prompts"], [[PAD, PAD, 97, 98, 99], list(b"defgh")])
    np.testing.assert_array_equal(arrays["prompt_mask"], [[0, 0, 1, 1, 1], [1] * 5])
    with pytest.raises(ValueError, match="prompt 0 encodes to no tokens"):
        comparisons.prompt_arrays([""], TOKENIZER.encode, prompt_len=5, pad_id=PAD)


def test_read_splits_are_disjoint_by_prompt_and_need_both_sides(tmp_path):
    splits = comparisons.read_splits(str(REAL_FILE), 0.1, seed=0)
    train_prompts = {c.prompt for c in splits["train"]}
    assert splits["validation"] and not train_prompts & {c.prompt for c in splits["validation"]}
    path = _write(tmp_path / "one.jsonl", [json.dumps(ROWS[0])])
    with pytest.raises(ValueError, match="both sides need at least one"):
        comparisons.read_splits(path, 0.5, seed=0)
