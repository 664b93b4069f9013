"""Tests for lmzoo.tokenizers on the real files in shared/data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lmzoo.tokenizers import (
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    WordTokenizer,
    build_tokenizer,
    from_spec,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
GPT2 = DATA / "tokenizers" / "gpt2"
BERT = DATA / "tokenizers" / "bert_uncased"
PTB = DATA / "ptb"
UNICODE = "Café déjà vu — 中文 text 🙂🎉\n  two  spaces\ttab"
ASCII = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak."


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"shared data not found at {path} (expected shared/ beside the repo checkout)")
    return path


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return need(SHAKESPEARE).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def gpt2() -> HFTokenizer:
    return HFTokenizer.gpt2(str(need(GPT2) / "vocab.json"), str(GPT2 / "merges.txt"))


@pytest.fixture(scope="module")
def wordpiece() -> HFTokenizer:
    return HFTokenizer.wordpiece(str(need(BERT) / "vocab.txt"))


@pytest.fixture(scope="module")
def spm_bpe(shakespeare: str) -> SentencePieceTokenizer:
    return SentencePieceTokenizer.train(
        [shakespeare[:20000]], vocab_size=400, model_type="bpe", user_defined_symbols=("[MASK]",), extra_ids=4
    )


@pytest.fixture(scope="module")
def spm_unigram(shakespeare: str) -> SentencePieceTokenizer:
    return SentencePieceTokenizer.train([shakespeare[:20000]], vocab_size=400, model_type="unigram")


def test_char_tiny_shakespeare_matches_nanogpt(shakespeare: str) -> None:
    tok = CharTokenizer.from_corpus([shakespeare])
    chars = sorted(set(shakespeare))
    assert len(chars) == 65 and tok.vocab_size == 66 and tok.eos_id == 65
    assert tok.encode("".join(chars)) == list(range(65))
    assert tok.decode(tok.encode(shakespeare[:5000])) == shakespeare[:5000]
    assert tok.decode(tok.encode("ab") + [tok.eos_id]) == "ab<eos>"
    assert tok.pad_id is None


def test_char_unknown_character_raises() -> None:
    tok = CharTokenizer.from_corpus(["abc"])
    with pytest.raises(ValueError, match=r"'z'.*training corpus"):
        tok.encode("abz")


def test_char_specials_and_pad_skipped() -> None:
    tok = CharTokenizer("ab", specials=("<eos>", "<pad>", "<mask>"))
    assert (tok.eos_id, tok.pad_id, tok.mask_id) == (2, 3, 4)
    assert tok.decode([0, 3, 1, 2, 3]) == "ab<eos>"
    assert tok.token_char_lengths().tolist() == [1, 1, 0, 0, 0]


def test_word_ptb_matches_mikolov_counts() -> None:
    # shared/data README: PTB train has 929,589 tokens+eos and a 10,000-word vocabulary counting <eos>.
    texts = {split: (need(PTB) / f"ptb.{split}.txt").read_text() for split in ("train", "valid", "test")}
    tok = WordTokenizer.from_corpus([texts["train"]])
    assert tok.vocab_size == 10000
    assert tok.words[:3] == ("the", "<unk>", "N")  # most frequent first
    assert tok.eos_id == 9999 and tok.unk_id == 1 and tok.pad_id is None
    for split, expected in (("train", 929589), ("valid", 73760), ("test", 82430)):
        ids = tok.encode(texts[split])
        assert len(ids) == expected, split
        assert ids.count(tok.eos_id) == texts[split].count("\n"), split
        # The valid and test words all belong to the train vocabulary: <unk> only where the text says so.
        assert ids.count(tok.unk_id) == texts[split].split().count("<unk>"), split
    first_line = texts["test"].split("\n")[0]
    assert tok.decode(tok.encode(first_line + "\n")) == " ".join(first_line.split()) + "\n"


def test_word_unknown_maps_to_unk_and_lines_end_with_eos() -> None:
    tok = WordTokenizer.from_corpus(["a b b <unk>\nc c c"], specials=("<eos>", "<pad>"))
    assert tok.words == ("c", "b", "<unk>", "a")
    assert (tok.eos_id, tok.pad_id, tok.unk_id) == (4, 5, 2)
    assert tok.encode("a  zebra\n\nc") == [3, 2, 4, 4, 0]
    assert tok.decode([3, 5, 1, 4, 0, 4]) == "a b\nc\n"
    np.testing.assert_array_equal(tok.token_char_lengths(), [1, 1, 5, 1, 0, 0])


def test_byte_round_trip_and_specials() -> None:
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 256, 257)
    ids = tok.encode(UNICODE)
    assert tok.decode(ids) == UNICODE
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == UNICODE + "<eos>"
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"
    assert int(tok.token_char_lengths()[ids].sum()) == len(UNICODE)


@pytest.mark.parametrize("name", ["spm_bpe", "spm_unigram"])
def test_sentencepiece_lossless_round_trip(name: str, request: pytest.FixtureRequest, shakespeare: str) -> None:
    tok = request.getfixturevalue(name)
    assert (tok.pad_id, tok.eos_id, tok.unk_id, tok.bos_id) == (0, 1, 2, None)
    for text in (UNICODE, shakespeare[30000:32000]):
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch([UNICODE, ASCII]) == [tok.encode(UNICODE), tok.encode(ASCII)]
    ids = tok.encode(ASCII)
    assert int(tok.token_char_lengths()[ids].sum()) == len(ASCII)


def test_sentencepiece_sentinels_and_user_symbols(spm_bpe: SentencePieceTokenizer) -> None:
    tok = spm_bpe
    assert tok.vocab_size == 404
    assert tok.sentinel_id(0) == tok.vocab_size - 1 and tok.sentinel_id(3) == tok.vocab_size - 4
    assert tok.decode(tok.encode("to be") + [tok.sentinel_id(0), tok.sentinel_id(1)]) == "to be<extra_id_0><extra_id_1>"
    assert tok.mask_id is not None and tok.cls_id is None and tok.sep_id is None
    assert tok.encode("[MASK]") == [tok.mask_id]
    with pytest.raises(IndexError, match="extra_ids=4"):
        tok.sentinel_id(4)


def test_gpt2_reference_ids(gpt2: HFTokenizer) -> None:
    assert gpt2.encode("Hello world") == [15496, 995]
    assert (gpt2.vocab_size, gpt2.eos_id, gpt2.bos_id, gpt2.pad_id) == (50257, 50256, 50256, None)
    assert gpt2.decode(gpt2.encode(UNICODE)) == UNICODE
    assert gpt2.encode_batch(["Hello world", UNICODE]) == [[15496, 995], gpt2.encode(UNICODE)]
    lengths = gpt2.token_char_lengths()
    assert lengths.shape == (50257,) and lengths[50256] == 0
    assert int(lengths[gpt2.encode(ASCII)].sum()) == len(ASCII)


def test_wordpiece_reference_ids(wordpiece: HFTokenizer) -> None:
    tok = wordpiece
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 100, 101, 102, 103)
    assert tok.vocab_size == 30522 and tok.eos_id is None
    assert tok.encode("hello world") == [7592, 2088]
    assert tok.encode("Hello [MASK]") == [7592, 103]
    text = "The Quick brown fox, tokenizing sentences."
    assert tok.decode(tok.encode(text)) == text.lower()
    assert tok.decode([101, 7592, 0, 0]) == "[CLS] hello"


def test_hf_json_discovers_specials_without_template() -> None:
    tok = HFTokenizer.from_file(str(need(BERT) / "tokenizer.json"))
    assert tok.encode("hello world") == [7592, 2088]
    assert tok.special_ids == {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}


def _all_tokenizers(request: pytest.FixtureRequest) -> dict[str, Tokenizer]:
    return {
        "char": CharTokenizer.from_corpus([UNICODE, ASCII]),
        "word": WordTokenizer.from_corpus([UNICODE, ASCII]),
        "byte": ByteTokenizer(),
        "spm_bpe": request.getfixturevalue("spm_bpe"),
        "spm_unigram": request.getfixturevalue("spm_unigram"),
        "gpt2": request.getfixturevalue("gpt2"),
        "wordpiece": request.getfixturevalue("wordpiece"),
    }


def test_save_from_spec_round_trip(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    for name, tok in _all_tokenizers(request).items():
        spec = json.loads(json.dumps(tok.save(str(tmp_path / name))))
        loaded = from_spec(spec, base_dir=str(tmp_path / name))
        assert type(loaded) is type(tok), name
        assert loaded.vocab_size == tok.vocab_size, name
        assert loaded.special_ids == tok.special_ids, name
        assert loaded.encode_batch([UNICODE, ASCII]) == tok.encode_batch([UNICODE, ASCII]), name
        assert (loaded.token_char_lengths() == tok.token_char_lengths()).all(), name
        assert (loaded.token_byte_lengths() == tok.token_byte_lengths()).all(), name


def test_byte_lengths_sum_to_the_utf8_size_of_the_text(request: pytest.FixtureRequest) -> None:
    """Bits per byte: the lossless tokenizers count every UTF-8 byte of a text once (byte-level pieces of a
    multi-byte character included); word-level ones count the words' bytes; specials count 0."""
    for name, tok in _all_tokenizers(request).items():
        lengths = tok.token_byte_lengths()
        assert lengths.shape == (tok.vocab_size,) and not lengths[list(tok.special_ids.values())].any(), name
        if name in ("word", "wordpiece"):
            words = ["tokenizing", "text"] if name == "wordpiece" else UNICODE.split()  # wordpiece: "##izing"
            assert int(lengths[tok.encode(" ".join(words))].sum()) == len("".join(words).encode()), name
        else:
            assert int(lengths[tok.encode(UNICODE)].sum()) == len(UNICODE.encode()), name


