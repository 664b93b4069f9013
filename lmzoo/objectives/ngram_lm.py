"""Count-based n-gram LM (lmzoo.models.ngram) fitted by train.py with the counting trainer (`lmzoo.trainers.counting`).

Batches hold whole sentences, one a row ending in `<eos>` ("targets" [B, S], padding weighted 0). Training is one pass over
the training sentences (config.train.steps is the number of batches; fewer fit the first sentences only). Evaluation fits
`ngram.fit_counts` (Kneser-Ney or add-k, per config.model) from the table on the host, once per table,
and scores every token of the batch with `ngram.log_prob` through a callback; the loss is the mean
negative log-likelihood over tokens and sentence ends, so exp(loss) is the usual perplexity.
"""

import dataclasses

import numpy as np

from lmzoo.data import readers
from lmzoo.data.loaders import SentenceLoader, sentence_rows
from lmzoo.models import ngram
from lmzoo.objectives import base
from lmzoo.trainers.counting import CountingTrainer


@dataclasses.dataclass(frozen=True)
class NgramLMConfig:
    max_ngrams: int = 1_000_000  # rows of the count table: distinct (history, token) n-grams it can hold

    def __post_init__(self):
        if self.max_ngrams < 1:
            raise ValueError(f"config.objective.max_ngrams={self.max_ngrams} must be positive")


class NgramLM(base.Objective):
    """Kneser-Ney / add-k n-gram LM over sentences of word-level text files (model_name "ngram")."""

    name = "ngram_lm"
    lora_base = None  # counts n-grams: no gradients, no adapters
    Config = NgramLMConfig
    evaluators = ("loss",)
    reader = readers.TEXT_FILES

    def check(self):
        super().check()
        if self.config.model_name != "ngram":
            raise ValueError(f"objective 'ngram_lm' fits model_name 'ngram', not {self.config.model_name!r}")

    def model(self) -> ngram.NgramConfig:
        return ngram.NgramConfig(**self.config.model.to_dict())

    def trainer(self, model):
        return CountingTrainer(model, self.eos_id(model), self.fields.max_ngrams)

    def eos_id(self, model: ngram.NgramConfig) -> int:
        """The word tokenizer puts `<eos>` after every word, i.e. last in a vocabulary of exactly vocab_size."""
        return model.vocab_size - 1

    def sentences(self, tokenizer, raw, where: str) -> tuple[np.ndarray, np.ndarray]:
        if tokenizer.eos_id != self.config.model.vocab_size - 1:
            raise ValueError(
                f"the tokenizer's <eos> is id {tokenizer.eos_id}; set --config.model.vocab_size="
                f"{tokenizer.eos_id + 1} (the word vocabulary with <eos> last)"
            )
        return sentence_rows(
            readers.text_file_tokens(raw, tokenizer, self.config.model.vocab_size, where),
            tokenizer.eos_id,
            self.config.data.seq_len,
        )

    def train_loader(self, tokenizer, raw, shard):
        ids, weights = self.sentences(tokenizer, raw, "train split")
        loader = SentenceLoader(ids, weights, self.config.train.batch_size, **dataclasses.asdict(shard))
        self.check_capacity(ids, weights, tokenizer.eos_id)
        if self.config.train.steps > loader.num_batches:
            raise ValueError(
                f"counting reads every training sentence at most once: {len(ids)} sentences make {loader.num_batches} "
                f"batches of {self.config.train.batch_size}; set --config.train.steps={loader.num_batches}"
            )
        return loader

    def check_capacity(self, ids: np.ndarray, weights: np.ndarray, eos_id: int) -> None:
        """Raises unless the training sentences' distinct (history, token) rows fit config.objective.max_ngrams
        (counted exactly only when the tokens alone could overflow the table)."""
        max_ngrams = self.fields.max_ngrams
        if weights.sum() <= max_ngrams:
            return
        distinct = len(ngram.count_ngrams(ids[weights > 0], order=self.config.model.order, eos_id=eos_id)["counts"])
        if distinct > max_ngrams:
            raise ValueError(
                f"the training split has {distinct} distinct {self.config.model.order}-gram rows, more than "
                f"config.objective.max_ngrams={max_ngrams}; set --config.objective.max_ngrams={distinct}"
            )

    def eval_batches(self, tokenizer, raw, shard):
        ids, weights = self.sentences(tokenizer, raw, "evaluation split")
        loader = SentenceLoader(ids, weights, self.config.eval.batch_size, **dataclasses.asdict(shard))
        return (loader.batch(step) for step in range(loader.num_batches))

    def step_summary(self):
        return f"{self.config.train.batch_size} sentences of at most {self.config.data.seq_len} tokens, counted (no gradients)"

    def input_shapes(self, batch_size):
        return {"targets": base.int_inputs((batch_size, self.config.data.seq_len))}

    def real_tokens(self, batch):
        return int(np.sum(batch["weights"]))
