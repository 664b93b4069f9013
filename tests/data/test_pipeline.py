import numpy as np
import pytest

from lmzoo import tokenizers
from lmzoo.data import pipeline, sources, tfds_text, transforms
from lmzoo.data.store import TokenSplit
from lmzoo.objectives import text_to_text


def _stream():
    return TokenSplit.from_documents([[5, 6, 7], [8, 9], [10, 11, 12, 13]], eos_id=1)


def one_document(tokens: np.ndarray) -> TokenSplit:
    return TokenSplit([tokens], [np.zeros(1, np.int64)])


def test_lm_windows_segments_positions_and_weights():
    stream = _stream()  # 5 6 7 1 | 8 9 1 | 10 11 12 13 1
    batch = transforms.lm_windows(*stream.windows(np.array([2]), 7))
    np.testing.assert_array_equal(batch["inputs"], [[7, 1, 8, 9, 1, 10]])
    np.testing.assert_array_equal(batch["targets"], [[1, 8, 9, 1, 10, 11]])
    np.testing.assert_array_equal(batch["weights"], [[1, 0, 1, 1, 0, 1]])
    np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 2, 2, 2, 3]])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 0, 1, 2, 0]])


def test_window_past_the_end_is_padding():
    stream = _stream()
    batch = transforms.lm_windows(*stream.windows(np.array([8]), 7))  # 11 12 13 1 | end
    np.testing.assert_array_equal(batch["weights"], [[1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 1, 1, 0, 0]])


@pytest.mark.parametrize("sampler", ["random", "sequential"])
def test_loader_is_deterministic_random_access_and_sharded(sampler):
    stream = one_document(np.arange(1000, dtype=np.int32) % 50)
    loader = pipeline.LMLoader([stream], batch_size=8, seq_len=16, seed=3, sampler=sampler)
    again = pipeline.LMLoader([stream], batch_size=8, seq_len=16, seed=3, sampler=sampler)
    for step in (0, 5, 100):
        for k, v in loader.batch(step).items():
            np.testing.assert_array_equal(v, again.batch(step)[k])
    assert not np.array_equal(loader.batch(0)["inputs"], loader.batch(1)["inputs"])
    halves = [
        pipeline.LMLoader([stream], 8, 16, seed=3, sampler=sampler, process_index=i, process_count=2).batch(7)
        for i in range(2)
    ]
    np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves]), loader.batch(7)["inputs"])


def test_sequential_sampler_visits_every_window_once_per_epoch():
    stream = one_document(np.arange(161, dtype=np.int32))
    loader = pipeline.LMLoader([stream], batch_size=2, seq_len=16, seed=0, sampler="sequential")
    starts = sorted(int(loader.batch(s)["inputs"][r, 0]) for s in range(5) for r in range(2))
    assert starts == list(range(0, 160, 16))


def test_eval_batches_cover_every_target_once():
    stream = one_document(np.arange(100, dtype=np.int32))
    batches = list(pipeline.eval_batches([stream], batch_size=4, seq_len=16))
    targets = np.concatenate([b["targets"][b["weights"] > 0] for b in batches])
    np.testing.assert_array_equal(np.sort(targets), np.arange(1, 100))


def test_eval_batches_of_a_mixture_cover_every_store_once_and_shard_by_process():
    web, code = one_document(np.arange(100, dtype=np.int32)), one_document(np.arange(1000, 1037, dtype=np.int32))
    seen = []
    batches = list(
        pipeline.eval_batches(
            [web, code], batch_size=4, seq_len=16, transform=lambda b, ids, e: {**b, "ids": ids, "epochs": e}
        )
    )
    targets = np.concatenate([b["targets"][b["weights"] > 0] for b in batches])
    np.testing.assert_array_equal(np.sort(targets), np.concatenate([np.arange(1, 100), np.arange(1001, 1037)]))
    for b in batches:
        seen += [int(i) for i, w in zip(b["ids"], b["weights"].sum(1), strict=True) if w > 0]
    assert seen == list(range(0, 99, 16)) + [100 + s for s in range(0, 36, 16)]  # starts, counted through the splits
    assert all(not b["epochs"].any() for b in batches)
    halves = [list(pipeline.eval_batches([web, code], 4, 16, process_index=i, process_count=2)) for i in range(2)]
    for whole, first, second in zip(batches, *halves, strict=True):
        np.testing.assert_array_equal(np.concatenate([first["targets"], second["targets"]]), whole["targets"])
    with pytest.raises(ValueError, match="the validation split is empty"):
        next(pipeline.eval_batches([one_document(np.zeros(1, np.int32))], 4, 16))


