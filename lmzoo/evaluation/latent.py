"""Latent-variable LM evaluation (VAE-LM): importance-weighted perplexity, KL, active units, and printed samples
from the prior and an interpolation between two sentences' posterior means."""

import jax
import jax.numpy as jnp
import numpy as np

from lmzoo.models import vae_lm
from lmzoo.objectives import vae_lm as vae_lm_objective

ACTIVE_UNIT_THRESHOLD = 0.01  # Burda et al. 2016: Cov_x(E_q[z_u]) above this counts as active


def evaluate_latent(
    run,
    state,
    split: str = "validation",
    *,
    max_batches: int | None = None,
    seed: int = 0,
    num_prior_samples: int = 3,
    interpolation_steps: int = 5,
    max_len: int = 30,
):
    """Metrics over `split` (at most `max_batches` batches): iw_perplexity (K = config.objective.num_iw_samples),
    elbo_perplexity of the same samples, kl per sentence, active_units; prints the decoded samples."""
    num_samples = run.objective.fields.num_iw_samples
    params = jax.device_get(state.params)
    rng, prior_rng = jax.random.split(jax.random.key(seed))
    iw_sum = elbo_sum = kl_sum = tokens = 0.0
    means, first = [], None
    for index, batch in enumerate(run.eval_batches(split)):
        if max_batches is not None and index >= max_batches:
            break
        iw, bound, mu, kl = vae_lm_objective.importance_weighted_bound(
            run.model, params, batch, jax.random.fold_in(rng, index), num_samples=num_samples
        )
        real = np.asarray(batch["weights"][:, 0] > 0)
        iw_sum += float(np.sum(np.asarray(iw)[real]))
        elbo_sum += float(np.sum(np.asarray(bound)[real]))
        kl_sum += float(np.sum(np.asarray(kl)[real]))
        tokens += float(np.sum(batch["weights"]))
        means.append(np.asarray(mu)[real])
        first = np.asarray(mu)[real][:2] if first is None else first
    means = np.concatenate(means)
    active = int(np.sum(np.var(means, axis=0) > ACTIVE_UNIT_THRESHOLD))
    metrics = {
        "iw_perplexity": float(np.exp(-iw_sum / tokens)),
        "elbo_perplexity": float(np.exp(-elbo_sum / tokens)),
        "kl": kl_sum / len(means),
        "active_units": active,
        "iw_samples": num_samples,
    }
    examples = []
    prior = jax.random.normal(prior_rng, (num_prior_samples, means.shape[1]))
    for text in _decode(run, params, prior, max_len):
        print(f"prior sample: {text}")
        examples.append({"prior_sample": text})
    if len(first) == 2:
        weights = jnp.linspace(0.0, 1.0, interpolation_steps)[:, None]
        path = (1 - weights) * first[0] + weights * first[1]
        for t, text in zip(np.asarray(weights[:, 0]), _decode(run, params, path, max_len), strict=True):
            print(f"interpolation {t:.2f}: {text}")
            examples.append({"interpolation": text, "t": float(t)})
    return metrics, examples


def _decode(run, params, z, max_len: int) -> list[str]:
    """Greedy sentences from latents z [N, Z], each cut at its first <eos>."""
    eos = run.tokenizer.eos_id
    ids = np.asarray(
        vae_lm.generate_from_latent(
            run.model,
            params,
            jnp.asarray(z),
            jax.random.key(0),
            bos_id=eos,
            max_len=max_len,
            vocab_size=run.tokenizer.vocab_size,
        )
    )
    return [run.tokenizer.decode(row[: row.index(eos)] if eos in row else row) for row in ids.tolist()]
