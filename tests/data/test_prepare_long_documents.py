"""Prepare streams documents longer than a chunk (issue 37 item 3): a text file is read in blocks, a long document is
cut only where its tokenizer's ids cannot change (`Tokenizer.safe_split`), its pieces are tokenized apart, and the
store holds it as one document whose ids are those of the whole; memory stays bounded by workers x chunk."""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import tokenizers as hf
from test_store import ENV, GPT2, _file_digests

from lmzoo import tokenizers
from lmzoo.data import prepare, sources, store

BERT = GPT2.parent / "bert_uncased"
# Text that sits at a cut whatever the chunk size: runs of spaces, line breaks, tabs, other whitespace, digits,
# contractions and lone apostrophes, multi-byte characters (accents as one character and as a combining mark, CJK,
# emoji, a final sigma), punctuation and special tokens written in the text.
ATOMS = (
    " ", "  ", "   ", "\n", "\n\n", " \n ", "\t", "\r\n", "\u00a0", "\u3000", "'s", "'ll", "'re", "'t", "'", "don't",
    "I'm", "123", "4", "1,000", "٣", "abc", "Word", "é", "e\u0301", "naïve", "日本語", "🎉", "ΟΔΟΣ", ".", ",", "!?",
    "--", "...", "(x)", "<|endoftext|>", "[CLS]", "ß", "x",
)  # fmt: skip
SPLITTING_KINDS = ("byte", "char", "word", "gpt2", "wordpiece", "hf_json")


def _text(seed: int, atoms: int, line_breaks: bool = True) -> str:
    rng = random.Random(seed)
    chosen = [rng.choice(ATOMS) for _ in range(atoms)]
    return "".join(a for a in chosen if line_breaks or not any(c in a for c in "\n\r"))


def _tokenizer(kind: str, corpus: list[str]) -> tokenizers.Tokenizer:
    files = {"gpt2": GPT2, "wordpiece": BERT, "hf_json": BERT}.get(kind)
    if files is not None and not files.is_dir():
        pytest.skip(f"needs {files}")
    if kind == "char":
        return tokenizers.CharTokenizer.from_corpus(corpus)
    if kind == "word":
        return tokenizers.WordTokenizer.from_corpus(corpus)
    if kind == "sentencepiece":
        return tokenizers.SentencePieceTokenizer.train(corpus, vocab_size=400)
    path = {"gpt2": GPT2, "wordpiece": BERT / "vocab.txt", "hf_json": BERT / "tokenizer.json"}.get(kind)
    return tokenizers.build_tokenizer(kind, path=str(path) if path else None)


def _stored(split: store.TokenSplit) -> tuple[list[int], list[int]]:
    """(every token, every document start) of a split, over its shards."""
    return (
        np.concatenate([np.asarray(s) for s in split.shards]).tolist(),
        np.concatenate([np.asarray(s) for s in split.starts]).tolist(),
    )


def _whole(tokenizer: tokenizers.Tokenizer, documents: list[str]) -> tuple[list[int], list[int]]:
    """(tokens, starts) of `documents` each encoded in one call, EOS after each when the tokenizer has one."""
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    encoded = [tokenizer.encode(d) + eos for d in documents]
    return [i for ids in encoded for i in ids], np.cumsum([0] + [len(ids) for ids in encoded[:-1]]).tolist()


@pytest.mark.parametrize("kind", [*SPLITTING_KINDS, "sentencepiece"])
def test_every_cut_a_rule_allows_keeps_the_ids_of_the_whole(kind):
    texts = [_text(seed, random.Random(seed).randint(1, 40)) for seed in range(400)]
    tokenizer = _tokenizer(kind, texts)
    cuts = 0
    for text in texts:
        whole = tokenizer.encode(text)
        assert tokenizer.encode_batch([text]) == [whole]
        at = tokenizer.safe_split(text, 0)
        while at is not None:
            assert 1 <= at < len(text)
            head, tail = tokenizer.encode_batch([text[:at], text[at:]])
            assert head + tail == whole, (text[:at], text[at:])
            assert tokenizer.encode(text[:at]) + tokenizer.encode(text[at:]) == whole
            cuts += 1
            at = tokenizer.safe_split(text, at + 1)
    if kind == "sentencepiece":  # may merge across spaces: no cut is proven, its documents are encoded whole
        assert cuts == 0
    else:
        assert cuts > 500


