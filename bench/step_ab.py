"""A/B of one speed change in lmzoo's train step, both sides in one process, interleaved.

    python bench/step_ab.py --change gelu [--config=configs/shakespeare_char.py] [--rounds 5] [--steps 20]

"new" is the code as it is; "old" is the same production train step (`compile_trainer`, as `train.py`
runs it) traced with the change undone: the form it replaced is kept in OLD_FORMS below and swapped
in only while the old step is traced and compiled. Each round times `--steps` steps of each side,
alternating which goes first; the report gives per-round ms/step (wall, and CPU time of the
process's threads), the median of the rounds and of each round's old/new (> 1: the change is faster). The load
average is printed because the cores are shared.
"""

import argparse
import contextlib
import functools
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from lmzoo import config as config_lib  # noqa: E402
from lmzoo import layers, models  # noqa: E402
from lmzoo.kernels import host_memory  # noqa: E402
from lmzoo.objectives import causal_lm, losses  # noqa: E402


def autodiff_normalize(x, scale, epsilon, use_mean):
    """`layers.normalize` as it was before its backward was written out (automatic differentiation)."""
    x32 = x.astype(jnp.float32)
    if use_mean:
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _saved_logits_grad_loss(hidden, embedding, targets, weights, chunk_len):
    return _saved_logits_grad_loss_fwd(hidden, embedding, targets, weights, chunk_len)[0]


def _saved_logits_grad_loss_fwd(hidden, embedding, targets, weights, chunk_len):
    def chunk(_, xs):
        h, t, w = xs
        logits = causal_lm._chunk_logits(h, embedding)
        loss_sum, _ = losses.cross_entropy(logits, t, w)
        correct = jnp.sum(losses.top1_correct(logits, t) * w)
        return None, (loss_sum, correct, causal_lm._logits_grad(logits, jax.nn.logsumexp(logits, axis=-1), t, w))

    xs = tuple(causal_lm._chunks(x, chunk_len) for x in (hidden, targets, weights))
    _, (loss_sums, correct_sums, logits_grads) = jax.lax.scan(chunk, None, xs)
    return (jnp.sum(loss_sums), jnp.sum(correct_sums)), (hidden, embedding, logits_grads)


def _saved_logits_grad_loss_bwd(chunk_len, residuals, cotangents):
    hidden, embedding, logits_grads = residuals
    loss_cotangent = cotangents[0]  # the accuracy count has no gradient

    def chunk(embedding_grad, xs):
        h, logits_grad = xs
        flat_grad, flat_hidden = logits_grad.reshape(-1, logits_grad.shape[-1]), h.reshape(-1, h.shape[-1])
        return embedding_grad + flat_grad.T @ flat_hidden, jnp.einsum("BCV,VD->BCD", logits_grad, embedding)

    embedding_grad, hidden_grads = jax.lax.scan(
        chunk, jnp.zeros(embedding.shape, jnp.float32), (causal_lm._chunks(hidden, chunk_len), logits_grads)
    )
    return causal_lm._unchunk(hidden_grads) * loss_cotangent, embedding_grad * loss_cotangent, None, None


_saved_logits_grad_loss.defvjp(_saved_logits_grad_loss_fwd, _saved_logits_grad_loss_bwd)


def saved_logits_grad_head_loss(hidden, embedding, batch, chunk_len=None):
    """`causal_lm.fused_head_loss` (f32) as it was before the gradients moved into its forward pass: the forward
    kept the logits' gradient [B, T, V] and the backward pass did the two gradient matmuls."""
    b, t, _ = hidden.shape
    weights = batch["weights"].astype(jnp.float32)
    chunk_len = chunk_len or causal_lm.head_loss_chunk_len(b, t, embedding.shape[0])
    total, correct = _saved_logits_grad_loss(hidden, embedding, batch["targets"], weights, chunk_len)
    count = jnp.sum(weights)
    return total / jnp.maximum(count, 1.0), {"loss": (total, count), "accuracy": (correct, count)}


OLD_FORMS = {  # change -> [(module, attribute, key or None, the form before the change)]
    "gelu": [(layers, "ACTIVATIONS", "gelu", functools.partial(jax.nn.gelu, approximate=False))],
    "layernorm": [(layers, "normalize", None, autodiff_normalize)],
    "causal_split": [(layers, "CAUSAL_SPLIT_MIN_LEN", None, 1 << 30)],
    "head_grads_in_forward": [(causal_lm, "fused_head_loss", None, saved_logits_grad_head_loss)],
}
OLD_FORMS["gelu+layernorm"] = OLD_FORMS["gelu"] + OLD_FORMS["layernorm"]


