"""One tokenizer interface for every lmzoo model: char, word, byte, SentencePiece and HuggingFace `tokenizers`.

`encode` never adds special tokens (no BOS/EOS/[CLS]/[SEP]); callers add the ones their objective needs.
`decode` drops pad ids and renders every other id, so it never stops early at EOS.
"""

from __future__ import annotations

import abc
import collections
import io
import itertools
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import sentencepiece as spm
import tiktoken
import tokenizers as hf

# Token names that identify each special role, in order of preference. The single source of truth for
# discovering special ids in a vocabulary (HF files, CharTokenizer/ByteTokenizer specials, SentencePiece symbols).
SPECIAL_TOKEN_NAMES: dict[str, tuple[str, ...]] = {
    "eos": ("<|endoftext|>", "</s>", "<eos>"),
    "bos": ("<s>", "<|endoftext|>", "<bos>"),
    "pad": ("<pad>", "[PAD]"),
    "unk": ("<unk>", "[UNK]"),
    "mask": ("<mask>", "[MASK]"),
    "cls": ("[CLS]", "<s>", "<cls>"),
    "sep": ("[SEP]", "</s>", "<sep>"),
}
KINDS = ("char", "byte", "sentencepiece", "gpt2", "wordpiece", "hf_json", "word")


def _discover_specials(lookup: Callable[[str], int | None]) -> dict[str, int]:
    """Map each role to the id of its first name in SPECIAL_TOKEN_NAMES that `lookup` finds."""
    found = {role: [i for i in map(lookup, names) if i is not None] for role, names in SPECIAL_TOKEN_NAMES.items()}
    return {role: ids[0] for role, ids in found.items() if ids}


def _require_files(paths: Sequence[str], expected: str) -> None:
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{expected}; not found: {path}")


def _utf8_char_counts(byte_values: np.ndarray) -> np.ndarray:
    """1 for UTF-8 lead/ASCII bytes, 0 for continuation bytes: sums to the character count of valid UTF-8."""
    return ((byte_values & 0xC0) != 0x80).astype(np.int32)


# The rules where a text may be cut so that its two parts encode to the ids of the whole (`Tokenizer.safe_split`).
# Each decides a cut at i from text[i - 1] and text[i] alone, so a text that grows keeps every answer it had.


def _split_anywhere(text: str, near: int) -> int | None:
    """Any index: for tokenizers that encode each character on its own."""
    i = max(near, 1)
    return i if i < len(text) else None


_WHITESPACE = re.compile(r"\s")  # str.isspace's characters, which str.split separates words at


def _split_before_whitespace(text: str, near: int) -> int | None:
    """Just before a whitespace character: for tokenizers whose tokens are whitespace-separated words."""
    found = _WHITESPACE.search(text, max(near, 1))
    return found.start() if found else None


_WORD_SPACE = re.compile(r"(?<=\S) ")


def _split_before_word_space(text: str, near: int) -> int | None:
    """Just before a space (U+0020) that follows a character that is not whitespace, as between "abc" and " def": for
    pre-tokenizers that end a token at the first whitespace after non-whitespace and start none in the middle of a
    word (GPT-2's byte-level regex; BERT's whitespace-and-punctuation split). See `HFTokenizer.safe_split`."""
    found = _WORD_SPACE.search(text, max(near, 1))
    return found.start() if found else None