def test_build_tokenizer_kinds(shakespeare: str, tmp_path: Path) -> None:
    assert build_tokenizer("char", corpus=[shakespeare]).vocab_size == 66
    assert build_tokenizer("byte").vocab_size == 258
    assert build_tokenizer("word", corpus=[ASCII]).encode("All:\nSpeak, speak.") == [1, 12, 5, 0]
    trained = build_tokenizer("sentencepiece", corpus=[shakespeare[:20000]], vocab_size=400, extra_ids=2)
    trained.save(str(tmp_path))
    loaded = build_tokenizer("sentencepiece", path=str(tmp_path / "spm.model"), extra_ids=2)
    assert loaded.encode(ASCII) == trained.encode(ASCII) and loaded.vocab_size == 402
    assert build_tokenizer("gpt2", path=str(need(GPT2))).encode("Hello world") == [15496, 995]
    assert build_tokenizer("wordpiece", path=str(BERT / "vocab.txt")).encode("hello world") == [7592, 2088]
    assert build_tokenizer("hf_json", path=str(BERT / "tokenizer.json")).cls_id == 101


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown tokenizer kind 'bpe'.*char, byte, sentencepiece"):
        build_tokenizer("bpe")
    with pytest.raises(ValueError, match="needs corpus="):
        build_tokenizer("char")
    with pytest.raises(ValueError, match="'word' needs corpus="):
        build_tokenizer("word")
    with pytest.raises(ValueError, match="'Speak' is not in the vocabulary, which has no <unk>"):
        WordTokenizer.from_corpus(["speak"]).encode("Speak")
    with pytest.raises(ValueError, match="vocab_size="):
        build_tokenizer("sentencepiece", corpus=["abc"])
    with pytest.raises(FileNotFoundError, match=r"GPT-2 BPE needs vocab.json and merges.txt; not found: .*vocab.json"):
        build_tokenizer("gpt2", path=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"vocab.txt; not found: .*missing.txt"):
        build_tokenizer("wordpiece", path=str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json; not found"):
        build_tokenizer("hf_json", path=str(tmp_path / "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match=r"\.model file; not found: .*nope.model"):
        SentencePieceTokenizer.load(str(tmp_path / "nope.model"))


def test_char_tokenizer_leaves_out_and_counts_characters_it_never_saw():
    """A character-level run scoring other text (eval.py --data): characters outside the vocabulary are left out of
    what stores and scoring read, and `unknown_fraction` reports their share (issue 27)."""
    tokenizer = CharTokenizer.from_corpus(["abc "])
    assert tokenizer.encode_batch(["a [b] c"]) == [tokenizer.encode("a b c")]
    assert tokenizer.unknown_fraction("a [b] c") == pytest.approx(2 / 7)
    assert ByteTokenizer().unknown_fraction("anything [at] all") == 0.0
    with pytest.raises(ValueError, match="not in the character vocabulary"):
        tokenizer.encode("[")
