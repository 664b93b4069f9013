"""Sentence classification on frozen ELMo features (Peters et al. 2018): a pretrained biLM (model_name "elmo",
read from `config.objective.bilm` = "ckpt:WORKDIR" of a `bilm` run) stays frozen; only the scalar mix, gamma
and a linear classifier over the mean of the mixed layers are trained.

`features` = "elmo" mixes every layer; "static" uses layer 0 alone (the biLM's token embeddings, no
context), the static-embedding baseline; "scratch" reads no biLM and trains layer 0's embedding table, from
the biLM's random initialisation, with the head: the same classifier trained from scratch. Rows are the TSV's
sentences (GLUE format) encoded with the biLM run's word tokenizer (config.data.tokenizer.path = its
WORKDIR/tokenizer/words.txt, so the ids are the biLM's) and framed by `<eos>` on both sides as in pretraining;
the "loss" evaluator reports loss and accuracy.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lmzoo.data import readers, transforms
from lmzoo.layers.embeddings import embed_lookup
from lmzoo.models import elmo
from lmzoo.objectives import base, losses
from lmzoo.trainers.state import Task

FEATURES = ("elmo", "static", "scratch")


@dataclasses.dataclass(frozen=True)
class ELMoClassifyConfig:
    bilm: str = ""  # "ckpt:WORKDIR" of a pretrained `bilm` run (frozen); empty with features "scratch"
    num_classes: int = 2
    features: str = "elmo"  # "elmo": every layer mixed; "static": layer 0 (embeddings); "scratch": layer 0 trained
    head_dropout_rate: float = 0.0

    def __post_init__(self):
        if self.features not in FEATURES:
            raise ValueError(f"unknown config.objective.features {self.features!r}; choose one of {FEATURES}")
        if self.num_classes < 2:
            raise ValueError(f"config.objective.num_classes={self.num_classes} must be at least 2")


def elmo_classify_task(bilm: elmo.BiLM, head: elmo.ELMoClassifier, features: str) -> Task:
    def layers_of(params, frozen, batch):
        """[L + 1, B, T, 2D] (elmo) or [1, B, T, 2D]: what the head mixes."""
        if features == "scratch":
            x = embed_lookup(params["embedding"], batch["tokens"])
            return jnp.concatenate([x, x], axis=-1)[None]  # layer 0 as BiLM builds it, from a trained table
        layers = bilm.apply({"params": frozen["bilm"]}, batch["tokens"], batch["weights"])[2]
        return jax.lax.stop_gradient(layers[:1] if features == "static" else layers)

    def init(rng, batch):
        bilm_params = bilm.init(rng, batch["tokens"], batch["weights"])["params"]
        params, frozen = {"embedding": bilm_params["embedding"]}, {"bilm": bilm_params}
        layers = jax.eval_shape(lambda: layers_of(nn.unbox(params), nn.unbox(frozen), batch))
        head_params = head.init(rng, jnp.zeros(layers.shape, layers.dtype), batch["weights"])["params"]
        if features == "scratch":
            return {**params, "head": head_params}, {}
        return {"head": head_params}, frozen

    def loss(params, frozen, carry, batch, rng, *, step, train):
        logits = head.apply(
            {"params": params["head"]},
            layers_of(params, frozen, batch),
            batch["weights"],
            deterministic=not train,
            rngs={"dropout": rng},
        )
        value, metrics = losses.weighted_loss(logits, batch["labels"], batch["example_weights"])
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


def framed_examples(texts: list[str], labels: np.ndarray, tokenizer, max_len: int) -> dict[str, np.ndarray]:
    """tokens, weights [N, max_len] (`<eos>` words `<eos>`, cut to max_len), labels [N]."""
    eos = tokenizer.eos_id
    rows = [([eos] + tokenizer.encode(text)[: max_len - 2] + [eos]) for text in texts]
    tokens = np.zeros((len(rows), max_len), np.int32)
    weights = np.zeros((len(rows), max_len), np.float32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)], weights[i, : len(row)] = row, 1.0
    return {"tokens": tokens, "weights": weights, "labels": np.asarray(labels, np.int32)}


class ELMoClassify(base.ExampleObjective):
    """Frozen-feature sentence classification on (sentence, label) TSV files (data.train_path / validation_path)."""

    name = "elmo_classify"
    Config = ELMoClassifyConfig
    reader = readers.LABELLED_TSV
    loss_is_token_nll = False  # a cross-entropy per example

    def check(self):
        super().check()
        if not self.config.data.tokenizer.get("path"):
            raise ValueError(
                "set --config.data.tokenizer.path=WORKDIR/tokenizer/words.txt of the biLM run: the "
                "classifier must read the biLM's word ids"
            )
        if self.fields.features == "scratch":
            if self.fields.bilm:
                raise ValueError(
                    f"config.objective.bilm={self.fields.bilm!r}: features 'scratch' reads no biLM; leave it empty"
                )
        elif not self.fields.bilm.startswith("ckpt:"):
            raise ValueError(
                f"config.objective.bilm={self.fields.bilm!r}: name the pretrained biLM as 'ckpt:WORKDIR' of a bilm run"
            )

    def model(self):
        return elmo.BiLM(elmo.ELMoConfig(**self.config.model.to_dict()))

    def task(self, model):
        fields = self.fields
        return elmo_classify_task(
            model, elmo.ELMoClassifier(fields.num_classes, fields.head_dropout_rate), fields.features
        )

    def frozen_roles(self):
        return {"bilm": base.Role(self.fields.bilm, "elmo", self.config.model.to_dict())}

    def input_shapes(self, batch_size):
        shape = (batch_size, self.config.data.seq_len)
        return {"tokens": base.int_inputs(shape), "weights": base.float_inputs(shape)}

    def examples(self, tokenizer, raw, where):
        texts, labels = raw
        examples = framed_examples([" ".join(t) for t in texts], labels, tokenizer, self.config.data.seq_len)
        transforms.check_token_ids(examples["tokens"], self.config.model.vocab_size, where=where)
        return examples

    def example_transform(self, tokenizer):
        return lambda rows, ids, epochs: {**rows, "example_weights": np.ones(len(ids), np.float32)}

    def real_tokens(self, batch):
        return int(np.sum(batch["weights"]))
