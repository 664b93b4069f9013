"""Gaussian VAE-LM objective (Bowman et al. 2016): the ELBO with KL annealing and free bits, and the
importance-weighted bound (Burda et al. 2016) used to report perplexity.

Per sentence x: ELBO = E_q[log p(x | z)] - KL(q(z | x) || N(0, I)), one reparameterised sample. Training
minimises (reconstruction + beta(step) * KL term) per token, beta rising linearly from 0 to 1 over
`kl_anneal_steps` (0: beta = 1 throughout); with `free_bits` = lambda > 0 the KL term is
sum_d max(lambda, mean over the batch of KL_d) (Kingma et al. 2016), so dimensions under lambda nats get
no push towards the prior. Evaluation uses beta = 1 and no free bits: the "loss" metric is -ELBO per
token (exp of it bounds the perplexity from above); the "latent" evaluator adds the tighter bound
log p(x) >= log mean_k p(x, z_k) / q(z_k | x) with K samples, the KL and the active units.

Data: sentences of the text files (one a line) as rows: targets = the sentence and its `<eos>`, inputs =
`<eos>` (as beginning of sentence) and the sentence; the encoder reads the targets. Batches group sentences
of similar length (`lmzoo.data.loaders.ShuffledSentences`, `length_sorted_batches`) and each is cut to its longest
sentence rounded up to `length_multiple`: PTB's sentences average 22 tokens against a longest of 83.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lmzoo.data import readers
from lmzoo.data.loaders import SentenceLoader, ShuffledSentences, length_sorted_batches, sentence_rows
from lmzoo.models import vae_lm
from lmzoo.objectives import base, losses
from lmzoo.trainers.state import Task


def kl_weight(step: jax.Array, anneal_steps: int) -> jax.Array:
    """Linear KL annealing: step / anneal_steps capped at 1 (1 throughout when anneal_steps is 0)."""
    if anneal_steps <= 0:
        return jnp.ones((), jnp.float32)
    return jnp.minimum(1.0, jnp.asarray(step, jnp.float32) / anneal_steps)


def kl_term(kl: jax.Array, free_bits: float) -> jax.Array:
    """kl [B, Z] -> the batch's summed KL penalty: sum_d max(free_bits, mean_b kl[b, d]) * B (plain sum at 0)."""
    if free_bits <= 0:
        return jnp.sum(kl)
    return jnp.sum(jnp.maximum(free_bits, jnp.mean(kl, axis=0))) * kl.shape[0]


