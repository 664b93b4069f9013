"""What an objective is: one class per training recipe, registered by name in `lmzoo.objectives.REGISTRY`.

An objective owns everything that differs between recipes: its config fields (a frozen dataclass;
`config.objective` is `name` plus exactly those fields), how its data is read, tokenized and batched,
the shapes of the batch its model is initialised with (so a checkpoint restores without reading any
data), the network (a family model, maybe wrapped in a head), the `Task` (init + loss) or a whole
trainer, frozen subtrees loaded from elsewhere (a distillation teacher), and the evaluators that
`eval.py` and in-loop evaluation run. The loop, checkpoints and evaluation are written once around it.
"""

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from lmzoo import lora, models, tokenizers, weights
from lmzoo.convert import hf
from lmzoo.data import chat, comparisons, pipeline, problems, readers
from lmzoo.data.loaders import Shard
from lmzoo.trainers import optim, supervised
from lmzoo.trainers.state import Task
from lmzoo.weights import Role

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class NoFields:
    """The config of an objective without settings of its own."""


@dataclasses.dataclass(frozen=True)
class ComparisonSplitConfig:
    """Attributes:
    heldout_fraction: share of the prompts of config.data.path held out (by a hash of the prompt) and never trained on.
    split_seed: seed of that hash; keep it equal across SFT, reward model and PPO.
    """

    heldout_fraction: float = 0.1
    split_seed: int = 0

    def __post_init__(self):
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"config.objective.heldout_fraction={self.heldout_fraction} must lie in (0, 1), e.g. 0.1")


def int_inputs(shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, np.int32)


def float_inputs(shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, np.float32)