def test_seq2seq_eval_padding_rows_have_no_weight():
    """The rows padding the last evaluation batch carry no targets (their denoised form is just EOS)."""
    stream = one_document(np.arange(2, 22, dtype=np.int32))
    noise = lambda tokens, rng: {"inputs": np.append(tokens[::2], 1), "targets": np.append(tokens, 1)}  # noqa: E731

    def transform(batch, ids, epochs):
        return transforms.seq2seq_from_windows(
            batch, ids, epochs, noise=noise, seed=0, inputs_length=8, targets_length=9, pad_id=0, decoder_start_id=1
        )

    (batch,) = pipeline.eval_batches([stream], batch_size=4, seq_len=8, transform=transform)
    np.testing.assert_array_equal(
        batch["weights"].sum(axis=1), [9, 9, 5, 0]
    )  # windows of 8, 8, 4 tokens + EOS; padding
    np.testing.assert_array_equal(batch["targets"][0], np.append(np.arange(2, 10), 1))


def test_check_token_ids():
    transforms.check_token_ids(np.array([0, 31]), 32, where="x")
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        transforms.check_token_ids(np.array([0, 32]), 32, where="train split")
    with pytest.raises(ValueError, match="token id -1 is negative; .* the tokenizer .* not config.model.vocab_size"):
        transforms.check_token_ids(np.array([-1, 3]), 32, where="train split")


