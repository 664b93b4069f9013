"""An independent PyTorch implementation of nanoGPT's CPU "baby GPT" recipe on Tiny Shakespeare (chars).

Recipe (nanoGPT config/train_shakespeare_char.py with its README's CPU overrides): 4 layers, 4 heads,
n_embd 128, block 64, no biases, no dropout, pre-LN, exact GELU, tied lm_head, learned positions;
weights N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 * n_layer)); batch 12 random windows;
AdamW(0.9, 0.99), eps 1e-8, weight decay 0.1 on every parameter with dim >= 2; clip 1.0; lr
1e-3 * (it + 1) / 101 for it < 100, then cosine to 1e-4 at it = 2000; iterations 0..2000 inclusive.

Two modes:

  --mode independent --seed N
      Torch init and torch RNG batches; trains the recipe and reports, after 2000 steps (the point
      nanoGPT's last "val loss" line measures) and after the 2001st step nanoGPT also takes:
        * whole-split validation loss: mean cross-entropy over every validation target once
          (non-overlapping windows of 64, the final partial window included), as lmzoo's
          `pipeline.eval_batches` defines it. lmzoo's stream ends with <eos>, so lmzoo counts one
          extra target (the <eos> after the last character, 1 of 111540); a 65-character model
          cannot predict it, so it is left out here (worth < 1e-4 in the mean).
        * nanoGPT's estimate: mean loss of 20 batches of 12 random validation windows
          (eval_iters=20), for the first draw and the spread over --estimate-draws draws.
      `--schedule lmzoo --iters 2000` trains with lmzoo's schedule and step count instead.

  --mode lockstep [--steps K] [--torch-schedule nanogpt|lmzoo]
      Builds configs/shakespeare_char.py through lmzoo.train.loop (build + restore_or_init, as
      train.py does), copies lmzoo's initial weights (its 66-row vocabulary included) into the
      torch model, and feeds both lmzoo's loader batches for K steps: lmzoo through its jitted
      production train step, torch through torch AdamW with the nanoGPT schedule (or lmzoo's,
      to isolate everything but the schedule). Prints per-step losses, their relative difference,
      grad norms and the lr each side used; at the end the parameter differences and both models'
      whole-split validation loss on lmzoo's own evaluation batches.

Run (one run at a time; add --threads 1 when other processes load the 2 cores):
    python bench/shakespeare_torch_reference.py --mode lockstep
    python bench/shakespeare_torch_reference.py --mode independent --seed 0
"""

import argparse
import math
import pathlib
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
# /work/shared next to the main checkout; a worktree one level deeper (/work/wt/NAME) finds it one further up.
DATA = (
    next((p for p in (ROOT.parent / "shared", ROOT.parents[1] / "shared") if p.exists()), ROOT.parent / "shared")
    / "data"
    / "tinyshakespeare"
    / "input.txt"
)
CONFIG = ROOT / "configs" / "shakespeare_char.py"

N_LAYER, N_HEAD, N_EMBD, BLOCK = 4, 4, 128, 64
BATCH = 12
MAX_LR, MIN_LR, WARMUP, DECAY_ITERS = 1e-3, 1e-4, 100, 2000
BETAS, EPS, WEIGHT_DECAY, GRAD_CLIP = (0.9, 0.99), 1e-8, 0.1, 1.0
EVAL_ITERS = 20