def test_where_each_kind_cuts():
    gpt2 = _tokenizer("gpt2", [])
    assert gpt2.safe_split("abc def", 0) == 3  # between "abc" and " def"
    assert gpt2.safe_split("abc  def", 0) == 3  # before a run of spaces that follows a word
    assert gpt2.safe_split("don't stop", 0) == 5
    assert gpt2.safe_split("abc def", 4) is None  # from `near` on, and never at the end
    assert gpt2.safe_split("a\n b\tc  ", 0) == 6  # a space after a line break or a tab is no cut
    assert _tokenizer("wordpiece", []).safe_split("abc def", 0) == 3
    assert tokenizers.WordTokenizer(["a"]).safe_split("a b\nc", 2) == 3
    assert tokenizers.ByteTokenizer().safe_split("日本", 0) == 1  # a str index is a character boundary
    assert tokenizers.CharTokenizer("ab").safe_split("ab", 1) == 1
    metaspace = hf.Tokenizer.from_file(str(BERT / "tokenizer.json"))
    metaspace.pre_tokenizer = hf.pre_tokenizers.Metaspace()
    assert tokenizers.HFTokenizer(metaspace).safe_split("abc def", 0) is None  # an unproven pipeline


@pytest.mark.parametrize("unit", ["file", "line"])
@pytest.mark.parametrize("kind", SPLITTING_KINDS)
def test_a_long_document_is_stored_as_the_ids_of_the_whole(kind, unit, tmp_path, monkeypatch):
    documents = ["A short first document.", _text(SPLITTING_KINDS.index(kind), 6000, unit == "file"), "And a last one."]
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, text in zip("abc", documents):
        (folder / f"{name}.txt").write_text(text, encoding="utf-8")
    tokenizer = _tokenizer(kind, documents)
    monkeypatch.setattr(prepare, "CHUNK_BYTES", 331)
    source = sources.FileCorpus(tuple(sources.text_files(str(folder))), unit=unit, description="corpus")
    work = list(prepare.chunks(source, cut=tokenizer.safe_split))
    assert sum(chunk.continues for chunk in work) > 30  # the long document went over many chunks, as pieces
    assert "".join(text for chunk in work for text in chunk.texts) == "".join(documents)
    built = prepare.prepare(source, tokenizer, tmp_path / "store", workers=2, shard_tokens=500, progress=False)
    split = built.split("train")
    assert split.num_documents == 3
    assert _stored(split) == _whole(tokenizer, documents)
    assert split.document(1).tolist() == _whole(tokenizer, documents[1:2])[0]


def test_one_long_record_is_cut_by_characters_into_train_and_validation(tmp_path, monkeypatch):
    text = _text(7, 5000, line_breaks=False)
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    tokenizer = _tokenizer("gpt2", [])
    monkeypatch.setattr(prepare, "CHUNK_BYTES", 257)
    source = sources.FileCorpus((tmp_path / "one.txt",), validation_fraction=0.1, description="one")
    cut = int(len(text) * 0.9)
    assert list(source.documents()) == [("train", text[:cut]), ("validation", text[cut:])]
    built = prepare.prepare(source, tokenizer, tmp_path / "store", workers=1, progress=False)
    for name, part in (("train", text[:cut]), ("validation", text[cut:])):
        assert _stored(built.split(name)) == _whole(tokenizer, [part])


def test_a_tokenizer_without_a_cut_keeps_the_document_whole_and_says_so(tmp_path, monkeypatch, caplog):
    text = _text(3, 4000)
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    tokenizer = _tokenizer("sentencepiece", [text])
    monkeypatch.setattr(prepare, "CHUNK_BYTES", 500)
    monkeypatch.setattr(prepare, "WHOLE_WARNING_CHARS", 5000)
    source = sources.FileCorpus((tmp_path / "one.txt",), description="one")
    assert [len(chunk.texts) for chunk in prepare.chunks(source, cut=tokenizer.safe_split)] == [1]
    built = prepare.prepare(source, tokenizer, tmp_path / "store", progress=False)
    assert _stored(built.split("train")) == _whole(tokenizer, [text])
    assert "held and tokenized whole" in caplog.text


@pytest.mark.parametrize("unit", sources.DOCUMENT_UNITS)
def test_a_streamed_file_gives_the_records_of_the_whole(unit, tmp_path):
    atoms = ("a", "bc", " ", "\n", "\n\n", "\r\n", "\r", " \n ", "\t", "\x0c", "\x1c", "\u2028", "\x85", "é", "🎉")
    path = tmp_path / "t.txt"
    rng = random.Random(unit)
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 30)))
        path.write_text(text, encoding="utf-8")
        whole = list(sources.file_records(path, "text", unit))
        for size in (1, 2, 3, 7):  # bytes per block: every record spans blocks
            pieces = (("train", piece, continues) for piece, continues in sources._streamed_units(path, unit, size))
            assert [text for _, text in sources.joined_documents(pieces)] == whole, (text, size)
    path.write_bytes(b"ok\xff\xfe" * 3)  # not UTF-8 text: refused as read_text refuses it
    with pytest.raises(ValueError, match="6 of 12 characters are not valid UTF-8"):
        list(sources._streamed_units(path, unit, 5))


