"""Data readers name the file and line of malformed input and refuse binary or non-UTF-8 files."""

import gzip
import shutil

import numpy as np
import pytest

from lmzoo.data import sources


def test_jsonl_and_jsonl_gz_share_one_reader(tmp_path):
    lines = '{"text": "a", "id": 1}\n\n{"text": "b"}\n'
    (tmp_path / "plain.jsonl").write_text(lines)
    (tmp_path / "packed.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    for name in ("plain.jsonl", "packed.jsonl.gz"):
        assert sources.read_jsonl(tmp_path / name, ("text",), "fix") == [{"text": "a", "id": 1}, {"text": "b"}]
        assert sources.read_local_text(str(tmp_path / name)) == ["a", "b"]


@pytest.mark.parametrize(
    "lines, message",
    [
        ('{"text": "a"}\n\n{"text": "b",\n', r"broken.jsonl: line 3 is not valid JSON \(Expecting property name"),
        ('{"text": "a"}\n["b"]\n', r"broken.jsonl: line 2 is a JSON list, not an object with field\(s\) \['text'\]"),
        (
            '{"text": "a"}\n{"body": "b"}\n',
            r"broken.jsonl: line 2 has no field 'text' \(it has \['body'\]\); set config.data.text_field",
        ),
        ('{"text": 7}\n', r"broken.jsonl: line 1 field 'text' is a int, not a string"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, lines, message):
    (tmp_path / "broken.jsonl").write_text(lines)
    with pytest.raises(ValueError, match=message):
        sources.read_local_text(str(tmp_path / "broken.jsonl"))


def test_binary_file_is_not_text(tmp_path):
    binary = tmp_path / "ls"
    shutil.copy("/bin/ls", binary)
    with pytest.raises(ValueError, match=r"ls: NUL byte at offset \d+; this is a binary file"):
        sources.read_local_text(str(binary))


def test_mostly_invalid_utf8_is_an_error_a_little_is_tolerated(tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café crème brûlée à la carte".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: 5 of 28 characters are not valid UTF-8"):
        sources.read_local_text(str(latin1))
    mostly_fine = tmp_path / "mostly_fine.txt"
    mostly_fine.write_bytes(b"x" * 200 + b"\xff" + "genuine \ufffd stays".encode())
    assert sources.read_local_text(str(mostly_fine)) == ["x" * 200 + "\ufffdgenuine \ufffd stays"]


def test_tsv_rows_must_match_the_header(tmp_path):
    table = tmp_path / "pairs.tsv"
    table.write_text("en\tde\ncat\tKatze\ndog\n", encoding="utf-8")
    with pytest.raises(ValueError, match="pairs.tsv: line 3 has 1 tab-separated cells, the header has 2"):
        sources.read_text_pairs(str(table), ("en", "de"))


def test_labelled_tsv_names_a_bad_label(tmp_path):
    table = tmp_path / "train.tsv"
    table.write_text("sentence\tlabel\ngood\t1\nbad\t0\n", encoding="utf-8")
    texts, labels = sources.read_labelled_tsv(str(table), ("sentence",), "label")
    assert texts == [("good",), ("bad",)]
    np.testing.assert_array_equal(labels, [1, 0])
    table.write_text("sentence\tlabel\ngood\t1\nbad\tnegative\n", encoding="utf-8")
    with pytest.raises(ValueError, match="train.tsv: example 2 has label 'negative' in column 'label', not an integer"):
        sources.read_labelled_tsv(str(table), ("sentence",), "label")


def test_pairs_jsonl_checks_every_row(tmp_path):
    rows = tmp_path / "pairs.jsonl"
    rows.write_text('{"en": "cat", "de": "Katze"}\n{"en": "dog"}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl: line 2 has no field 'de'.*set config.data.text_fields"):
        sources.read_text_pairs(str(rows), ("en", "de"))


def test_python_stdlib_is_text():
    docs = [sources.read_text(f) for f in sources.python_stdlib_files(5)]
    assert len(docs) == 5 and all("\ufffd" not in d and d for d in docs)


def test_records_are_counted_without_parsing_and_empty_ones_keep_their_place(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = ['{"text": "a"}', "", '{"text": ""}', "  ", '{"text": "b"}', '{"text": "c"}']
    (tmp_path / "docs.jsonl").write_text("\n".join(rows) + "\n")
    with gzip.open(tmp_path / "more.jsonl.gz", "wt") as f:
        f.write('{"text": "d"}\n\n{"text": "e"}\n')
    pq.write_table(pa.table({"text": ["f", "", "g"]}), tmp_path / "table.parquet")
    (tmp_path / "notes.txt").write_text("one\n\ntwo\nlines\n\n\nthree")
    (tmp_path / "empty.txt").write_text("")
    for path in sorted(tmp_path.iterdir()):
        for unit in sources.DOCUMENT_UNITS:
            assert sources.count_records(path, unit) == len(list(sources.file_records(path, "text", unit)))
    assert list(sources.file_records(tmp_path / "docs.jsonl", "text", "file")) == ["a", "", "b", "c"]

    # 4 records, the last quarter held out: the empty record counts, so "c" alone is validation
    corpus = sources.FileCorpus((tmp_path / "docs.jsonl",), validation_fraction=0.25, description="docs")
    assert list(corpus.documents()) == [("train", "a"), ("train", "b"), ("validation", "c")]
    only_empty = sources.FileCorpus((tmp_path / "empty.txt",), validation_fraction=0.25, description="empty.txt")
    with pytest.raises(ValueError, match="no text found in empty.txt"):
        list(only_empty.documents())