def sentence_nll(logits: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
    """logits [B, T, V] -> -log p(sentence) [B] over its weighted tokens."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    token = jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
    return -jnp.sum(token * batch["weights"], axis=1)


@functools.partial(jax.jit, static_argnames=("model", "num_samples"))
def importance_weighted_bound(
    model: vae_lm.VAELM, params, batch: dict[str, jax.Array], rng: jax.Array, *, num_samples: int
):
    """(iw [B], elbo [B], mu [B, Z], kl [B]): log (1/K) sum_k p(x, z_k) / q(z_k | x) with z_k ~ q, the ELBO
    (its K = 1 term averaged over the same samples) and the posterior means and KL of every sentence."""
    mu, logvar = model.apply({"params": params}, batch["targets"], batch["weights"], method=model.encode)
    eps = jax.random.normal(rng, (num_samples,) + mu.shape)
    z = mu + jnp.exp(0.5 * logvar) * eps  # [K, B, Z]

    def log_likelihood(z_k):
        logits, _ = model.apply(
            {"params": params},
            z_k,
            batch["inputs"],
            model.apply({"params": params}, z_k, method=model.start_state),
            method=model.decode,
        )
        return -sentence_nll(logits, batch)

    log_px_z = jax.lax.map(log_likelihood, z)  # [K, B]
    zeros = jnp.zeros_like(mu)
    log_weights = log_px_z + vae_lm.gaussian_log_density(z, zeros, zeros) - vae_lm.gaussian_log_density(z, mu, logvar)
    iw = jax.nn.logsumexp(log_weights, axis=0) - jnp.log(num_samples)
    kl = jnp.sum(vae_lm.gaussian_kl(mu, logvar), axis=-1)
    return iw, jnp.mean(log_px_z, axis=0) - kl, mu, kl


def vae_task(model: vae_lm.VAELM, fields: "ElboConfig") -> Task:
    def init(rng, batch):
        params = model.init(
            {"params": rng, "dropout": rng}, batch["targets"], batch["inputs"], batch["weights"], rng=rng
        )
        return params["params"], {}

    def loss(params, frozen, carry, batch, rng, *, step, train):
        z_rng, dropout_rng = jax.random.split(rng)
        logits, mu, logvar = model.apply(
            {"params": params},
            batch["targets"],
            batch["inputs"],
            batch["weights"],
            rng=z_rng,
            deterministic=not train,
            rngs={"dropout": dropout_rng},
        )
        reconstruction = jnp.sum(sentence_nll(logits, batch))
        kl = vae_lm.gaussian_kl(mu, logvar) * (jnp.sum(batch["weights"], axis=1) > 0)[:, None]  # padding rows: 0
        beta = kl_weight(step, fields.kl_anneal_steps) if train else jnp.ones((), jnp.float32)
        penalty = kl_term(kl, fields.free_bits) if train else jnp.sum(kl)
        tokens = jnp.sum(batch["weights"])
        sentences = jnp.sum(batch["weights"][:, 0])
        value = (reconstruction + beta * penalty) / jnp.maximum(tokens, 1.0)
        _, accuracy = losses.weighted_loss(logits, batch["targets"], batch["weights"])
        metrics = {
            "loss": (reconstruction + jnp.sum(kl), tokens),
            "reconstruction": (reconstruction, tokens),
            "kl": (jnp.sum(kl), sentences),
            "kl_weight": (beta, jnp.ones((), jnp.float32)),
            "accuracy": accuracy["accuracy"],
        }
        return value, (metrics, carry)

    return Task(init=init, loss=loss)


def with_inputs(batch: dict[str, np.ndarray], bos_id: int) -> dict[str, np.ndarray]:
    """Adds inputs [B, T]: the targets shifted right behind `bos_id`."""
    inputs = np.concatenate([np.full_like(batch["targets"][:, :1], bos_id), batch["targets"][:, :-1]], axis=1)
    return {**batch, "inputs": inputs}


def with_dropped_words(
    batch: dict[str, np.ndarray], rng: np.random.Generator, *, bos_id: int, word_dropout: float, unk_id: int | None
) -> dict[str, np.ndarray]:
    """`with_inputs` for training, each real decoder input word but the first (`bos_id`) replaced by `unk_id`
    with probability `word_dropout` (Bowman et al. 2016), so the decoder leans on z; the targets stay."""
    batch = with_inputs(batch, bos_id)
    if word_dropout <= 0:
        return batch
    drop = (rng.random(batch["inputs"].shape) < word_dropout) & (batch["weights"] > 0)
    drop[:, 0] = False
    return {**batch, "inputs": np.where(drop, unk_id, batch["inputs"]).astype(batch["inputs"].dtype)}


@dataclasses.dataclass(frozen=True)
class ElboConfig:
    kl_anneal_steps: int = 0  # KL weight rises linearly from 0 to 1 over these steps (0: weight 1 from the start)
    free_bits: float = 0.0  # nats per latent dimension not penalised (0: off)
    num_iw_samples: int = 50  # K of the importance-weighted bound (the "latent" evaluator)
    word_dropout: float = 0.0  # fraction of the decoder's input words replaced by <unk> in training (0: off)
    length_multiple: int = 16  # batches are padded to their longest sentence rounded up to this (0: to data.seq_len)
    length_pool: int = 64  # training batches are drawn from pools of this many batches sorted by length (1: no sorting)

    def __post_init__(self):
        if self.kl_anneal_steps < 0 or self.free_bits < 0 or self.num_iw_samples < 1:
            raise ValueError("config.objective needs kl_anneal_steps >= 0, free_bits >= 0 and num_iw_samples >= 1")
        if not 0.0 <= self.word_dropout < 1.0:
            raise ValueError(f"config.objective.word_dropout={self.word_dropout} must be in [0, 1)")
        if self.length_multiple < 0 or self.length_pool < 1:
            raise ValueError("config.objective needs length_multiple >= 0 and length_pool >= 1")


class VAELanguageModel(base.Objective):
    """Sentence VAE on word-level text files (model_name "vae_lm")."""

    name = "vae_lm"
    Config = ElboConfig
    evaluators = ("loss", "latent")
    reader = readers.TEXT_FILES

    def task(self, model):
        return vae_task(model, self.fields)

    def step_summary(self):
        return base.sentence_step_summary(self.config, self.fields.length_multiple)

    def input_shapes(self, batch_size):
        shape = (batch_size, self.config.data.seq_len)
        return {
            "targets": base.int_inputs(shape),
            "inputs": base.int_inputs(shape),
            "weights": base.float_inputs(shape),
        }

    def _rows(self, tokenizer, raw, where):
        return sentence_rows(
            readers.text_file_tokens(raw, tokenizer, self.config.model.vocab_size, where),
            tokenizer.eos_id,
            self.config.data.seq_len,
        )

    def train_loader(self, tokenizer, raw, shard):
        ids, weights = self._rows(tokenizer, raw, "train split")
        fields = self.fields
        sentences = SentenceLoader(
            ids,
            weights,
            self.config.train.batch_size,
            **dataclasses.asdict(shard),
            length_multiple=fields.length_multiple,
        )
        if fields.word_dropout > 0 and tokenizer.unk_id is None:
            raise ValueError(
                "config.objective.word_dropout replaces words by <unk>, which this tokenizer does not "
                "have; use a word tokenizer with <unk> or set --config.objective.word_dropout=0"
            )
        transform = functools.partial(
            with_dropped_words, bos_id=tokenizer.eos_id, word_dropout=fields.word_dropout, unk_id=tokenizer.unk_id
        )
        return ShuffledSentences(sentences, self.config.train.seed, fields.length_pool, transform)

    def eval_batches(self, tokenizer, raw, shard):
        ids, weights = self._rows(tokenizer, raw, "evaluation split")
        loader = SentenceLoader(
            ids,
            weights,
            self.config.eval.batch_size,
            **dataclasses.asdict(shard),
            length_multiple=self.fields.length_multiple,
        )
        return (with_inputs(batch, tokenizer.eos_id) for batch in length_sorted_batches(loader))

    def real_tokens(self, batch):
        return int(np.sum(batch["weights"]))
