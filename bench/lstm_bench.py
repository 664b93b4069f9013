"""LSTM LM benchmark: lmzoo's production train step vs a PyTorch nn.LSTM model of the same shape, in one run.

    python bench/lstm_bench.py [--rounds 3] [--steps 20] [--emb_dim 200] [--quick]

Both train Zaremba's "small" shape by default (vocab 10,000, 2 layers x 200, batch 20, unroll 20): embedding,
LSTM, softmax layer with bias, loss summed over time and averaged over rows, SGD lr 1 with clipping at 5,
the state carried from one window to the next. lmzoo runs the `recurrent_lm` task through `SupervisedTrainer`
and `compile_trainer` (what `lmzoo.train.loop` jits); torch runs eager with 2 threads; each in a process of its
own (`common.Isolated`). Rounds alternate the
order of the two; the f32 matmul peak is measured in the same run. Prints one JSON record last.
"""

import argparse
import json
import os
import pathlib
import sys

import numpy as np
import optax
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from lmzoo.data import loaders  # noqa: E402
from lmzoo.models import lstm  # noqa: E402
from lmzoo.objectives import recurrent_lm  # noqa: E402


class LmzooLSTM(common.LmzooTrainer):
    """The train step `lmzoo.train.loop` runs for configs/ptb_lstm.py, carry threaded through the state."""

    def __init__(self, config: lstm.LSTMConfig, batch: dict[str, np.ndarray]):
        schedule = recurrent_lm.epoch_decay_schedule(1.0, 0, 4, 0.5)
        tx = optax.chain(optax.clip_by_global_norm(5.0), optax.sgd(schedule))
        self.compile(recurrent_lm.recurrent_lm_task(lstm.LSTM(config), sum_over_time=True), tx, schedule, batch)


class TorchLSTM(torch.nn.Module):
    """The same network in PyTorch: nn.Embedding, nn.LSTM(num_layers), nn.Linear, uniform init in [-0.1, 0.1]."""

    def __init__(self, config: lstm.LSTMConfig):
        super().__init__()
        self.embedding = torch.nn.Embedding(config.vocab_size, config.emb_dim)
        self.lstm = torch.nn.LSTM(config.emb_dim, config.emb_dim, config.num_layers, batch_first=True)
        self.out = torch.nn.Linear(config.emb_dim, config.vocab_size)
        for p in self.parameters():
            torch.nn.init.uniform_(p, -config.init_scale, config.init_scale)

    def forward(self, tokens, state):
        hidden, state = self.lstm(self.embedding(tokens), state)
        return self.out(hidden), state


class TorchTrainer:
    def __init__(self, config: lstm.LSTMConfig, batch: dict[str, np.ndarray]):
        torch.set_num_threads(common.TORCH_THREADS)
        self.model = TorchLSTM(config)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1.0)
        self.inputs, self.targets = (torch.as_tensor(batch[k], dtype=torch.long) for k in ("inputs", "targets"))
        zeros = torch.zeros(config.num_layers, self.inputs.shape[0], config.emb_dim)
        self.state = (zeros, zeros.clone())

    def run(self, steps: int) -> float:
        for _ in range(steps):
            self.state = tuple(s.detach() for s in self.state)  # truncated BPTT
            logits, self.state = self.model(self.inputs, self.state)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), self.targets.flatten(), reduction="sum")
            self.optimizer.zero_grad()
            (loss / self.inputs.shape[0]).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
            self.optimizer.step()
        return float(loss.detach()) / self.targets.numel()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="train steps timed per round and framework")
    parser.add_argument("--emb_dim", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=20)
    parser.add_argument("--seq_len", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="1 round of 3 steps (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 3
    config = lstm.LSTMConfig(vocab_size=10000, emb_dim=args.emb_dim, num_layers=2)
    spec = f"vocab {config.vocab_size}, {config.num_layers} x {config.emb_dim}, batch {args.batch_size}, unroll {args.seq_len}"
    load = common.announce("lstm", "train step", spec, args.rounds)
    rng = np.random.default_rng(0)
    stream = rng.integers(0, config.vocab_size, size=(args.batch_size, args.seq_len + 1)).astype(np.int32)
    batch = loaders.window(stream, np.ones((args.batch_size, args.seq_len), np.float32), 0, args.seq_len)
    batch["reset"][:] = 0.0  # a window inside an epoch: the carry flows on
    ours, theirs = common.Isolated(LmzooLSTM, config, batch), common.Isolated(TorchTrainer, config, batch)
    ours.run(2)
    theirs.run(2)
    tokens = args.steps * args.batch_size * args.seq_len
    record = {"spec": spec, "cpu": common.cpu_model_and_isa()[0], "load_start": load["start"], "rounds": []}
    for r in range(args.rounds):
        peak = common.matmul_peak(sizes=(1024,), repeats=3)[1024]
        order = [("lmzoo", ours), ("torch", theirs)]
        times = {}
        for name, trainer in order if r % 2 == 0 else order[::-1]:
            times[name] = common.timed(lambda trainer=trainer: trainer.run(args.steps))
        row = {
            "matmul_peak_gflops": round(peak, 1),
            **{f"{n}_tokens_per_sec": round(tokens / t) for n, t in times.items()},
        }
        row["torch_over_lmzoo"] = round(times["lmzoo"] / times["torch"], 3)
        print(
            f"round {r + 1}: f32 matmul peak {peak:.0f} GFLOP/s; lmzoo {row['lmzoo_tokens_per_sec']} tokens/s, "
            f"torch nn.LSTM {row['torch_tokens_per_sec']} tokens/s (torch/lmzoo speed {row['torch_over_lmzoo']:.2f})",
            flush=True,
        )
        record["rounds"].append(row)
    ours.close()
    theirs.close()
    record["load_end"] = os.getloadavg()[0]
    print(json.dumps(record))


if __name__ == "__main__":
    main()