def nanogpt_lr(it: int) -> float:
    """nanoGPT's get_lr: linear warmup over 100 iterations (never 0), cosine to MIN_LR at DECAY_ITERS."""
    if it < WARMUP:
        return MAX_LR * (it + 1) / (WARMUP + 1)
    if it > DECAY_ITERS:
        return MIN_LR
    ratio = (it - WARMUP) / (DECAY_ITERS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (MAX_LR - MIN_LR)


def lmzoo_lr(it: int) -> float:
    """optax.warmup_cosine_decay_schedule(0, MAX_LR, WARMUP, DECAY_ITERS, MIN_LR) (lmzoo.trainers.optim), written out."""
    if it < WARMUP:
        return MAX_LR * it / WARMUP
    ratio = min(it - WARMUP, DECAY_ITERS - WARMUP) / (DECAY_ITERS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (MAX_LR - MIN_LR)


SCHEDULES = {"nanogpt": nanogpt_lr, "lmzoo": lmzoo_lr}


# ---------------------------------------------------------------------------------------------- model


class BiaslessLayerNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(N_EMBD, 3 * N_EMBD, bias=False)
        self.proj = nn.Linear(N_EMBD, N_EMBD, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (h.view(b, t, N_HEAD, d // N_HEAD).transpose(1, 2) for h in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(N_EMBD, 4 * N_EMBD, bias=False)
        self.proj = nn.Linear(4 * N_EMBD, N_EMBD, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn = BiaslessLayerNorm(N_EMBD), CausalSelfAttention()
        self.ln2, self.mlp = BiaslessLayerNorm(N_EMBD), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class BabyGPT(nn.Module):
    """Pre-LN GPT without biases; the output head is the token embedding (tied)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, N_EMBD)
        self.pos = nn.Embedding(BLOCK, N_EMBD)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = BiaslessLayerNorm(N_EMBD)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, 0.0, 0.02)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, 0.0, 0.02 / math.sqrt(2 * N_LAYER))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx [B, T] -> logits [B, T, V]."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok.weight)


def mean_loss(model: BabyGPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_optimizer(model: BabyGPT) -> torch.optim.AdamW:
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=MAX_LR, betas=BETAS, eps=EPS)


def train_step(
    model: BabyGPT, optimizer: torch.optim.AdamW, x: torch.Tensor, y: torch.Tensor, lr: float
) -> tuple[float, float]:
    """One optimizer step at `lr`; returns (loss before the step, global grad norm before clipping)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = mean_loss(model, x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    return loss.item(), norm.item()


# ----------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def whole_split_loss(model: BabyGPT, tokens: np.ndarray, batch_windows: int = 64) -> tuple[float, int]:
    """(mean CE, number of targets) over every target tokens[1:] once: windows of BLOCK inputs starting
    at 0, BLOCK, 2 BLOCK, ...; the last, shorter window is run on its own (causal, so equal to padding)."""
    data = torch.from_numpy(tokens.astype(np.int64))
    num_targets = len(data) - 1
    full = num_targets // BLOCK
    x_all = data[: full * BLOCK].view(full, BLOCK)
    y_all = data[1 : full * BLOCK + 1].view(full, BLOCK)
    total = 0.0
    for first in range(0, full, batch_windows):
        logits = model(x_all[first : first + batch_windows])
        total += float(
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y_all[first : first + batch_windows].reshape(-1), reduction="sum"
            )
        )
    if num_targets > full * BLOCK:
        x, y = data[full * BLOCK : num_targets][None], data[full * BLOCK + 1 :][None]
        logits = model(x)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
    return total / num_targets, num_targets


def random_windows(data: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's get_batch: BATCH windows with start ~ randint(len(data) - BLOCK)."""
    starts = torch.randint(len(data) - BLOCK, (BATCH,), generator=generator)
    x = torch.stack([data[i : i + BLOCK] for i in starts])
    y = torch.stack([data[i + 1 : i + 1 + BLOCK] for i in starts])
    return x, y


@torch.no_grad()
def nanogpt_estimate(model: BabyGPT, data: torch.Tensor, generator: torch.Generator) -> float:
    """nanoGPT's estimate_loss for one split: the mean of EVAL_ITERS random-batch losses."""
    return float(np.mean([float(mean_loss(model, *random_windows(data, generator))) for _ in range(EVAL_ITERS)]))


# ---------------------------------------------------------------------------------------- independent


def char_splits() -> tuple[np.ndarray, np.ndarray, int]:
    """nanoGPT's prepare.py: ids of the sorted character set; the first 90% train, the rest validation."""
    text = DATA.read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], dtype=np.int64)
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:], len(chars)


def report(model: BabyGPT, val: np.ndarray, val_t: torch.Tensor, seed: int, draws: int, label: str) -> None:
    model.eval()
    start = time.perf_counter()
    whole, count = whole_split_loss(model, val)
    whole_s = time.perf_counter() - start
    generator = torch.Generator().manual_seed(10_000 + seed)
    estimates = [nanogpt_estimate(model, val_t, generator) for _ in range(draws)]
    model.train()
    print(
        f"{label}: whole-split val loss {whole:.4f} ({count} targets, {whole_s:.1f}s); "
        f"nanoGPT 20-batch estimate {estimates[0]:.4f} (first draw), over {draws} draws mean {np.mean(estimates):.4f} "
        f"min {np.min(estimates):.4f} max {np.max(estimates):.4f}",
        flush=True,
    )


def run_independent(args) -> None:
    train, val, vocab_size = char_splits()
    print(
        f"train {len(train)} chars, val {len(val)} chars, vocab {vocab_size}; seed {args.seed}, "
        f"schedule {args.schedule}, iterations 0..{args.iters}",
        flush=True,
    )
    torch.manual_seed(args.seed)
    model = BabyGPT(vocab_size)
    optimizer = make_optimizer(model)
    train_t, val_t = torch.from_numpy(train), torch.from_numpy(val)
    batches = torch.Generator().manual_seed(args.seed)
    schedule = SCHEDULES[args.schedule]
    steps = args.iters + 1 if args.schedule == "nanogpt" else args.iters  # nanoGPT runs iterations 0..max_iters
    train_s, running = 0.0, []
    for it in range(steps):
        if it == DECAY_ITERS:
            report(model, val, val_t, args.seed, args.estimate_draws, f"after {it} steps (nanoGPT's last eval point)")
        start = time.perf_counter()
        loss, _ = train_step(model, optimizer, *random_windows(train_t, batches), schedule(it))
        train_s += time.perf_counter() - start
        running.append(loss)
        if (it + 1) % 250 == 0:
            print(
                f"iter {it}: mean train loss of the last {len(running)} batches {np.mean(running):.4f}, "
                f"lr {schedule(it):.3e}, train wall clock {train_s:.1f}s",
                flush=True,
            )
            running = []
    report(model, val, val_t, args.seed, args.estimate_draws, f"after {steps} steps")
    print(f"training wall clock {train_s:.1f}s for {steps} steps ({1000 * train_s / steps:.1f} ms/step)")


# ------------------------------------------------------------------------------------------- lockstep


def torch_from_lmzoo(params) -> BabyGPT:
    """A BabyGPT holding lmzoo "gpt2" params (kernels are [in, out]; torch Linear weights [out, in])."""
    model = BabyGPT(params["wte"]["embedding"].shape[0])
    d = N_EMBD
    with torch.no_grad():
        model.tok.weight.copy_(torch.tensor(np.asarray(params["wte"]["embedding"])))
        model.pos.weight.copy_(torch.tensor(np.asarray(params["wpe"]["embedding"])))
        model.ln_f.weight.copy_(torch.tensor(np.asarray(params["ln_final"]["scale"])))
        for i, block in enumerate(model.blocks):
            layer = params["blocks"][f"layer_{i}"]
            attn = layer["attn"]
            qkv = np.concatenate(
                [np.asarray(attn[name]["kernel"]).reshape(d, d) for name in ("query", "key", "value")], axis=1
            )
            block.attn.qkv.weight.copy_(torch.tensor(qkv.T))
            block.attn.proj.weight.copy_(torch.tensor(np.asarray(attn["out"]["kernel"]).reshape(d, d).T))
            block.mlp.fc.weight.copy_(torch.tensor(np.asarray(layer["mlp"]["wi"]["kernel"]).T))
            block.mlp.proj.weight.copy_(torch.tensor(np.asarray(layer["mlp"]["wo"]["kernel"]).T))
            block.ln1.weight.copy_(torch.tensor(np.asarray(layer["ln_attn"]["scale"])))
            block.ln2.weight.copy_(torch.tensor(np.asarray(layer["ln_mlp"]["scale"])))
    return model


def param_differences(params, model: BabyGPT) -> dict[str, float]:
    """||lmzoo - torch|| / ||lmzoo|| per tensor, after mapping lmzoo's params into torch's layout."""
    mapped = torch_from_lmzoo(params).state_dict()
    return {
        name: float(torch.linalg.norm(mapped[name] - value) / torch.linalg.norm(mapped[name]))
        for name, value in model.state_dict().items()
    }


@torch.no_grad()
def torch_loss_on_lmzoo_batches(model: BabyGPT, batches) -> float:
    """Weighted mean CE over lmzoo eval batches (the same targets and weights lmzoo's evaluate sums)."""
    total, count = 0.0, 0.0
    for batch in batches:
        logits = model(torch.from_numpy(batch["inputs"].astype(np.int64)))
        per_target = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            torch.from_numpy(batch["targets"].astype(np.int64)).reshape(-1),
            reduction="none",
        )
        weights = torch.from_numpy(batch["weights"]).reshape(-1)
        total += float((per_target * weights).sum())
        count += float(weights.sum())
    return total / count


def run_lockstep(args) -> None:
    import importlib.util

    import jax

    from lmzoo import sharding
    from lmzoo.evaluation.loss import evaluate_loss
    from lmzoo.train import run as run_lib
    from lmzoo.trainers import optim

    spec = importlib.util.spec_from_file_location("shakespeare_char_config", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = run_lib.validate(module.get_config())
    schedule = SCHEDULES[args.torch_schedule]
    lmzoo_schedule = optim.learning_rate_schedule(config.optim)
    with tempfile.TemporaryDirectory() as workdir:
        run = run_lib.build(config, workdir)
        state, _ = run_lib.restore_or_init(run)
        loader = run.train_loader()
        model = torch_from_lmzoo(jax.device_get(state.params))
        optimizer = make_optimizer(model)
        print(
            f"lockstep {args.steps} steps; lmzoo: configs/shakespeare_char.py via run_lib.build/restore_or_init "
            f"(seed {config.train.seed}); torch lr: {args.torch_schedule} schedule",
            flush=True,
        )
        print("step  lmzoo_loss  torch_loss  rel_diff    lmzoo_lr    torch_lr    lmzoo_gnorm torch_gnorm")
        worst, worst_first10, seconds = 0.0, 0.0, {"lmzoo": 0.0, "torch": 0.0}
        for step in range(args.steps):
            batch = loader.batch(step)
            assert np.all(batch["weights"] == 1) and np.all(batch["positions"] == np.arange(BLOCK)), (
                "batch is not one document"
            )
            start = time.perf_counter()
            with run.context():
                state, metrics = run.compiled.step(state, sharding.put_batch(batch, run.compiled.batch_sharding))
            metrics = jax.device_get(metrics)
            seconds["lmzoo"] += time.perf_counter() - start
            lmzoo_loss = float(metrics["loss"][0] / metrics["loss"][1])
            lmzoo_step_lr = float(metrics["learning_rate"][0])
            lr = schedule(step)
            x, y = (torch.from_numpy(batch[k].astype(np.int64)) for k in ("inputs", "targets"))
            start = time.perf_counter()
            torch_loss, torch_norm = train_step(model, optimizer, x, y, lr)
            seconds["torch"] += time.perf_counter() - start
            rel = abs(lmzoo_loss - torch_loss) / abs(lmzoo_loss)
            worst = max(worst, rel)
            worst_first10 = max(worst_first10, rel) if step < 10 else worst_first10
            if step < 20 or step % args.print_every == 0 or step == args.steps - 1:
                print(
                    f"{step:4d}  {lmzoo_loss:.6f}  {torch_loss:.6f}  {rel:.3e}  {lmzoo_step_lr:.4e}  {lr:.4e}  "
                    f"{float(metrics['grad_norm'][0]):.5f}     {torch_norm:.5f}",
                    flush=True,
                )
        print(
            f"train-step wall clock (lmzoo's first step includes compilation): lmzoo {seconds['lmzoo']:.1f}s, "
            f"torch {seconds['torch']:.1f}s"
        )
        lmzoo_lrs = np.asarray(lmzoo_schedule(np.arange(DECAY_ITERS + 1)), np.float64)
        schedule_gap = float(np.max(np.abs(lmzoo_lrs - np.array([schedule(s) for s in range(DECAY_ITERS + 1)]))))
        print(f"max relative loss difference: first 10 steps {worst_first10:.3e}, all {args.steps} steps {worst:.3e}")
        print(
            f"max |lmzoo lr - torch lr| over steps 0..{DECAY_ITERS}: {schedule_gap:.3e}; "
            f"lmzoo lr at steps 0, 1, 99, 100, 1999: {[float(lmzoo_lrs[s]) for s in (0, 1, 99, 100, 1999)]}; "
            f"nanoGPT: {[nanogpt_lr(s) for s in (0, 1, 99, 100, 1999, 2000)]} (steps 0, 1, 99, 100, 1999, 2000)"
        )
        diffs = param_differences(jax.device_get(state.params), model)
        name = max(diffs, key=diffs.get)
        print(
            f"after {args.steps} steps: max per-tensor ||lmzoo - torch|| / ||lmzoo|| = {diffs[name]:.3e} ({name}); "
            f"median {np.median(list(diffs.values())):.3e}"
        )
        lmzoo_val = evaluate_loss(run, state)["loss"]
        model.eval()
        torch_val = torch_loss_on_lmzoo_batches(model, run.eval_batches("validation"))
        print(f"whole-split validation loss on lmzoo's eval batches: lmzoo {lmzoo_val:.5f}, torch {torch_val:.5f}")
        run.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("independent", "lockstep"), required=True)
    parser.add_argument("--seed", type=int, default=0, help="independent: torch seed for init and batches")
    parser.add_argument(
        "--iters", type=int, default=DECAY_ITERS, help="independent: last iteration (nanoGPT: max_iters)"
    )
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="nanogpt", help="independent: lr schedule")
    parser.add_argument(
        "--estimate-draws", type=int, default=10, help="independent: draws of nanoGPT's 20-batch estimate"
    )
    parser.add_argument("--steps", type=int, default=200, help="lockstep: steps to run side by side")
    parser.add_argument(
        "--torch-schedule", choices=tuple(SCHEDULES), default="nanogpt", help="lockstep: torch's lr schedule"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch intra-op threads (1 is much faster when other work shares the cores)",
    )
    parser.add_argument("--print-every", type=int, default=10, help="lockstep: print every Nth step after the first 20")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if args.mode == "independent":
        run_independent(args)
    else:
        run_lockstep(args)
    print(f"total wall clock {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