# Runs `python -m lmzoo.data.prepare ARGS...` with CHUNK_BYTES = argv[1], killed with SIGKILL (kill -9) just before it
# writes chunk argv[2] (-1: never).
_PREPARE_KILLED_AT = """
import os, signal, sys
from lmzoo.data import prepare, store
prepare.CHUNK_BYTES, kill_at = int(sys.argv[1]), int(sys.argv[2])
add = store.StoreWriter.add
def add_or_die(self, split, tokens, lengths, chunk, *args, **kwargs):
    if chunk == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    add(self, split, tokens, lengths, chunk, *args, **kwargs)
store.StoreWriter.add = add_or_die
sys.exit(prepare.main(sys.argv[3:]))
"""


def test_kill_minus_nine_inside_a_long_document_then_rerun_gives_the_identical_store(tmp_path, monkeypatch):
    folder = tmp_path / "corpus"
    folder.mkdir()
    documents = ["first", _text(1, 9000), "between", _text(2, 9000), "held out"]
    for name, text in zip("abcde", documents):
        (folder / f"{name}.txt").write_text(text, encoding="utf-8")
    chunk_bytes = 2000
    args = [f"--source={folder}", "--validation_fraction=0.2", "--shard_tokens=10000", "--chunk_documents=2"]
    monkeypatch.setattr(prepare, "CHUNK_BYTES", chunk_bytes)
    source = sources.FileCorpus(tuple(sources.text_files(str(folder))), validation_fraction=0.2, description="c")
    work = list(prepare.chunks(source, 2, cut=tokenizers.ByteTokenizer().safe_split))
    kill_at = [c.index for c in work if c.continues and c.unfinished][-1]  # inside the second long document

    def run(out: pathlib.Path, kill: int, workers: int) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", _PREPARE_KILLED_AT, str(chunk_bytes), str(kill), *args, f"--out={out}"]
        return subprocess.run([*command, f"--workers={workers}"], env=ENV, capture_output=True, text=True)

    clean = run(tmp_path / "clean", -1, 2)
    assert clean.returncode == 0, clean.stderr
    killed = run(tmp_path / "killed", kill_at, 1)
    assert killed.returncode == -signal.SIGKILL
    with pytest.raises(store.StoreError, match="incomplete"):
        store.open_store(tmp_path / "killed")
    finished = json.loads((tmp_path / "killed" / store.PROGRESS).read_text())["shards"]
    assert 0 < finished[-1]["chunk_end"] < kill_at  # chunks of the long document were written after the last shard
    rerun = run(tmp_path / "killed", -1, 2)
    assert rerun.returncode == 0, rerun.stderr
    assert _file_digests(tmp_path / "killed") == _file_digests(tmp_path / "clean")
    built = store.open_store(tmp_path / "clean")
    tokenizer = tokenizers.ByteTokenizer()
    assert _stored(built.split("train")) == _whole(tokenizer, documents[:4])
    assert _stored(built.split("validation")) == _whole(tokenizer, documents[4:])


def _peak_rss(source: pathlib.Path, out: pathlib.Path, workers: int) -> int:
    """Peak RSS (bytes) of the largest process of `python -m lmzoo.data.prepare` of `source`, byte tokenizer."""
    command = [sys.executable, "-m", "lmzoo.data.prepare", f"--source={source}", f"--out={out}", "--tokenizer=byte"]
    process = subprocess.Popen(
        [*command, f"--workers={workers}"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    _, status, usage = os.wait4(process.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, process.stderr.read().decode()
    return usage.ru_maxrss * 1024


def test_a_60_mb_line_prepares_in_memory_bounded_by_workers_times_chunk(tmp_path):
    line = _text(5, 20000, line_breaks=False)
    big, small = tmp_path / "big.txt", tmp_path / "small.txt"
    with open(big, "w", encoding="utf-8") as f:
        while f.tell() < 60_000_000:
            f.write(line)
    small.write_text(line[: prepare.CHUNK_BYTES // 4], encoding="utf-8")
    workers = 2
    baseline = _peak_rss(small, tmp_path / "small_store", workers)  # interpreter, numpy, the pool: no text to speak of
    peak = _peak_rss(big, tmp_path / "big_store", workers)
    # Measured (AMD EPYC, 2 cores): 1-chunk file 60 MB, 60 MB line 106-111 MB; the code that held the document whole
    # took 491 MB. The bound: 2 chunks in flight per worker at 16 bytes per character (the text, its pickled copy,
    # its ids and the reader's blocks), 64 MB here, about the file's size.
    bound = baseline + 2 * workers * prepare.CHUNK_BYTES * 16
    assert peak <= bound, f"peak RSS {peak / 1e6:.0f} MB > {bound / 1e6:.0f} MB (1-chunk file: {baseline / 1e6:.0f} MB)"
    built = store.open_store(tmp_path / "big_store")
    assert built.split("train").num_documents == 1 and built.split("validation").num_documents == 1
    assert sum(info["tokens"] for info in built.manifest["splits"].values()) == big.stat().st_size + 2