@contextlib.contextmanager
def swapped(forms):
    """Temporarily replaces module attributes (or dict entries when key is not None) with `forms`."""
    saved = []
    for owner, attribute, key, value in forms:
        target = getattr(owner, attribute)
        saved.append((owner, attribute, key, target[key] if key is not None else target))
        if key is None:
            setattr(owner, attribute, value)
        else:
            target[key] = value
    try:
        yield
    finally:
        for owner, attribute, key, value in reversed(saved):
            if key is None:
                setattr(owner, attribute, value)
            else:
                getattr(owner, attribute)[key] = value


def build(config, batch, forms) -> common.LmzooTrainer:
    """The production train step traced and compiled (by its first step) with `forms` swapped in."""
    with swapped(forms):
        model = models.build_model(config.model_name, config.model.to_dict())
        trainer = common.LmzooTrainer(causal_lm.causal_lm_task(model), batch, config.optim)
        trainer.run(1)
    return trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--change", choices=sorted(OLD_FORMS), required=True)
    parser.add_argument(
        "--config", default=str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.py")
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    host_memory.run_on_calling_thread()  # as train.py runs its steps
    config = config_lib.load_config_file(args.config)
    load = common.announce(
        f"step_ab[{args.change}]", args.config, f"B={config.train.batch_size} T={config.data.seq_len}", args.rounds
    )
    peak = common.matmul_peak()
    print("matmul peak (f32, best of 5): " + ", ".join(f"{n}: {g:.1f} GFLOP/s" for n, g in peak.items()), flush=True)
    b, t = config.train.batch_size, config.data.seq_len
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (b, t + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((b, t), np.float32)}
    trainers = {"old": build(config, batch, OLD_FORMS[args.change]), "new": build(config, batch, [])}
    print(f"loss after 1 step: old {trainers['old'].loss:.6f}, new {trainers['new'].loss:.6f}")
    ms = {name: [] for name in trainers}
    cpu_ms = {
        name: [] for name in trainers
    }  # CPU time of all threads: less sensitive to other processes than wall time
    for r in range(args.rounds):
        for name in list(trainers) if r % 2 == 0 else list(trainers)[::-1]:
            cpu_start = time.process_time()
            ms[name].append(1e3 * common.timed(lambda t=trainers[name]: t.run(args.steps)) / args.steps)
            cpu_ms[name].append(1e3 * (time.process_time() - cpu_start) / args.steps)
        print(f"  round {r + 1}: old {ms['old'][-1]:.2f} ms/step (CPU {cpu_ms['old'][-1]:.2f}), "
              f"new {ms['new'][-1]:.2f} ms/step (CPU {cpu_ms['new'][-1]:.2f}), load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    median = {name: common.median(values) for name, values in ms.items()}
    cpu_median = {name: common.median(values) for name, values in cpu_ms.items()}
    # Paired: the machine's speed drifts between rounds, so each round's old/new is taken before the median.
    ratio = common.median(o / n for o, n in zip(ms["old"], ms["new"], strict=True))
    cpu_ratio = common.median(o / n for o, n in zip(cpu_ms["old"], cpu_ms["new"], strict=True))
    print(f"median ms/step: old {median['old']:.2f}, new {median['new']:.2f}; rounds' old/new median {ratio:.3f}")
    print(f"median CPU ms/step: old {cpu_median['old']:.2f}, new {cpu_median['new']:.2f}; "
          f"rounds' old/new median {cpu_ratio:.3f}")  # fmt: skip
    print(f"loss after all steps: old {trainers['old'].loss:.6f}, new {trainers['new'].loss:.6f}")
    load["end"] = os.getloadavg()[0]
    record = {
        "bench": "step_ab", "change": args.change, "config": args.config, "matmul_peak_gflops": peak, "ms_per_step": ms,
        "median_ms": median, "old_over_new": ratio, "cpu_ms_per_step": cpu_ms, "cpu_old_over_new": cpu_ratio, "load_average": load,
    }  # fmt: skip
    print(json.dumps(record))


if __name__ == "__main__":
    main()
