"""The counting trainer: fits a count-based n-gram model (`lmzoo.models.ngram`) with no gradients.

A step adds the batch's (history, token) rows to a count table kept in the state (`params`: "ngrams"
[C, order] int32 sorted, "counts" [C] float32, unused slots zero), merged by one sort in JAX; the table is
the sufficient statistic of every smoothing, so it is what the checkpoint holds. `eval_step` fits
`ngram.fit_counts` from the table on the host, once per table, and scores every token of the batch with
`ngram.log_prob` through a callback.
"""

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lmzoo.models import ngram
from lmzoo.trainers.state import Metrics


def history_rows(targets, *, order: int, eos_id: int):
    """targets [B, S] sentences (each row starting a sentence) -> [B, S, order]: the order - 1 previous
    tokens of the row (eos before its start, as `ngram.contexts_from_stream`), then the token. numpy or jax."""
    xp = jnp if isinstance(targets, jax.Array) else np
    b, s = targets.shape
    padded = xp.concatenate([xp.full((b, order - 1), eos_id, targets.dtype), targets], axis=1)
    return xp.stack([padded[:, k : k + s] for k in range(order)], axis=-1)


def merge_into_table(ngrams: jax.Array, counts: jax.Array, rows: jax.Array, weights: jax.Array, vocab_size: int):
    """Adds weighted rows [P, n] to a sorted table (ngrams [C, n], counts [C]) -> (table, distinct rows needed).

    One sort of table and rows together (empty slots and zero-weight rows carry the id `vocab_size`, so they
    sort last), then equal neighbours are summed. Rows past C are dropped: callers check `distinct <= C`."""
    capacity, order = ngrams.shape
    all_rows = jnp.concatenate([ngrams, rows.astype(ngrams.dtype)])
    all_counts = jnp.concatenate([counts, weights.astype(counts.dtype)])
    all_rows = jnp.where((all_counts > 0)[:, None], all_rows, vocab_size)
    *columns, sorted_counts = jax.lax.sort((*all_rows.T, all_counts), num_keys=order)
    keys = jnp.stack(columns, axis=1)
    starts = jnp.concatenate([jnp.ones((1,), bool), jnp.any(keys[1:] != keys[:-1], axis=1)])
    group = jnp.cumsum(starts) - 1
    real = keys[:, 0] < vocab_size
    distinct = jnp.sum(starts & real)
    summed = jax.ops.segment_sum(jnp.where(real, sorted_counts, 0.0), group, num_segments=len(keys))
    table = jnp.full_like(keys, vocab_size).at[group].set(keys)
    table = jnp.where((summed > 0)[:, None], table, 0)
    return table[:capacity], summed[:capacity], distinct


class FittedModels:
    """Host cache of the model fitted from the latest count table seen (fitting takes seconds; scoring
    a batch, milliseconds)."""

    def __init__(self):
        self.fingerprint, self.state = None, None

    def get(self, ngrams: np.ndarray, counts: np.ndarray, **fit_options) -> dict:
        fingerprint = hashlib.blake2b(ngrams.tobytes() + counts.tobytes() + repr(fit_options).encode()).hexdigest()
        if fingerprint != self.fingerprint:
            used = counts > 0
            table = {"ngrams": ngrams[used].astype(np.int64), "counts": np.rint(counts[used]).astype(np.int64)}
            self.state = ngram.fit_counts(table, **fit_options)
            self.fingerprint = fingerprint
        return self.state


@struct.dataclass
class NgramState:
    step: jax.Array
    params: dict  # {"ngrams": [C, order] int32, "counts": [C] float32}: the count table
    frozen: dict


@dataclasses.dataclass(frozen=True)
class CountingTrainer:
    """Fits an n-gram model by counting: `step` merges a batch's rows into the table, `eval_step` scores."""

    model: ngram.NgramConfig
    eos_id: int
    max_ngrams: int
    fitted: FittedModels = dataclasses.field(default_factory=FittedModels, compare=False)

    def init(self, rng: jax.Array) -> NgramState:
        table = {
            "ngrams": jnp.zeros((self.max_ngrams, self.model.order), jnp.int32),
            "counts": jnp.zeros((self.max_ngrams,), jnp.float32),
        }
        return NgramState(step=jnp.zeros((), jnp.int32), params=table, frozen={})

    def step(self, state: NgramState, batch: dict[str, jax.Array]) -> tuple[NgramState, Metrics]:
        rows = history_rows(batch["targets"], order=self.model.order, eos_id=self.eos_id).reshape(-1, self.model.order)
        ngrams, counts, distinct = merge_into_table(
            state.params["ngrams"], state.params["counts"], rows, batch["weights"].reshape(-1), self.model.vocab_size
        )
        tokens = jnp.sum(batch["weights"])
        one = jnp.ones((), jnp.float32)
        metrics = {"loss": (jnp.zeros(()), tokens), "table_fill": (distinct.astype(jnp.float32) / self.max_ngrams, one)}
        return state.replace(step=state.step + 1, params={"ngrams": ngrams, "counts": counts}), metrics

    def initial_carry(self, batch_size: int) -> dict:
        return {}

    def _log_probs(self, ngrams, counts, targets) -> np.ndarray:
        cfg = self.model
        state = self.fitted.get(
            np.asarray(ngrams),
            np.asarray(counts),
            vocab_size=cfg.vocab_size,
            eos_id=self.eos_id,
            smoothing=cfg.smoothing,
            add_k=cfg.add_k,
        )
        rows = history_rows(np.asarray(targets), order=cfg.order, eos_id=self.eos_id).reshape(-1, cfg.order)
        return ngram.log_prob(state, rows[:, :-1], rows[:, -1]).reshape(targets.shape).astype(np.float32)

    def eval_step(self, state: NgramState, batch: dict[str, jax.Array], carry: dict) -> tuple[Metrics, dict]:
        """Loss metrics: -sum log p(token | history) over the real tokens of `batch`, and their count."""
        targets, weights = batch["targets"], batch["weights"]
        shape = jax.ShapeDtypeStruct(targets.shape, jnp.float32)
        log_probs = jax.pure_callback(self._log_probs, shape, state.params["ngrams"], state.params["counts"], targets)
        return {"loss": (-jnp.sum(log_probs * weights), jnp.sum(weights))}, carry

    def with_params(self, state: NgramState, params: dict) -> NgramState:
        return state.replace(params=params)