class Objective:
    """Base class: a language-modelling recipe on documents (`config.data`, read as token stores: `readers.DOCUMENTS`).

    Built once per run from the run's config (`lmzoo.objectives.build`): `self.config` is that config and
    `self.fields` its objective section as the typed, validated `Config`. Subclasses set `name` and `Config`
    and override what differs. Raw data of a split is whatever `read` returns for it (documents by default);
    the tokenizer is trained on `corpus(raw)` when it needs a corpus.
    """

    name: str = ""
    Config: type = NoFields
    reader: readers.Reader = readers.DOCUMENTS  # how raw splits are read (lmzoo.data.readers)
    evaluators: tuple[str, ...] = ("loss",)  # names in lmzoo.evaluation.EVALUATORS
    loss_is_token_nll: bool = True  # "loss" is a mean token NLL: metrics add perplexity and bits per token/char/byte
    # The frozen entry LoRA adapts (`trainers.lora`): init_from's weights by default; None: a trainer of its own
    # without adapters (counting, truncated BPTT).
    lora_base: str | None = lora.BASE
    lora_heads: str = ""  # modules no base provides, trained in full beside the adapters (a classifier's head)
    # Why the loss applies its model without dropout, if it does: LoRA's dropout then has no rng to draw from.
    no_dropout_because: str = ""

    def __init__(self, config: ml_collections.ConfigDict):
        """config: the run's whole config, its objective section filled in (`lmzoo.objectives.build`)."""
        self.config = config
        self.fields = self.Config(**{k: v for k, v in config.objective.items() if k != "name"})
        self._splits: dict[str, Any] | None = None

    def check(self) -> None:
        """Checks across config sections (e.g. lengths against the model's positions); raises ValueError."""
        self.reader.check(self.config)
        check_length(self.config, "seq_len", self.config.data.seq_len)
        self.check_lora()

    def lora_config(self) -> lora.LoraConfig | None:
        """config.lora (None when off) with this objective's heads added to the modules trained in full."""
        adapted = lora.from_config(self.config)
        if adapted is None or not self.lora_heads:
            return adapted
        patterns = [p for p in (adapted.train_in_full, self.lora_heads) if p]
        return dataclasses.replace(adapted, train_in_full="|".join(f"(?:{p})" for p in patterns))

    def check_lora(self) -> None:
        """config.lora's values, and that this objective can train adapters over a base it reads again at resume."""
        adapted = self.lora_config()
        if adapted is None:
            return
        if adapted.dropout and self.no_dropout_because:
            raise ValueError(
                f"config.lora.dropout={adapted.dropout}: objective {self.name!r} applies its model without dropout "
                f"({self.no_dropout_because}): set --config.lora.dropout=0.0"
            )
        if self.lora_base is None:
            raise ValueError(
                f"config.lora.targets={adapted.targets!r}: objective {self.name!r} runs a trainer of its own, which "
                "does not train LoRA adapters; set --config.lora.targets=''"
            )
        if self.lora_base == lora.BASE and not self.config.get("init_from"):
            raise ValueError(
                f"config.lora.targets={adapted.targets!r} adapts a frozen base, read again when the run resumes: set "
                "config.init_from to it ('hf:PATH' or 'ckpt:WORKDIR')"
            )

    def value_problems(self, *, data_parallel_size: int, batches: bool) -> list[str]:
        """Out-of-range values this objective reads, each naming its field and the fix (listed with the config's
        own by `config.check_values`); `batches`: whether batch sizes must split over `data_parallel_size` devices."""
        return []

    def read(self) -> dict[str, Any]:
        """{"train": raw, "validation": raw} from the config, by the objective's reader: read once per objective, so
        the run and the objective's own uses (e.g. PPO's normalisation prompts) share one reading."""
        if self._splits is None:
            self._splits = self.reader.splits(self.config)
        return self._splits

    def read_file(self, path: str) -> Any:
        """The raw examples of one file given on the command line (eval.py --data)."""
        return self.reader.file(self.config, path)

    def corpus(self, raw: Any) -> list[str]:
        """The texts of a split's raw examples (a tokenizer trained on the run's data learns from them)."""
        return self.reader.texts(raw)

    def model(self) -> nn.Module:
        return models.build_model(self.config.model_name, self.config.model.to_dict())

    def task(self, model: nn.Module) -> Task:
        raise NotImplementedError

    def trainer(self, model: nn.Module):
        """The trainer (`lmzoo.trainers`) the loop runs: supervised on `task` by default (through LoRA adapters with
        config.lora.targets set: `lmzoo.lora.lora_task`)."""
        tx, schedule = optim.make_optimizer(self.config.optim)
        task, adapted = self.task(model), self.lora_config()
        if adapted is not None:
            task = lora.lora_task(task, adapted, base=self.lora_base)
        return supervised.SupervisedTrainer(
            task,
            tx,
            schedule,
            self.input_shapes(self.config.train.batch_size),
            grad_accum_steps=self.config.train.grad_accum_steps,
        )

    def step_summary(self) -> str:
        """What one training step reads, for the start summary."""
        b, t = self.config.train.batch_size, self.config.data.seq_len
        return f"{b} sequences x {t} tokens = {b * t:,} tokens"

    def input_shapes(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The arrays `task.init` reads, at the global batch size."""
        return {"inputs": int_inputs((batch_size, self.config.data.seq_len))}

    def train_loader(self, tokenizer: tokenizers.Tokenizer, raw: Any, shard: Shard):
        """A loader whose `batch(step)` is a pure function of (seed, step, process)."""
        raise NotImplementedError

    def eval_batches(self, tokenizer: tokenizers.Tokenizer, raw: Any, shard: Shard) -> Iterator[Batch]:
        """Every example of a split once (padding rows weighted 0)."""
        raise NotImplementedError

    def window_loader(self, tokenizer, raw: readers.CorpusSplit, shard: Shard, length: int, transform=None):
        """Training batches of packed `length`-token windows of the run's documents (or its stores' mixture)."""
        splits, weights, names = raw.mixture(tokenizer)
        return pipeline.LMLoader(
            splits,
            self.config.train.batch_size,
            length,
            seed=self.config.train.seed,
            sampler=self.config.data.sampler,
            transform=transform,
            weights=weights,
            names=names,
            **dataclasses.asdict(shard),
        )

    def window_eval_batches(self, tokenizer, raw: readers.CorpusSplit, shard: Shard, length: int, transform=None):
        """Every target of a split once (of each store of a mixture), in consecutive `length`-token windows."""
        return pipeline.eval_batches(
            raw.token_splits(tokenizer),
            self.config.eval.batch_size,
            length,
            transform=transform,
            **dataclasses.asdict(shard),
        )

    def frozen_roles(self) -> dict[str, Role]:
        """The frozen models this objective trains against, by their entry in the state's frozen tree (see `Role`)."""
        return {}

    def roles(self) -> dict[str, Role]:
        """Every frozen model the run reads: the objective's (`frozen_roles`) and, under LoRA, the base its adapters
        adapt when no role of the objective holds it (`lora_base`: config.init_from's weights)."""
        roles, adapted = dict(self.frozen_roles()), self.lora_config()
        if adapted is not None and self.lora_base == lora.BASE:
            cfg = self.config
            check = functools.partial(lora.check_base, adapted, cfg.init_from)
            roles[lora.BASE] = Role(
                cfg.init_from, cfg.model_name, cfg.model.to_dict(), allow_partial=cfg.init_from_partial, check=check
            )
        if adapted is not None and self.lora_base in roles:  # the base its adapters adapt, held in its dtype
            roles[self.lora_base] = dataclasses.replace(roles[self.lora_base], adapters=adapted)
        return roles

    def prepare_batch(self) -> Batch | None:
        """What the trainer's `prepare` reads before a fresh run's first step (PPO: the prompts its reward normalisation
        samples); None when there is nothing to prepare."""
        return None

    def init_params(self, params: Any, frozen: Any) -> Any:
        """Fresh trainable params adjusted before training starts (e.g. copied from `frozen`): both trees as the
        state holds them (arrays in their shardings); what this returns is placed in the params' shardings."""
        return params

    def close(self) -> None:
        """Releases what the objective holds beyond its run's arrays (PPO: its reward functions' worker processes)."""

    def real_tokens(self, batch: Batch) -> int:
        """Non-padding tokens of a host batch (what tokens_per_sec counts)."""
        if "segment_ids" in batch:
            return int(np.count_nonzero(batch["segment_ids"]))
        return int(batch["inputs"].size)