def test_local_text_sources(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.jsonl").write_text('{"text": "second"}\n{"text": "third"}\n')
    assert sources.read_local_text(str(tmp_path)) == ["first document", "second", "third"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sources.read_local_text(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text found"):
        sources.read_local_text(str(tmp_path / "empty"))
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="has no field 'text'"):
        sources.read_local_text(str(tmp_path / "bad.jsonl"))


def test_split_by_characters_for_one_document_else_by_documents():
    train, val = sources.split_documents(["abcdefghij"], 0.1)
    assert (train, val) == (["abcdefghi"], ["j"])
    train, val = sources.split_documents([str(i) for i in range(10)], 0.2)
    assert len(train) == 8 and val == ["8", "9"]
    train, val = sources.split_documents([str(i) for i in range(10)], 0.0005)  # too small a fraction: one held out
    assert len(train) == 9 and val == ["9"]


def test_loader_rejects_too_little_data():
    with pytest.raises(ValueError, match="fewer than seq_len"):
        pipeline.LMLoader([one_document(np.zeros(10, np.int32))], 2, 16, seed=0)


def test_tfds_source_built_locally(tmp_path):
    name = tfds_text.prepare_text_dataset(str(tmp_path), {"train": ["hello world", "abc"], "validation": ["xyz"]})
    assert list(sources.iter_tfds(name, "train", str(tmp_path), "text")) == ["hello world", "abc"]
    tokenizer = tokenizers.ByteTokenizer()
    split = TokenSplit.from_documents(
        tokenizer.encode_batch(list(sources.iter_tfds(name, "validation", str(tmp_path), "text"))), tokenizer.eos_id
    )
    assert split.document(0).tolist() == list(b"xyz") + [256]
    with pytest.raises(FileNotFoundError, match="not prepared"):
        list(sources.iter_tfds("lmzoo_text", "train", str(tmp_path / "nowhere"), "text"))


def test_gpt_classifier_example_layout_and_truncation():
    ex = transforms.gpt_classifier_example([5, 6, 7], [8, 9], start_id=1, delim_id=2, extract_id=3, max_len=9, pad_id=0)
    np.testing.assert_array_equal(ex["tokens"], [1, 5, 6, 7, 2, 8, 9, 3, 0])
    np.testing.assert_array_equal(ex["segment_ids"], [1, 1, 1, 1, 1, 1, 1, 1, 0])
    short = transforms.gpt_classifier_example(
        [5, 6, 7, 8], [9], start_id=1, delim_id=2, extract_id=3, max_len=6, pad_id=0
    )
    np.testing.assert_array_equal(short["tokens"], [1, 5, 6, 2, 9, 3])


def test_whole_word_masking_through_mask_rows():
    vocab = ["[PAD]", "[MASK]", "un", "##aff", "##able", "play", "##ing", "dog"]
    continuation = transforms.continuation_mask_from_vocab(vocab)
    tokens = np.tile(np.array([[2, 3, 4, 5, 6, 7, 2, 3, 4, 7]]), (64, 1))
    out = transforms.mask_rows(
        tokens,
        np.arange(64),
        np.zeros(64, int),
        seed=0,
        static=True,
        continuation_mask=continuation,
        mask_id=1,
        vocab_size=8,
        special_ids=[0, 1],
        rate=0.3,
    )
    selected = out["weights"] > 0
    words = [(0, 3), (3, 5), (5, 6), (6, 9), (9, 10)]
    for start, end in words:
        assert np.all(selected[:, start:end].all(axis=1) | ~selected[:, start:end].any(axis=1))


def test_text_pairs_from_a_split_marker_or_two_fields(tmp_path):
    import gzip
    import json

    dialogues = tmp_path / "d.jsonl.gz"
    with gzip.open(dialogues, "wt", encoding="utf-8") as f:
        for text in (
            "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: bye\n\nAssistant: see you",
            "\n\nHuman: a\n\nAssistant: b",
        ):
            f.write(json.dumps({"chosen": text}) + "\n")
    pairs = sources.read_text_pairs(str(dialogues), ("chosen",), "\n\nAssistant:")
    assert pairs == [
        ("\n\nHuman: hi\n\nAssistant: hello\n\nHuman: bye\n\nAssistant:", " see you"),
        ("\n\nHuman: a\n\nAssistant:", " b"),
    ]
    table = tmp_path / "t.tsv"
    table.write_text("en\tde\ncat\tKatze\ndog\tHund\n", encoding="utf-8")
    assert sources.read_text_pairs(str(table), ("en", "de")) == [("cat", "Katze"), ("dog", "Hund")]
    with pytest.raises(ValueError, match="no '\\\\n\\\\nRobot:'"):
        sources.read_text_pairs(str(dialogues), ("chosen",), "\n\nRobot:")
    with pytest.raises(ValueError, match=r"columns \['fr'\] not in the header"):
        sources.read_text_pairs(str(table), ("en", "fr"))
    with pytest.raises(ValueError, match="at least 2"):
        (tmp_path / "one.tsv").write_text("en\tde\ncat\tKatze\n", encoding="utf-8")
        sources.read_text_pairs(str(tmp_path / "one.tsv"), ("en", "de"))


def test_text_pair_examples_keep_the_source_end_and_the_target_start():
    tokenizer = tokenizers.CharTokenizer.from_corpus(["abcdefghij"], specials=("<pad>", "<eos>"))
    examples = text_to_text.text_pair_examples(
        [("abcdefgh", "ijab"), ("ab", "c")], tokenizer, inputs_length=5, targets_length=3
    )
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    assert pad is not None
    assert tokenizer.decode(examples["inputs"][0, :4].tolist()) == "efgh" and examples["inputs"][0, 4] == eos
    assert tokenizer.decode(examples["targets"][0, :2].tolist()) == "ij" and examples["targets"][0, 2] == eos
    rows = text_to_text.text_pair_rows(examples, np.arange(2), np.zeros(2, int), pad_id=pad, decoder_start_id=7)
    np.testing.assert_array_equal(rows["decoder_inputs"][:, 0], [7, 7])
    np.testing.assert_array_equal(rows["decoder_inputs"][:, 1:], examples["targets"][:, :-1])
    np.testing.assert_array_equal(rows["encoder_segment_ids"][1], [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(rows["weights"][1], [1, 1, 0])
    with pytest.raises(ValueError, match="needs a tokenizer with <pad>"):
        text_to_text.text_pair_examples(
            [("ab", "c")], tokenizers.CharTokenizer.from_corpus(["abc"]), inputs_length=5, targets_length=3
        )


def test_shift_right():
    np.testing.assert_array_equal(transforms.shift_right(np.array([[5, 6, 7]]), 0), [[0, 5, 6]])


def test_truncated_lengths_follow_bert_truncate_seq_pair():
    def reference(a, b, budget):
        while a + b > budget:
            if a > b:
                a -= 1
            else:
                b -= 1
        return a, b

    for a in range(12):
        for b in range(12):
            for budget in range(25):
                assert transforms.truncated_lengths(a, b, budget) == reference(a, b, budget), (a, b, budget)


def test_a_corpus_smaller_than_one_batch_is_warned_about(caplog):
    with caplog.at_level("WARNING"):
        pipeline.LMLoader([one_document(np.arange(40, dtype=np.int32))], batch_size=4, seq_len=32, seed=0)
    assert "the training data has 40 tokens, fewer than one batch of 4 x 32" in caplog.text