class Tokenizer(abc.ABC):
    """Text <-> ids. Special ids are None when the vocabulary has no such token; `eos_ids` are every id that ends a
    generation (`eos_id` first)."""

    eos_id: int | None = None
    pad_id: int | None = None
    bos_id: int | None = None
    unk_id: int | None = None
    mask_id: int | None = None
    cls_id: int | None = None
    sep_id: int | None = None
    # Ids besides eos_id that end a generation: a checkpoint's generation_config.json may list several eos ids (Llama 3
    # Instruct: <|eot_id|> ends a turn, <|end_of_text|> a text).
    extra_eos_ids: tuple[int, ...] = ()

    def _set_specials(self, ids: Mapping[str, int | None]) -> None:
        for role, i in ids.items():
            setattr(self, f"{role}_id", i)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: eos_id, then `extra_eos_ids`."""
        first = () if self.eos_id is None else (self.eos_id,)
        return first + tuple(dict.fromkeys(i for i in self.extra_eos_ids if i not in first))

    @property
    def special_ids(self) -> dict[str, int]:
        """Role -> id for every special token this tokenizer has."""
        ids = {role: getattr(self, f"{role}_id") for role in SPECIAL_TOKEN_NAMES}
        return {role: i for role, i in ids.items() if i is not None}

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Size of the id space; model embeddings must have at least this many rows."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids for `text`, without any special tokens added."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text for `ids`, skipping pad ids. An id outside [0, vocab_size), which no sampler draws but a model
        with a larger vocabulary could, decodes as U+FFFD (as a bad UTF-8 byte does) instead of failing."""
        parts = []
        for known, run in itertools.groupby((int(i) for i in ids), key=lambda i: 0 <= i < self.vocab_size):
            parts.append(self._decode(list(run)) if known else "\ufffd" * len(list(run)))
        return "".join(parts)

    @abc.abstractmethod
    def _decode(self, ids: Sequence[int]) -> str:
        """Text for `ids`, all in [0, vocab_size), skipping pad ids."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def unknown_fraction(self, text: str) -> float:
        """The share of `text` outside the vocabulary: its <unk> tokens (0 for a tokenizer without <unk>, which
        encodes every text)."""
        if self.unk_id is None:
            return 0.0
        ids = self.encode(text)
        return ids.count(self.unk_id) / max(len(ids), 1)

    def safe_split(self, text: str, near: int) -> int | None:
        """The first index i, max(near, 1) <= i < len(text), at which `text` may be cut without changing its ids:
        encode_batch([text[:i], text[i:]]) concatenated equals encode(text), decided by text[i - 1] and text[i] alone;
        None when there is none. This base class proves no such place (SentencePiece, for one, may merge pieces across
        spaces and does not pre-tokenize), so its texts are encoded whole."""
        return None

    def encode_documents(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """Documents as a token store holds them: (tokens [N] of `dtype`, every document followed by EOS when the
        tokenizer has one; lengths [len(texts)] int64 with the EOS)."""
        ids = self.encode_batch(texts)
        eos = [] if self.eos_id is None else [self.eos_id]
        lengths = np.array([len(d) + len(eos) for d in ids], np.int64)
        tokens = np.fromiter(itertools.chain.from_iterable(d + eos for d in ids), dtype, count=int(lengths.sum()))
        return tokens, lengths

    @abc.abstractmethod
    def token_char_lengths(self) -> np.ndarray:
        """[vocab_size] int32: unicode characters each id decodes to (0 for specials), for bits per character."""

    @abc.abstractmethod
    def token_byte_lengths(self) -> np.ndarray:
        """[vocab_size] int32: UTF-8 bytes each id stands for (0 for specials), for bits per byte."""

    @abc.abstractmethod
    def save(self, directory: str) -> dict:
        """Write needed files into `directory`; return a JSON-able spec for `from_spec` (paths relative)."""


class CharTokenizer(Tokenizer):
    """Character vocabulary `chars` (ids 0..len-1) followed by `specials`. `encode` refuses a character the
    vocabulary lacks; `encode_batch` (what stores and scoring read) leaves it out."""

    def __init__(self, chars: str, specials: Sequence[str] = ("<eos>",)):
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer characters must be unique")
        self.chars = chars
        self.specials = tuple(specials)
        self._index = {c: i for i, c in enumerate(chars)}
        special_index = {name: len(chars) + k for k, name in enumerate(self.specials)}
        self._set_specials(_discover_specials(special_index.get))

    @classmethod
    def from_corpus(cls, texts: Iterable[str], specials: Sequence[str] = ("<eos>",)) -> CharTokenizer:
        """Sorted unique characters of `texts` (nanoGPT shakespeare_char ids), specials after them."""
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return cls("".join(sorted(chars)), specials)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + len(self.specials)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._index[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} is not in the character vocabulary, which was built from the training corpus"
            ) from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Every text's characters that the vocabulary has: text scored by a run (eval.py --data) may hold characters
        its training corpus lacked; they are left out, and `unknown_fraction` says how many."""
        index = self._index
        return [[index[c] for c in text if c in index] for text in texts]

    def unknown_fraction(self, text: str) -> float:
        """The share of `text`'s characters the vocabulary lacks."""
        return sum(c not in self._index for c in text) / max(len(text), 1)

    def safe_split(self, text: str, near: int) -> int | None:
        """Anywhere: each character is an id of its own (or left out)."""
        return _split_anywhere(text, near)

    def _decode(self, ids: Sequence[int]) -> str:
        n = len(self.chars)
        return "".join(self.chars[i] if i < n else self.specials[i - n] for i in ids if i != self.pad_id)

    def token_char_lengths(self) -> np.ndarray:
        return np.array([1] * len(self.chars) + [0] * len(self.specials), dtype=np.int32)

    def token_byte_lengths(self) -> np.ndarray:
        return np.array([len(c.encode()) for c in self.chars] + [0] * len(self.specials), dtype=np.int32)

    def save(self, directory: str) -> dict:
        return {"kind": "char", "chars": self.chars, "specials": list(self.specials)}