class ExampleObjective(Objective):
    """An objective that reads fixed examples (labelled text, comparison pairs): each split becomes example arrays
    [M, ...] (`examples`), drawn into batches by (seed, step, process) (`pipeline.ExampleLoader`)."""

    def examples(self, tokenizer: tokenizers.Tokenizer, raw: Any, where: str) -> Batch:
        """The example arrays [M, ...] of a split's raw examples; `where` names the split in errors."""
        raise NotImplementedError

    def example_transform(self, tokenizer: tokenizers.Tokenizer) -> Callable[[Batch, np.ndarray, np.ndarray], Batch]:
        """How drawn rows (with the ids [B] and epochs [B] of their examples) become a batch: as they are by default."""
        return lambda rows, ids, epochs: dict(rows)

    def _example_loader(self, tokenizer, raw, shard: Shard, batch_size: int, where: str) -> pipeline.ExampleLoader:
        return pipeline.ExampleLoader(
            self.examples(tokenizer, raw, where),
            batch_size,
            seed=self.config.train.seed,
            transform=self.example_transform(tokenizer),
            **dataclasses.asdict(shard),
        )

    def train_loader(self, tokenizer, raw, shard):
        return self._example_loader(tokenizer, raw, shard, self.config.train.batch_size, "train split")

    def eval_batches(self, tokenizer, raw, shard):
        return self._example_loader(
            tokenizer, raw, shard, self.config.eval.batch_size, "evaluation split"
        ).eval_batches()


def check_length(config: ml_collections.ConfigDict, field: str, length: int) -> None:
    """Raises unless `length` tokens (+ the family's position offset) fit the model's position table."""
    max_len, offset = config.model.get("max_len"), config.model.get("position_offset", 0)
    if max_len is not None and length + offset > max_len:
        raise ValueError(
            f"config.data.{field}={length} (+ position_offset {offset}) is longer than the model's "
            f"positions (config.model.max_len={max_len}); shorten {field} or raise max_len"
        )


def sentence_step_summary(config: ml_collections.ConfigDict, length_multiple: int) -> str:
    """The start summary's "per step" of a sentence loader with `length_multiple` (`lmzoo.data.loaders.SentenceLoader`)."""
    b, t = config.train.batch_size, config.data.seq_len
    if length_multiple <= 0:
        return f"{b} sentences x {t} tokens (padded) = {b * t:,} token positions"
    return (
        f"{b} sentences, each batch padded to its longest sentence rounded up to {length_multiple} (at most {t} tokens)"
    )


CORPUS_KINDS = ("char", "word", "sentencepiece")  # tokenizer kinds learnt from the run's data unless given a path


def configured_tokenizer(config, corpus: Callable[[], list[str]] | None = None) -> tokenizers.Tokenizer:
    """The tokenizer config.data.tokenizer describes, built anew: config.init_from's (kind "init_from"), a token
    store's own (source "store"), or built by kind, a kind learnt from the run's data reading `corpus()`."""
    spec = config.data.tokenizer.to_dict()
    kind = spec.pop("kind")
    if kind == "init_from":  # the tokenizer that comes with config.init_from's weights
        return weights.pretrained_tokenizer(config.init_from)
    if config.data.source == "store":
        return readers.open_stores(config)[0].tokenizer()
    learnt = corpus is not None and kind in CORPUS_KINDS and not spec.get("path")
    return tokenizers.build_tokenizer(kind, corpus=corpus() if learnt else None, **spec)


def fixed_tokenizer(config) -> tokenizers.Tokenizer:
    """The run's tokenizer when it needs no corpus (byte, or a file given by path): the reward model and PPO read
    its special ids while building their task, before any data is read."""
    spec = config.data.tokenizer.to_dict()
    if spec["kind"] not in ("init_from", "byte") and not spec.get("path"):
        raise ValueError(
            f"objective {config.objective.name!r} needs a tokenizer fixed before reading data: "
            "set config.data.tokenizer.kind='byte' or give config.data.tokenizer.path"
        )
    tokenizer = configured_tokenizer(config)
    if tokenizer.pad_id is None:
        raise ValueError(f"objective {config.objective.name!r} needs a tokenizer with a <pad> id (e.g. kind='byte')")
    return tokenizer


def demonstration_rows(config, tokenizer, raw, where: str) -> dict[str, np.ndarray]:
    """Packed rows [M, data.seq_len] of prompt -> chosen reply, weighted on the reply: HH-RLHF comparisons, chat
    rows rendered through the run's chat template (weighted on assistant turns), or problems -> their worked
    solutions (GSM8K). SFT's examples, PPO-ptx's demonstrations."""
    seq_len, vocab_size = config.data.seq_len, config.model.vocab_size
    if problems.holds_problems(raw):
        raw = [comparisons.Comparison(p.prompt, " " + problems.solution(p.fields), "") for p in raw]
    elif chat.holds_conversations(raw):
        template = chat.template_for(config, hf.resolve_folder)
        return chat.sft_rows(raw, template, tokenizer, seq_len=seq_len, vocab_size=vocab_size, where=where)
    return comparisons.sft_rows(raw, tokenizer, seq_len=seq_len, vocab_size=vocab_size, where=where)
