"""Sequence classification: an encoder (or decoder) under a head, fine-tuned on labelled TSV files (GLUE format)."""

import dataclasses

import jax.numpy as jnp
import numpy as np

from lmzoo import tokenizers
from lmzoo.data import readers, transforms
from lmzoo.models import heads
from lmzoo.objectives import base, losses
from lmzoo.trainers.state import Task

INPUT_FORMATS = ("bert", "gpt")


@dataclasses.dataclass(frozen=True)
class ClassificationConfig:
    """Attributes:
    num_classes: labels are 0 .. num_classes - 1.
    head: pooler (BERT/ALBERT) | dense_tanh (RoBERTa) | dense_relu (DistilBERT) | linear.
    pooling: with a non-pooler head, the token(s) read: first | last | mean.
    head_dropout_rate: dropout before the classifier.
    input_format: "bert": `[CLS] a [SEP] (b [SEP])` with token types; "gpt": `[START] a ([DELIM] b) [EXTRACT]`
        (Radford et al. 2018) for decoders, the three markers being new ids after the tokenizer's
        vocabulary (config.model.vocab_size must hold them; pretrained token tables grow to it), read
        at [EXTRACT] by pooling="last".
    """

    num_classes: int = 2
    head: str = "pooler"
    pooling: str = "first"
    head_dropout_rate: float = 0.1
    input_format: str = "bert"

    def __post_init__(self):
        if self.num_classes < 2:
            raise ValueError(f"config.objective.num_classes={self.num_classes} must be at least 2")
        if self.head not in heads.HEAD_STYLES:
            raise ValueError(f"unknown config.objective.head {self.head!r}; choose one of {heads.HEAD_STYLES}")
        if self.pooling not in heads.POOLINGS:
            raise ValueError(f"unknown config.objective.pooling {self.pooling!r}; choose one of {heads.POOLINGS}")
        if self.input_format not in INPUT_FORMATS:
            raise ValueError(
                f"unknown config.objective.input_format {self.input_format!r}; choose one of {INPUT_FORMATS}"
            )
        if self.input_format == "gpt" and self.pooling != "last":
            raise ValueError(
                "input_format='gpt' is read at its final [EXTRACT] token: set config.objective.pooling='last'"
            )


def classify_logits(model, params, batch, rng=None, *, train: bool = False):
    """logits [B, C] of a SequenceClassifier for batch inputs / token_types / segment_ids [B, T]."""
    return model.apply(
        {"params": params},
        batch["inputs"],
        token_types=batch.get("token_types"),
        segment_ids=batch.get("segment_ids"),
        deterministic=not train,
        rngs=None if rng is None else {"dropout": rng},
    )


def classification_task(model) -> Task:
    """Sequence classification: model(tokens, token_types, segment_ids) -> logits [B, C]; batch["labels"] [B]."""

    def init(rng, batch):
        params = model.init(
            {"params": rng, "dropout": rng},
            batch["inputs"],
            token_types=batch.get("token_types"),
            segment_ids=batch.get("segment_ids"),
        )["params"]
        return params, {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        logits = classify_logits(model, params, batch, rng, train=train)
        weights = batch.get("example_weights", jnp.ones(batch["labels"].shape, jnp.float32))
        value, metrics = losses.weighted_loss(logits, batch["labels"], weights)
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


def classification_examples(
    texts: list[tuple[str, ...]],
    labels: np.ndarray,
    tokenizer: tokenizers.Tokenizer,
    max_len: int,
    input_format: str = "bert",
) -> dict[str, np.ndarray]:
    """Labelled examples truncated to max_len: tokens, segment_ids (and token_types for "bert") [N, T]; labels [N].

    "bert": [CLS] a [SEP] (b [SEP]); "gpt": [START] a ([DELIM] b) [EXTRACT] with the markers numbered
    tokenizer.vocab_size, + 1, + 2."""
    encoded = [tokenizer.encode_batch(list(column)) for column in zip(*texts, strict=True)]
    rows = []
    for parts in zip(*encoded, strict=True):
        second = parts[1] if len(parts) > 1 else None
        if input_format == "gpt":
            start = tokenizer.vocab_size
            rows.append(
                transforms.gpt_classifier_example(
                    parts[0],
                    second,
                    start_id=start,
                    delim_id=start + 1,
                    extract_id=start + 2,
                    max_len=max_len,
                    pad_id=tokenizer.pad_id or 0,
                )
            )
        else:
            rows.append(
                transforms.pair_example(
                    parts[0],
                    second,
                    cls_id=tokenizer.cls_id,
                    sep_id=tokenizer.sep_id,
                    max_len=max_len,
                    pad_id=tokenizer.pad_id,
                )
            )
    out = {
        "tokens": np.stack([r["tokens"] for r in rows]),
        "segment_ids": np.stack([r["segment_ids"] for r in rows]),
        "labels": labels,
    }
    if input_format == "bert":
        out["token_types"] = np.stack([r["token_type_ids"] for r in rows])
    return out


def classification_rows(rows: dict[str, np.ndarray], ids: np.ndarray, epochs: np.ndarray) -> dict[str, np.ndarray]:
    """ExampleLoader transform for labelled text: "tokens" become "inputs"."""
    return {"inputs": rows["tokens"], **{k: v for k, v in rows.items() if k != "tokens"}}


class Classification(base.ExampleObjective):
    """Fine-tuning on (text[, text pair], label) rows of `data.train_path` / `data.validation_path` TSV files."""

    name = "classify"
    lora_heads = "classifier|head_dense"  # the new head (PEFT's modules_to_save for sequence classification)
    Config = ClassificationConfig
    reader = readers.LABELLED_TSV
    evaluators = ("loss", "classification")
    loss_is_token_nll = False  # a cross-entropy per example

    def model(self):
        o = self.fields
        return heads.SequenceClassifier(
            super().model(), o.num_classes, head=o.head, pooling=o.pooling, dropout_rate=o.head_dropout_rate
        )

    def task(self, model):
        return classification_task(model)

    def input_shapes(self, batch_size):
        shape = (batch_size, self.config.data.seq_len)
        shapes = {"inputs": base.int_inputs(shape), "segment_ids": base.int_inputs(shape)}
        return shapes if self.fields.input_format == "gpt" else {**shapes, "token_types": base.int_inputs(shape)}

    def examples(self, tokenizer, raw, where):
        texts, labels = raw
        num_classes = self.fields.num_classes
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise ValueError(
                f"{where} labels span [{labels.min()}, {labels.max()}] but config.objective.num_classes={num_classes}"
            )
        input_format = self.fields.input_format
        if input_format == "gpt" and self.config.model.vocab_size < tokenizer.vocab_size + 3:
            raise ValueError(
                f"input_format='gpt' numbers [START] [DELIM] [EXTRACT] after the tokenizer's {tokenizer.vocab_size} ids: "
                f"set config.model.vocab_size to at least {tokenizer.vocab_size + 3}"
            )
        examples = classification_examples(texts, labels, tokenizer, self.config.data.seq_len, input_format)
        transforms.check_token_ids(examples["tokens"], self.config.model.vocab_size, where=where)
        return examples

    def example_transform(self, tokenizer):
        return classification_rows