class WordTokenizer(Tokenizer):
    """Whitespace-separated words (ids 0..len-1) followed by `specials`; a newline encodes as `<eos>`.

    Word-level LM convention (Mikolov's PTB): each line is a sentence, so `encode(text)` of a whole file gives
    the words of every line each followed by `<eos>` (the newline itself, not an added special). Words
    outside the vocabulary map to `<unk>` when the vocabulary has it (PTB's text already uses `<unk>`), and
    are an error otherwise.
    """

    def __init__(self, words: Sequence[str], specials: Sequence[str] = ("<eos>",)):
        if len(set(words)) != len(words) or set(words) & set(specials):
            raise ValueError("WordTokenizer words must be unique and distinct from the specials")
        if "<eos>" not in specials:
            raise ValueError("WordTokenizer needs '<eos>' among its specials to encode line ends")
        self.words = tuple(words)
        self.specials = tuple(specials)
        self._index = {w: i for i, w in enumerate(self.words)}
        special_index = {name: len(self.words) + k for k, name in enumerate(self.specials)}
        self._set_specials(_discover_specials(lambda name: self._index.get(name, special_index.get(name))))

    @classmethod
    def from_corpus(cls, texts: Iterable[str], specials: Sequence[str] = ("<eos>",)) -> WordTokenizer:
        """Words of `texts` by descending frequency, ties in sorted order; specials after them."""
        counts: collections.Counter[str] = collections.Counter()
        for text in texts:
            counts.update(text.split())
        for name in specials:
            counts.pop(name, None)
        return cls(sorted(counts, key=lambda w: (-counts[w], w)), specials)

    @property
    def vocab_size(self) -> int:
        return len(self.words) + len(self.specials)

    def encode(self, text: str) -> list[int]:
        ids = []
        for k, line in enumerate(text.split("\n")):
            if k:
                ids.append(self.eos_id)
            ids.extend(self._word_id(w) for w in line.split())
        return ids

    def safe_split(self, text: str, near: int) -> int | None:
        """Just before whitespace: no word runs across it, and a newline there still encodes as <eos>."""
        return _split_before_whitespace(text, near)

    def _word_id(self, word: str) -> int:
        i = self._index.get(word, self.unk_id)
        if i is None:
            raise ValueError(f"word {word!r} is not in the vocabulary, which has no <unk>")
        return i

    def _decode(self, ids: Sequence[int]) -> str:
        lines, line = [], []
        for i in ids:
            if i == self.eos_id:
                lines.append(" ".join(line))
                line = []
            elif i != self.pad_id:
                line.append(self.words[i] if i < len(self.words) else self.specials[i - len(self.words)])
        return "\n".join([*lines, " ".join(line)])

    def token_char_lengths(self) -> np.ndarray:
        """Characters of each word (inter-word spaces not counted); 0 for specials."""
        return np.array([len(w) for w in self.words] + [0] * len(self.specials), dtype=np.int32)

    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of each word (inter-word spaces not counted); 0 for specials."""
        return np.array([len(w.encode()) for w in self.words] + [0] * len(self.specials), dtype=np.int32)

    def save(self, directory: str) -> dict:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "words.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(self.words) + "\n")
        return {"kind": "word", "path": "words.txt", "specials": list(self.specials)}


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255, then <eos>=256 and <pad>=257.

    token_char_lengths counts 1 for ASCII and UTF-8 lead bytes and 0 for continuation bytes, so its sum over
    the encoding of any text equals the text's character count (true bits per character, not per byte).
    """

    SPECIALS = ("<eos>", "<pad>")

    def __init__(self) -> None:
        self._set_specials(_discover_specials({name: 256 + k for k, name in enumerate(self.SPECIALS)}.get))

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_documents(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """The UTF-8 bytes themselves, with <eos> inserted after each document (no Python ints)."""
        encoded = [text.encode("utf-8") for text in texts]
        ends = np.cumsum([len(e) for e in encoded], dtype=np.int64)
        tokens = np.insert(np.frombuffer(b"".join(encoded), np.uint8).astype(dtype), ends, self.eos_id)
        return tokens, np.diff(ends, prepend=0) + 1

    def safe_split(self, text: str, near: int) -> int | None:
        """Anywhere in the text: a str index is a character boundary, so both parts are whole UTF-8 characters."""
        return _split_anywhere(text, near)

    def _decode(self, ids: Sequence[int]) -> str:
        parts = []
        for is_byte, run in itertools.groupby((i for i in ids if i != self.pad_id), key=lambda i: i < 256):
            parts.append(
                bytes(run).decode("utf-8", errors="replace")
                if is_byte
                else "".join(self.SPECIALS[i - 256] for i in run)
            )
        return "".join(parts)

    def token_char_lengths(self) -> np.ndarray:
        return np.concatenate([_utf8_char_counts(np.arange(256)), np.zeros(len(self.SPECIALS), np.int32)])

    def token_byte_lengths(self) -> np.ndarray:
        return np.concatenate([np.ones(256, np.int32), np.zeros(len(self.SPECIALS), np.int32)])

    def save(self, directory: str) -> dict:
        return {"kind": "byte"}


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model, optionally followed by `extra_ids` T5 sentinels.

    Sentinels sit above the SentencePiece vocabulary in reverse order (`<extra_id_0>` = vocab_size - 1, as in
    seqio); encode never produces them, decode renders them as `<extra_id_i>`. Control pieces (EOS) decode to
    "" (SentencePiece behaviour).
    """

    def __init__(self, model_proto: bytes, extra_ids: int = 0):
        self.model_proto = model_proto
        self.extra_ids = extra_ids
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self._char_lengths: np.ndarray | None = None
        found = _discover_specials(self._user_piece_id)
        ids = {"pad": self.sp.pad_id(), "eos": self.sp.eos_id(), "unk": self.sp.unk_id(), "bos": self.sp.bos_id()}
        self._set_specials({role: (i if i >= 0 else None) for role, i in ids.items()})
        self._set_specials({role: found.get(role) for role in ("mask", "cls", "sep")})

    def _user_piece_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        ok = self.sp.id_to_piece(i) == piece and not (self.sp.is_control(i) or self.sp.is_unknown(i))
        return i if ok else None

    @classmethod
    def load(cls, path: str, extra_ids: int = 0) -> SentencePieceTokenizer:
        _require_files([path], "SentencePiece needs a trained .model file")
        with open(path, "rb") as f:
            return cls(f.read(), extra_ids)

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        model_type: str = "bpe",
        user_defined_symbols: Sequence[str] = (),
        byte_fallback: bool = True,
        extra_ids: int = 0,
        **trainer_kwargs,
    ) -> SentencePieceTokenizer:
        """Train in memory on the non-empty lines of `texts` (a str or strs); `vocab_size` excludes `extra_ids`.

        Defaults are lossless (identity normalization, whitespace kept, no dummy prefix, byte fallback so
        decode(encode(s)) == s); any SentencePieceTrainer option can be overridden via `trainer_kwargs`.
        With byte_fallback, vocab_size must cover 256 byte pieces + 3 specials + the corpus characters.
        """
        options = dict(
            vocab_size=vocab_size,
            model_type=model_type,
            user_defined_symbols=list(user_defined_symbols),
            byte_fallback=byte_fallback,
            pad_id=0,
            eos_id=1,
            unk_id=2,
            bos_id=-1,
            num_threads=2,
            character_coverage=0.9995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            minloglevel=2,
        )
        options.update(trainer_kwargs)
        model = io.BytesIO()
        texts = [texts] if isinstance(texts, str) else texts
        lines = (line for text in texts for line in text.splitlines() if line)
        spm.SentencePieceTrainer.train(sentence_iterator=lines, model_writer=model, **options)
        return cls(model.getvalue(), extra_ids)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size() + self.extra_ids

    def sentinel_id(self, i: int) -> int:
        """Id of `<extra_id_{i}>`."""
        if not 0 <= i < self.extra_ids:
            raise IndexError(f"sentinel {i} out of range; this tokenizer has extra_ids={self.extra_ids}")
        return self.vocab_size - 1 - i

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def _decode(self, ids: Sequence[int]) -> str:
        n = self.sp.get_piece_size()
        parts = []
        for is_piece, run in itertools.groupby((i for i in ids if i != self.pad_id), key=lambda i: i < n):
            parts.append(
                self.sp.decode(list(run)) if is_piece else "".join(f"<extra_id_{self.vocab_size - 1 - i}>" for i in run)
            )
        return "".join(parts)

    def token_char_lengths(self) -> np.ndarray:
        """Byte-fallback pieces count as in ByteTokenizer (exact characters for valid UTF-8)."""
        if self._char_lengths is None:
            sp = self.sp
            lengths = np.zeros(self.vocab_size, np.int32)
            for i in range(sp.get_piece_size()):
                piece = sp.id_to_piece(i)
                if sp.is_byte(i):
                    lengths[i] = _utf8_char_counts(np.array(int(piece[1:-1], 16)))
                elif not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)):
                    lengths[i] = len(piece.replace("\u2581", " "))
            lengths[list(self.special_ids.values())] = 0
            lengths.flags.writeable = False
            self._char_lengths = lengths
        return self._char_lengths

    def token_byte_lengths(self) -> np.ndarray:
        """Byte-fallback pieces are one byte; "▁" is a space."""
        sp = self.sp
        lengths = np.zeros(self.vocab_size, np.int32)
        for i in range(sp.get_piece_size()):
            if sp.is_byte(i):
                lengths[i] = 1
            elif not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)):
                lengths[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode())
        lengths[list(self.special_ids.values())] = 0
        return lengths

    def save(self, directory: str) -> dict:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "spm.model"), "wb") as f:
            f.write(self.model_proto)
        return {"kind": "sentencepiece", "path": "spm.model", "extra_ids": self.extra_ids}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (the alphabet of byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}


# GPT-2's pre-tokenization regex, the one HF's ByteLevel pre-tokenizer applies (use_regex=True).
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def tiktoken_encoding(tokenizer: hf.Tokenizer) -> tiktoken.Encoding | None:
    """A tiktoken encoder giving exactly `tokenizer`'s ids, or None when it cannot.

    It can for a GPT-2-layout byte-level BPE: no normalizer, the ByteLevel pre-tokenizer with GPT-2's regex and no
    prefix space, the 256 byte symbols at ids 0..255 and merge k producing id 256 + k. Then the id of every token
    is its merge rank, which is what tiktoken's BPE ranks by, and added tokens are its special tokens."""
    spec = json.loads(tokenizer.to_str())
    model, pre = spec["model"], spec.get("pre_tokenizer") or {}
    if (
        model.get("type") != "BPE"
        or spec.get("normalizer") is not None
        or pre.get("type") != "ByteLevel"
        or pre.get("add_prefix_space")
        or not pre.get("use_regex", True)
    ):
        return None
    alphabet = _bytes_to_unicode()
    vocab = model["vocab"]
    if sorted(vocab.get(alphabet[b], -1) for b in range(256)) != list(range(256)):
        return None
    for k, merge in enumerate(model["merges"]):
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        if vocab.get(left + right) != 256 + k:
            return None
    to_byte = {c: b for b, c in alphabet.items()}
    ranks = {bytes(to_byte[c] for c in token): i for token, i in vocab.items() if i < 256 + len(model["merges"])}
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    if len(ranks) != 256 + len(model["merges"]) or set(specials.values()) & set(ranks.values()):
        return None
    return tiktoken.Encoding(
        "byte_level_bpe", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )


def _cuts_before_word_space(tokenizer: hf.Tokenizer) -> bool:
    """Whether `tokenizer` encodes a text cut just before a space that follows non-whitespace to the ids of the whole
    (`HFTokenizer.safe_split`): GPT-2's byte-level pre-tokenizer (its regex, no prefix space, no normalizer) or BERT's
    (BertPreTokenizer, after BertNormalizer or none), with no added token that holds whitespace or strips it."""
    for added in tokenizer.get_added_tokens_decoder().values():
        if added.lstrip or added.rstrip or any(c.isspace() for c in added.content):
            return False
    pre, normalizer = tokenizer.pre_tokenizer, tokenizer.normalizer
    if isinstance(pre, hf.pre_tokenizers.ByteLevel):
        return normalizer is None and pre.use_regex and not pre.add_prefix_space
    return isinstance(pre, hf.pre_tokenizers.BertPreTokenizer) and (
        normalizer is None or isinstance(normalizer, hf.normalizers.BertNormalizer)
    )


# The files of a Hugging Face checkpoint folder beside tokenizer.json that say which tokens are special, how a
# conversation is rendered and when generation stops; an HFTokenizer keeps those it was read with, and writes them back.
TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP = "tokenizer_config.json", "special_tokens_map.json"
GENERATION_CONFIG, CHAT_TEMPLATE = "generation_config.json", "chat_template.jinja"
PRETRAINED_FILES = (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, GENERATION_CONFIG, CHAT_TEMPLATE)
# The roles a tokenizer_config.json names as `<role>_token`.
_CONFIG_ROLES = ("bos", "eos", "pad", "unk", "mask", "cls", "sep")


def read_pretrained_files(folder: str) -> dict[str, object]:
    """The PRETRAINED_FILES present in a local `folder`: JSON files parsed (a file that is not a JSON object is a
    ValueError naming it), chat_template.jinja as text."""
    files: dict[str, object] = {}
    for name in PRETRAINED_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if name == CHAT_TEMPLATE:
            files[name] = text
            continue
        try:
            files[name] = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
        if not isinstance(files[name], dict):
            raise ValueError(f"{path} holds no JSON object")
    return files


def _token_content(value: object) -> str | None:
    """A token as tokenizer_config.json / special_tokens_map.json give it: a string, or an added token's
    {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: object) -> list[int]:
    """generation_config.json's token id field: one id, a list of them, or null."""
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def pretrained_special_ids(
    tokenizer: hf.Tokenizer, files: Mapping[str, object]
) -> tuple[dict[str, int], tuple[int, ...]]:
    """(role -> id, every id that ends a generation) as transformers reads a checkpoint folder (`read_pretrained_files`).

    Each role's token is tokenizer_config.json's `<role>_token` (bos, eos, pad, unk, mask, cls, sep), else
    special_tokens_map.json's; where neither names bos, eos or pad, generation_config.json's `<role>_token_id`. A role
    the files leave out has no id: names are not guessed, as transformers guesses none. The eos ids are the eos
    token's, then generation_config.json's `eos_token_id` (one id or a list).

    No pad token (Llama 3, Llama 2, GPT-2): pad is, in order, an added special token named for padding
    (`<|finetune_right_pad_id|>`, `<pad>`), the first reserved special token (`<|reserved_special_token_0|>`), the unk
    token (Llama 2's and Mistral's `<unk>`, which their byte fallback never produces), else the eos token, as HF users
    set `tokenizer.pad_token = tokenizer.eos_token`. The first three keep pad apart from eos, which DPO, reward models
    and PPO need to tell a reply's end from its padding (with eos as pad they refuse the tokenizer, saying so)."""
    token_files = [files.get(TOKENIZER_CONFIG) or {}, files.get(SPECIAL_TOKENS_MAP) or {}]
    generation = files.get(GENERATION_CONFIG) or {}
    ids: dict[str, int] = {}
    for role in _CONFIG_ROLES:
        for names in token_files:
            content = _token_content(names.get(f"{role}_token"))
            found = None if content is None else tokenizer.token_to_id(content)
            if found is not None:
                ids[role] = found
                break
        if role not in ids and role in ("bos", "eos", "pad") and _ids(generation.get(f"{role}_token_id")):
            ids[role] = _ids(generation[f"{role}_token_id"])[0]
    eos_ids = tuple(dict.fromkeys([*([ids["eos"]] if "eos" in ids else []), *_ids(generation.get("eos_token_id"))]))
    if "pad" not in ids:
        added = sorted((i, t.content) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        taken = {*eos_ids, ids.get("bos")}
        free = [(i, content.lower()) for i, content in added if i not in taken]
        fallback = [i for i, content in free if "pad" in content] + [i for i, content in free if "reserved" in content]
        fallback += [ids["unk"]] if "unk" in ids and ids["unk"] not in taken else []
        if fallback or eos_ids:
            ids["pad"] = (fallback or eos_ids)[0]
    return ids, eos_ids


class HFTokenizer(Tokenizer):
    """A HuggingFace `tokenizers.Tokenizer`; padding and truncation are switched off on the wrapped object.

    Special ids, unless given: from the Hugging Face files read with it (`files`: tokenizer_config.json,
    special_tokens_map.json, generation_config.json, as `pretrained_special_ids` reads them), else found by
    SPECIAL_TOKEN_NAMES. `files` (PRETRAINED_FILES, chat_template.jinja included) are kept and saved with it, so an
    export writes them back. Post-processor templates are not applied: e.g. `wordpiece` encodes plain word pieces and
    callers add [CLS]/[SEP] themselves.
    """

    def __init__(
        self,
        tokenizer: hf.Tokenizer,
        special_ids: Mapping[str, int] | None = None,
        *,
        eos_ids: Sequence[int] | None = None,
        files: Mapping[str, object] | None = None,
    ):
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.tokenizer = tokenizer
        self.files = dict(files or {})
        self._char_lengths: np.ndarray | None = None
        self._tiktoken = tiktoken_encoding(tokenizer)
        self._cuts_before_word_space = _cuts_before_word_space(tokenizer)
        found, found_eos = {}, ()
        if any(name in self.files for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, GENERATION_CONFIG)):
            found, found_eos = pretrained_special_ids(tokenizer, self.files)
        elif special_ids is None:
            found = _discover_specials(tokenizer.token_to_id)
        self._set_specials(found if special_ids is None else special_ids)
        self.extra_eos_ids = tuple(found_eos if eos_ids is None else eos_ids)

    @property
    def chat_template(self) -> str | None:
        """The chat template of the files it was read with: chat_template.jinja, else tokenizer_config.json's
        `chat_template` (a string, or the "default" of named ones), as transformers reads a folder."""
        if isinstance(self.files.get(CHAT_TEMPLATE), str):
            return self.files[CHAT_TEMPLATE]
        template = (self.files.get(TOKENIZER_CONFIG) or {}).get("chat_template")
        if isinstance(template, list):
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
        return template if isinstance(template, str) and template else None

    @classmethod
    def gpt2(cls, vocab_json: str, merges_txt: str) -> HFTokenizer:
        """GPT-2 byte-level BPE; `<|endoftext|>` (50256) is both eos and bos; no pad."""
        _require_files([vocab_json, merges_txt], "GPT-2 BPE needs vocab.json and merges.txt")
        tok = hf.Tokenizer(hf.models.BPE.from_file(vocab_json, merges_txt))
        tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = hf.decoders.ByteLevel()
        tok.add_special_tokens(["<|endoftext|>"])
        return cls(tok)

    @classmethod
    def wordpiece(cls, vocab_txt: str, lowercase: bool = True) -> HFTokenizer:
        """BERT WordPiece from vocab.txt; [PAD]/[UNK]/[CLS]/[SEP]/[MASK] are special (and matched in text)."""
        _require_files([vocab_txt], "BERT WordPiece needs vocab.txt")
        tok = hf.Tokenizer(hf.models.WordPiece.from_file(vocab_txt, unk_token="[UNK]"))
        tok.normalizer = hf.normalizers.BertNormalizer(lowercase=lowercase)
        tok.pre_tokenizer = hf.pre_tokenizers.BertPreTokenizer()
        tok.decoder = hf.decoders.WordPiece()
        specials = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
        tok.add_special_tokens([name for name in specials if tok.token_to_id(name) is not None])
        return cls(tok)

    @classmethod
    def from_file(
        cls, tokenizer_json: str, special_ids: Mapping[str, int] | None = None, eos_ids: Sequence[int] | None = None
    ) -> HFTokenizer:
        """A tokenizer.json with the Hugging Face files beside it (`read_pretrained_files`), as transformers'
        `AutoTokenizer.from_pretrained` reads the folder."""
        _require_files([tokenizer_json], "HF tokenizer needs a tokenizer.json")
        files = read_pretrained_files(os.path.dirname(os.path.abspath(tokenizer_json)))
        return cls(hf.Tokenizer.from_file(tokenizer_json), special_ids, eos_ids=eos_ids, files=files)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """tiktoken's encoder when it gives the same ids (GPT-2's byte-level BPE, ~8x faster), else HF's."""
        if self._tiktoken is not None:
            return self._tiktoken.encode_batch(texts, allowed_special="all", num_threads=1)
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def encode_documents(self, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """tiktoken's ids straight into numpy (no Python ints) when it gives the same ids, else the base path."""
        if self._tiktoken is None:
            return super().encode_documents(texts, dtype)
        encoded = [self._tiktoken.encode_to_numpy(text, allowed_special="all") for text in texts]
        eos = 0 if self.eos_id is None else 1
        lengths = np.array([len(ids) + eos for ids in encoded], np.int64)
        tokens = np.empty(int(lengths.sum()), dtype)
        end = 0
        for ids, length in zip(encoded, lengths, strict=True):
            tokens[end : end + len(ids)] = ids
            end += length
        if eos:
            tokens[np.cumsum(lengths) - 1] = self.eos_id
        return tokens, lengths

    def safe_split(self, text: str, near: int) -> int | None:
        """Just before a space that follows non-whitespace (`_split_before_word_space`) for the two pipelines where
        that is proven (`_cuts_before_word_space`); any other pipeline (a SentencePiece-style Metaspace, a custom
        regex, a normalizer) gets no cut, and its texts are encoded whole.

        - Byte-level BPE with GPT-2's regex (`gpt2`, and what tiktoken runs): every alternative of GPT2_SPLIT_PATTERN
          holds no whitespace (the contractions), whitespace only as an optional first character (` ?\\p{L}+`,
          ` ?\\p{N}+`, ` ?[^\\s\\p{L}\\p{N}]+`), or whitespace only (`\\s+(?!\\S)`, `\\s+`). So the pre-token holding
          the non-whitespace text[i - 1] cannot take in the space text[i]: a pre-token ends at i whatever follows
          (digits, apostrophes, more spaces, newlines), the ones after it are text[i:]'s (the pattern only looks
          ahead, and matching restarts at i), and the ones before it are text[:i]'s (none reaches past text[i - 1]).
        - BERT (`wordpiece`): BertNormalizer maps characters one by one (NFD's reordering of accents never crosses
          the space, a starter), and BertPreTokenizer splits at every whitespace: no word spans i.

        In both, the model (BPE merges, WordPiece) works inside one pre-token, and added tokens, matched before the
        pipeline, hold no whitespace and strip none (checked), so none spans or takes in the space."""
        return _split_before_word_space(text, near) if self._cuts_before_word_space else None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i != self.pad_id], skip_special_tokens=False)

    def token_char_lengths(self) -> np.ndarray:
        """Length of each id decoded alone. WordPiece drops the `##` prefix and does not count inter-word
        spaces; byte-level pieces holding part of a multi-byte character count as 1 (U+FFFD)."""
        if self._char_lengths is None:
            tok = self.tokenizer
            pieces = tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
            if isinstance(tok.model, hf.models.WordPiece):
                pieces = [p.removeprefix(tok.model.continuing_subword_prefix) for p in pieces]
            lengths = np.array([len(p) for p in pieces], dtype=np.int32)
            added = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
            lengths[added + list(self.special_ids.values())] = 0
            lengths.flags.writeable = False
            self._char_lengths = lengths
        return self._char_lengths

    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes of each id: a byte-level BPE token's characters are one byte each (GPT-2's byte-to-unicode
        map); WordPiece drops the `##` prefix and does not count inter-word spaces."""
        tok = self.tokenizer
        if isinstance(tok.decoder, hf.decoders.ByteLevel):
            pieces = [tok.id_to_token(i) for i in range(self.vocab_size)]
            lengths = np.array([len(p) for p in pieces], dtype=np.int32)
        else:
            pieces = tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
            if isinstance(tok.model, hf.models.WordPiece):
                pieces = [p.removeprefix(tok.model.continuing_subword_prefix) for p in pieces]
            lengths = np.array([len(p.encode()) for p in pieces], dtype=np.int32)
        added = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
        lengths[added + list(self.special_ids.values())] = 0
        return lengths

    def save(self, directory: str) -> dict:
        """tokenizer.json and the Hugging Face files it was read with (`files`)."""
        os.makedirs(directory, exist_ok=True)
        self.tokenizer.save(os.path.join(directory, "tokenizer.json"))
        for name, content in self.files.items():
            with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
                f.write(content if isinstance(content, str) else json.dumps(content, indent=2, ensure_ascii=False))
        spec = {"kind": "hf_json", "path": "tokenizer.json", "special_ids": self.special_ids}
        if self.eos_ids[1:]:  # several (a spec without them reads as before: the stores it fingerprints keep theirs)
            spec["eos_ids"] = list(self.eos_ids)
        return spec


def from_spec(spec: dict, base_dir: str | None = None) -> Tokenizer:
    """Rebuild a tokenizer from the dict its `save` returned; relative paths resolve against `base_dir`."""
    kind = spec["kind"]
    path = os.path.join(base_dir or "", spec.get("path", ""))
    if kind == "char":
        return CharTokenizer(spec["chars"], spec["specials"])
    if kind == "byte":
        return ByteTokenizer()
    if kind == "word":
        _require_files([path], "WordTokenizer needs its words.txt")
        with open(path, encoding="utf-8") as f:
            return WordTokenizer(f.read().split("\n")[:-1], spec["specials"])
    if kind == "sentencepiece":
        return SentencePieceTokenizer.load(path, extra_ids=spec.get("extra_ids", 0))
    if kind == "hf_json":
        return HFTokenizer.from_file(path, special_ids=spec.get("special_ids"), eos_ids=spec.get("eos_ids"))
    raise ValueError(f"unknown tokenizer spec kind {kind!r}; expected char, word, byte, sentencepiece or hf_json")


def build_tokenizer(
    kind: str, *, corpus: Iterable[str] | None = None, path: str | None = None, vocab_size: int | None = None, **kwargs
) -> Tokenizer:
    """Tokenizer from config. kinds: char (corpus), word (corpus, or path = a saved words.txt), byte, sentencepiece (path to .model, or corpus +
    vocab_size to train), gpt2 (path = folder with vocab.json + merges.txt), wordpiece (path = vocab.txt),
    hf_json (path = tokenizer.json). `kwargs` go to the constructor/trainer."""
    if kind not in KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    if kind == "char":
        if corpus is None:
            raise ValueError("tokenizer kind 'char' needs corpus= to build its character vocabulary")
        return CharTokenizer.from_corpus(corpus, **kwargs)
    if kind == "word":
        if path:  # the words.txt a run saved (e.g. a pretrained model's vocabulary, so the ids match)
            return from_spec({"kind": "word", "path": path, "specials": kwargs.get("specials", ("<eos>",))})
        if corpus is None:
            raise ValueError(
                "tokenizer kind 'word' needs corpus= to build its word vocabulary, or path= to a words.txt"
            )
        return WordTokenizer.from_corpus(corpus, **kwargs)
    if kind == "byte":
        return ByteTokenizer(**kwargs)
    if kind == "sentencepiece" and not path:
        if corpus is None or vocab_size is None:
            raise ValueError("tokenizer kind 'sentencepiece' needs path= (a .model) or corpus= and vocab_size=")
        return SentencePieceTokenizer.train(corpus, vocab_size, **kwargs)
    if not path:
        raise ValueError(f"tokenizer kind {kind!r} needs path= (config.data.tokenizer.path)")
    if kind == "sentencepiece":
        return SentencePieceTokenizer.load(path, **kwargs)
    if kind == "gpt2":
        return HFTokenizer.gpt2(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"), **kwargs)
    if kind == "wordpiece":
        return HFTokenizer.wordpiece(path, **kwargs)
    return HFTokenizer.from_file(path, **kwargs)
