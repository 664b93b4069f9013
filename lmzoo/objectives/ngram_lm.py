"""Count-based n-gram LM (lmzoo.models.ngram) fitted by train.py with the counting trainer (`lmzoo.trainers.counting`).

Batches hold whole sentences, one a row ending in `<eos>` ("targets" [B, S], padding weighted 0). Training is one pass over
the training sentences (config.train.steps is the number of batches; fewer fit the first sentences only). Evaluation fits
`ngram.fit_counts` (Kneser-Ney or add-k, per config.model) from the table on the host, once per table,
and scores every token of the batch with `ngram.log_prob` through a callback; the loss is the mean
negative log-likelihood over tokens and sentence ends, so exp(loss) is the usual perplexity.
"""

import dataclasses
import math
from collections.abc import Callable, Iterator

import numpy as np

from lmzoo.data import pipeline
from lmzoo.models import ngram
from lmzoo.objectives import base
from lmzoo.objectives.recurrent_lm import TextFiles
from lmzoo.trainers.counting import CountingTrainer


def sentence_rows(tokens: np.ndarray, eos_id: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """[N] stream of sentences each ending in eos -> (ids [sentences, max_len], weights), padded with 0 / weight 0."""
    ends = np.flatnonzero(tokens == eos_id) + 1
    if len(ends) == 0 or ends[-1] != len(tokens):
        raise ValueError("the stream must end with <eos>: every sentence (line) ends with one")
    starts = np.concatenate([[0], ends[:-1]])
    lengths = ends - starts
    if lengths.max() > max_len:
        raise ValueError(f"sentence {int(np.argmax(lengths))} has {lengths.max()} tokens with its <eos>, more than "
                         f"config.data.seq_len={max_len}; raise config.data.seq_len to at least {lengths.max()}")  # fmt: skip
    columns = np.arange(max_len)
    weights = (columns < lengths[:, None]).astype(np.float32)
    ids = np.where(weights > 0, tokens[np.minimum(starts[:, None] + columns, len(tokens) - 1)], 0)
    return ids.astype(np.int32), weights


@dataclasses.dataclass(frozen=True)
class NgramLMConfig:
    max_ngrams: int = 1_000_000  # rows of the count table: distinct (history, token) n-grams it can hold

    def __post_init__(self):
        if self.max_ngrams < 1:
            raise ValueError(f"config.objective.max_ngrams={self.max_ngrams} must be positive")


class NgramLM(TextFiles):
    """Kneser-Ney / add-k n-gram LM over sentences of word-level text files (model_name "ngram")."""

    name = "ngram_lm"
    Config = NgramLMConfig
    evaluators = ("loss",)

    def check(self, config):
        super().check(config)
        if config.model_name != "ngram":
            raise ValueError(f"objective 'ngram_lm' fits model_name 'ngram', not {config.model_name!r}")

    def model(self, config) -> ngram.NgramConfig:
        return ngram.NgramConfig(**config.model.to_dict())

    def trainer(self, config, model):
        return CountingTrainer(model, self.eos_id(config, model), self.fields(config).max_ngrams)

    def eos_id(self, config, model: ngram.NgramConfig) -> int:
        """The word tokenizer puts `<eos>` after every word, i.e. last in a vocabulary of exactly vocab_size."""
        return model.vocab_size - 1

    def sentences(self, config, tokenizer, raw, where: str) -> tuple[np.ndarray, np.ndarray]:
        if tokenizer.eos_id != config.model.vocab_size - 1:
            raise ValueError(f"the tokenizer's <eos> is id {tokenizer.eos_id}; set --config.model.vocab_size="
                             f"{tokenizer.eos_id + 1} (the word vocabulary with <eos> last)")  # fmt: skip
        return sentence_rows(self.token_ids(config, tokenizer, raw, where), tokenizer.eos_id, config.data.seq_len)

    def train_loader(self, config, tokenizer, raw, shard):
        ids, weights = self.sentences(config, tokenizer, raw, "train split")
        loader = SentenceLoader(ids, weights, config.train.batch_size, **dataclasses.asdict(shard))
        self.check_capacity(config, ids, weights, tokenizer.eos_id)
        if config.train.steps > loader.num_batches:
            raise ValueError(f"counting reads every training sentence at most once: {len(ids)} sentences make {loader.num_batches} "
                             f"batches of {config.train.batch_size}; set --config.train.steps={loader.num_batches}")  # fmt: skip
        return loader

    def check_capacity(self, config, ids: np.ndarray, weights: np.ndarray, eos_id: int) -> None:
        """Raises unless the training sentences' distinct (history, token) rows fit config.objective.max_ngrams
        (counted exactly only when the tokens alone could overflow the table)."""
        max_ngrams = self.fields(config).max_ngrams
        if weights.sum() <= max_ngrams:
            return
        distinct = len(ngram.count_ngrams(ids[weights > 0], order=config.model.order, eos_id=eos_id)["counts"])
        if distinct > max_ngrams:
            raise ValueError(f"the training split has {distinct} distinct {config.model.order}-gram rows, more than "
                             f"config.objective.max_ngrams={max_ngrams}; set --config.objective.max_ngrams={distinct}")  # fmt: skip

    def eval_batches(self, config, tokenizer, raw, shard):
        ids, weights = self.sentences(config, tokenizer, raw, "evaluation split")
        loader = SentenceLoader(ids, weights, config.eval.batch_size, **dataclasses.asdict(shard))
        return (loader.batch(step) for step in range(loader.num_batches))

    def step_summary(self, config):
        return f"{config.train.batch_size} sentences of at most {config.data.seq_len} tokens, counted (no gradients)"

    def input_shapes(self, config, batch_size):
        return {"targets": base.int_inputs((batch_size, config.data.seq_len))}

    def real_tokens(self, batch):
        return int(np.sum(batch["weights"]))


def padded_width(weights: np.ndarray, multiple: int) -> int:
    """weights [B, T] -> the columns a batch needs: its last weighted column + 1 rounded up to `multiple`, at
    most T (T when multiple is 0). The rounding bounds the distinct widths, hence the recompilations of a jitted
    step, by T / multiple."""
    t = weights.shape[1]
    if multiple <= 0:
        return t
    used = int(np.max(np.flatnonzero(np.any(weights > 0, axis=0)), initial=-1)) + 1
    return min(t, max(multiple, -(-used // multiple) * multiple))


@dataclasses.dataclass(frozen=True)
class SentenceLoader:
    """Batch `step` is sentences [step * B, (step + 1) * B) in file order; the last batch is padded with weight 0.

    With length_multiple > 0 the columns past the global batch's longest sentence, rounded up to that
    multiple, are cut (`padded_width`), so short sentences are not padded to the corpus's longest."""

    ids: np.ndarray
    weights: np.ndarray
    batch_size: int
    process_index: int = 0
    process_count: int = 1
    length_multiple: int = 0

    @property
    def num_batches(self) -> int:
        return math.ceil(len(self.ids) / self.batch_size)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        first = step * self.batch_size
        return self.rows(np.arange(first, min(first + self.batch_size, len(self.ids))))

    def rows(self, order: np.ndarray) -> dict[str, np.ndarray]:
        """The global batch of sentences `order` [<= B]: this process's rows, padded to B / processes with weight 0."""
        width = padded_width(self.weights[order], self.length_multiple)
        local = self.batch_size // self.process_count
        mine = order[self.process_index * local : (self.process_index + 1) * local]
        ids, weights = self.ids[mine, :width], self.weights[mine, :width]
        missing = local - len(ids)
        pad = lambda x: np.pad(x, ((0, missing), (0, 0)))  # noqa: E731
        return {"targets": pad(ids), "weights": pad(weights)}


@dataclasses.dataclass(frozen=True)
class ShuffledSentences:
    """Training batch `step`: `batch_size` sentences of a fresh permutation per epoch from (seed, epoch), bucketed
    by length, then `transform`ed (e.g. decoder inputs added).

    The permuted stream is cut into pools of `pool_batches` batches; a pool's sentences are sorted by length
    and cut into batches, taken in an order shuffled from (seed, pool). Each sentence is still read once an
    epoch, and a batch holds sentences of similar length, so the loader's `length_multiple` trims most padding.
    `transform(batch, rng)` gets a generator fixed by (seed, step, process), so random edits survive restarts."""

    sentences: SentenceLoader
    seed: int
    pool_batches: int = 1
    transform: Callable[[dict[str, np.ndarray], np.random.Generator], dict[str, np.ndarray]] | None = None

    def batch(self, step: int) -> dict[str, np.ndarray]:
        size, count = self.sentences.batch_size, len(self.sentences.ids)
        pool, slot = divmod(step, self.pool_batches)
        first = pool * self.pool_batches * size
        _, members = pipeline.epoch_permutation(np.arange(first, first + self.pool_batches * size), count, self.seed)
        members = members[np.argsort(np.sum(self.sentences.weights[members], axis=1), kind="stable")]
        position = np.random.default_rng([self.seed, pool, 1]).permutation(self.pool_batches)[slot]
        batch = self.sentences.rows(members[position * size : (position + 1) * size])
        if self.transform is None:
            return batch
        return self.transform(batch, np.random.default_rng([self.seed, step, self.sentences.process_index, 2]))


def sentence_step_summary(config, length_multiple: int) -> str:
    """The start summary's "per step" of a sentence loader with `length_multiple` (see `SentenceLoader`)."""
    b, t = config.train.batch_size, config.data.seq_len
    if length_multiple <= 0:
        return f"{b} sentences x {t} tokens (padded) = {b * t:,} token positions"
    return (f"{b} sentences, each batch padded to its longest sentence rounded up to {length_multiple} "
            f"(at most {t} tokens)")  # fmt: skip


def length_sorted_batches(sentences: SentenceLoader) -> Iterator[dict[str, np.ndarray]]:
    """Every sentence once, in batches of similar length (the split sorted by length), the batches in a fixed
    shuffled order: the first batch holds sentences of a typical length, not the shortest."""
    order = np.argsort(np.sum(sentences.weights, axis=1), kind="stable")
    size = sentences.batch_size
    for index in np.random.default_rng(0).permutation(sentences.num_batches):
        yield sentences.rows(order[index * size : (index + 1) * size])
