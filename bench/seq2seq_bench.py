"""Encoder-decoder benchmark: T5 span corruption and BART noising against the train step's consumption,
lmzoo's production T5 train step vs HuggingFace T5ForConditionalGeneration + torch AdamW, MFU, and beam /
greedy decoding vs HF `generate`.

    python bench/seq2seq_bench.py [--rounds 3] [--quick]

Measures, in interleaved rounds because the machine's speed drifts: (1) train tokens/s (encoder + decoder
tokens per step) of one T5 v1.0 config in lmzoo (`compile_trainer` + `seq2seq_task`, the step `lmzoo.train.loop`
runs) and in torch eager on the same batch, each in a process of its own (`common.Isolated`), lmzoo's MFU against the matmul peak measured in the same round;
(2) encoder-input tokens/s of the real data path of configs/t5.py (span corruption) and configs/bart.py (sentence
permutation + text infilling) on The Time Machine (`make_loaders`: LMLoader + seq2seq_from_windows) against
the encoder tokens/s the lmzoo step of that objective consumes at the same batch shape (a BART step for BART's
[B, S] -> [B, S] batches); (3) beam search (4 beams) and greedy tokens/s of lmzoo and HF `generate` with the
same random weights (converted by `lmzoo.convert.hf`), every row forced to the full length (an EOS id outside
the vocabulary), HF with whichever of 1 or 2 torch threads is faster on a probe. The data-vs-step
ratios have a target (> 1: the host pipeline never starves the step), printed as PASS/MISS, never asserted;
the last line is one JSON record of every number.
"""

import dataclasses
import json
import os
import pathlib
import sys
import time

import jax
import numpy as np
import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from configs import bart as bart_configs  # noqa: E402
from configs import t5 as t5_configs  # noqa: E402
from lmzoo import (  # noqa: E402
    decoding,
    models,
    objectives,  # noqa: E402
    tokenizers,
)
from lmzoo.convert import hf  # noqa: E402
from lmzoo.data import noising  # noqa: E402
from lmzoo.data.loaders import Shard  # noqa: E402
from lmzoo.objectives import tasks  # noqa: E402

TARGETS = {"t5_data_vs_step": 1.0, "bart_data_vs_step": 1.0}  # strictly greater


@dataclasses.dataclass(frozen=True)
class Spec:
    vocab_size: int
    emb_dim: int
    num_heads: int
    head_dim: int
    num_layers: int  # encoder and decoder each
    mlp_dim: int
    inputs_len: int  # encoder length S; the decoder length T follows from span_corruption_lengths(S)
    batch_size: int
    steps_per_round: int
    bart_steps_per_round: int
    batches_per_round: int  # data pipeline batches timed per loader and round
    data_variant: str  # configs/{t5,bart}.py variant whose tokenizer and objective the loaders use
    decode_batch: int
    beam_size: int
    new_tokens: int

    @property
    def targets_len(self) -> int:
        return noising.span_corruption_lengths(self.inputs_len)[1]

    def model_fields(self) -> dict:
        """T5 v1.0 (ReLU MLP, tied head scaled by D ** -0.5, 32 relative buckets up to distance 128)."""
        return dict(
            vocab_size=self.vocab_size,
            emb_dim=self.emb_dim,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            num_encoder_layers=self.num_layers,
            num_decoder_layers=self.num_layers,
            mlp_dim=self.mlp_dim,
            relative_buckets=32,
            relative_max_distance=128,
            dropout_rate=0.0,
            attention_dropout_rate=0.0,
        )

    def bart_fields(self) -> dict:
        """configs/bart.py's architecture switches at this spec's sizes."""
        fields = {k: v for k, v in self.model_fields().items() if not k.startswith("relative")}
        return {**fields, **bart_configs.BART, "max_len": self.inputs_len + 2}

    def step_flops(self, decoder_len: int | None = None) -> float:
        """Train FLOPs of one step, 6 * matmul parameters per token on each side plus attention:

            encoder token: 6 * (L (4 D H + 2 D F) + L 2 D H)  (own blocks; the decoder's cross-attention K, V)
                           + 12 L S H                            (self-attention scores and values)
            decoder token: 6 * (L (6 D H + 2 D F) + V D)       (self q/k/v/o, cross q/o, MLP, tied head)
                           + 12 L (T + S) H                      (causal self-attention, not halved, + cross)

        with H = heads * head_dim, L layers per stack, times B S encoder and B T decoder tokens.
        """
        d, h, f, layers, v = (
            self.emb_dim,
            self.num_heads * self.head_dim,
            self.mlp_dim,
            self.num_layers,
            self.vocab_size,
        )
        s, t = self.inputs_len, decoder_len or self.targets_len
        encoder = 6 * (layers * (4 * d * h + 2 * d * f) + layers * 2 * d * h) + 12 * layers * s * h
        decoder = 6 * (layers * (6 * d * h + 2 * d * f) + v * d) + 12 * layers * (t + s) * h
        return self.batch_size * (s * encoder + t * decoder)


FULL = Spec(
    16384,
    256,
    4,
    64,
    4,
    1024,
    inputs_len=128,
    batch_size=16,
    steps_per_round=3,
    bart_steps_per_round=2,
    batches_per_round=20,
    data_variant="tiny",
    decode_batch=8,
    beam_size=4,
    new_tokens=32,
)
QUICK = Spec(
    512,
    64,
    2,
    32,
    2,
    256,
    inputs_len=32,
    batch_size=4,
    steps_per_round=2,
    bart_steps_per_round=1,
    batches_per_round=5,
    data_variant="test",
    decode_batch=2,
    beam_size=4,
    new_tokens=8,
)


def random_batch(spec: Spec, decoder_len: int, decoder_start_id: int, seed: int) -> dict[str, np.ndarray]:
    """Encoder inputs [B, S] and targets [B, T] of random ids (no padding, as full span-corruption windows)."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(2, spec.vocab_size, (spec.batch_size, spec.inputs_len), dtype=np.int32)
    targets = rng.integers(2, spec.vocab_size, (spec.batch_size, decoder_len), dtype=np.int32)
    start = np.full((spec.batch_size, 1), decoder_start_id, np.int32)
    return {
        "inputs": inputs,
        "encoder_segment_ids": np.ones_like(inputs),
        "targets": targets,
        "decoder_inputs": np.ascontiguousarray(np.concatenate([start, targets[:, :-1]], axis=1)),
        "weights": np.ones(targets.shape, np.float32),
    }


def hf_t5(cfg) -> "transformers.T5ForConditionalGeneration":
    """HF T5 with the config `hf.t5_config_to_hf` gives for the lmzoo config (random weights)."""
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(**hf.t5_config_to_hf(cfg)))


def lmzoo_trainer(cfg, batch: dict[str, np.ndarray], optim_config) -> common.LmzooTrainer:
    """lmzoo's seq2seq train step (`seq2seq_task`) for model config `cfg`."""
    return common.LmzooTrainer(tasks.seq2seq_task(models.build_model("seq2seq", cfg)), batch, optim_config)


def torch_trainer(cfg, batch: dict[str, np.ndarray], optim_config) -> common.TorchTrainer:
    """HF T5ForConditionalGeneration (eager attention: T5's relative bias) + torch AdamW as lmzoo trains."""
    inputs = {
        "input_ids": batch["inputs"],
        "attention_mask": batch["encoder_segment_ids"],
        "decoder_input_ids": batch["decoder_inputs"],
        "labels": batch["targets"],
    }
    return common.TorchTrainer(
        hf_t5(cfg),
        inputs,
        optim_config,
        decays=lambda name, param: param.ndim == 2 and "shared" not in name and "relative_attention_bias" not in name,
    )


def data_loaders(spec: Spec) -> tuple[dict, dict]:
    """({objective: train loader}, description) of configs/t5.py and configs/bart.py on their own corpus and
    tokenizer (trained as `lmzoo.train.loop` does), at the spec's batch size and encoder length."""
    loaders, info = {}, {}
    for name, module in (("t5", t5_configs), ("bart", bart_configs)):
        config = module.get_config(spec.data_variant)
        config.train.batch_size, config.data.seq_len = spec.batch_size, spec.inputs_len
        objective = objectives.build(config)
        raw = objective.read()
        start = time.perf_counter()
        kwargs = config.data.tokenizer.to_dict()
        corpus = objective.corpus(raw["train"]) + objective.corpus(raw["validation"])
        tokenizer = tokenizers.build_tokenizer(kwargs.pop("kind"), corpus=corpus, **kwargs)
        loaders[name] = objective.train_loader(tokenizer, raw["train"], Shard())
        batch = loaders[name].batch(0)
        info[name] = {
            "objective": config.objective.name,
            "text": config.data.path,
            "build_s": time.perf_counter() - start,
            "tokens": loaders[name].splits[0].num_tokens,
            "window": loaders[name].seq_len,
            "vocab": tokenizer.vocab_size,
            "inputs_shape": list(batch["inputs"].shape),
            "targets_shape": list(batch["targets"].shape),
            "inputs_fill": float(batch["encoder_segment_ids"].mean()),
            "targets_fill": float(batch["weights"].mean()),
        }
    return loaders, info


def bench_train_and_data(spec: Spec, rounds: int) -> dict:
    loaders, data_info = data_loaders(spec)
    t5_cfg = models.make_config("seq2seq", spec.model_fields())
    bart_cfg = models.make_config("seq2seq", spec.bart_fields())
    t5_batch = random_batch(spec, spec.targets_len, t5_cfg.decoder_start_id, seed=0)
    bart_batch = random_batch(spec, spec.inputs_len, bart_cfg.decoder_start_id, seed=1)
    for name, batch in (("t5", t5_batch), ("bart", bart_batch)):
        shapes = [data_info[name]["inputs_shape"], data_info[name]["targets_shape"]]
        if shapes != [list(batch["inputs"].shape), list(batch["targets"].shape)]:
            raise AssertionError(f"{name} loader batches are {shapes}, the benchmarked step's {batch['inputs'].shape}")
    t5_optim, bart_optim = t5_configs.get_config("tiny").optim, bart_configs.get_config("tiny").optim
    trainers = {
        "lmzoo": common.Isolated(lmzoo_trainer, t5_cfg, t5_batch, t5_optim),
        "torch": common.Isolated(torch_trainer, t5_cfg, t5_batch, t5_optim),
        "bart_step": common.Isolated(lmzoo_trainer, bart_cfg, bart_batch, bart_optim),
    }
    steps = {"lmzoo": spec.steps_per_round, "torch": spec.steps_per_round, "bart_step": spec.bart_steps_per_round}
    t5_tokens = spec.batch_size * (spec.inputs_len + spec.targets_len)  # encoder + decoder tokens
    tokens_per_step = {"lmzoo": t5_tokens, "torch": t5_tokens, "bart_step": spec.batch_size * 2 * spec.inputs_len}
    n, flops = spec.batches_per_round, spec.step_flops()

    def measure(r: int) -> dict[str, float]:
        row = common.train_rates(trainers, steps, tokens_per_step, r)
        for name, loader in loaders.items():
            seconds = common.timed(lambda lo=loader, s=range(r * n, (r + 1) * n): [lo.batch(i) for i in s])
            row[f"{name}_data"] = spec.batch_size * spec.inputs_len * n / seconds  # encoder-input tokens/s
        row["peak_gflops"] = max(common.matmul_peak(repeats=3).values())
        row["ratio"] = row["lmzoo"] / row["torch"]
        step_per_s = {name: row[name] / tokens_per_step[name] for name in trainers}
        row["mfu"] = flops * step_per_s["lmzoo"] / (row["peak_gflops"] * 1e9)
        row["torch_mfu"] = flops * step_per_s["torch"] / (row["peak_gflops"] * 1e9)
        row["t5_step_enc"] = step_per_s["lmzoo"] * spec.batch_size * spec.inputs_len  # encoder tokens/s eaten
        row["bart_step_enc"] = step_per_s["bart_step"] * spec.batch_size * spec.inputs_len
        row["t5_data_vs_step"] = row["t5_data"] / row["t5_step_enc"]
        row["bart_data_vs_step"] = row["bart_data"] / row["bart_step_enc"]
        return row

    return common.trainer_rounds(
        trainers,
        "train round",
        rounds,
        measure,
        tokens_per_step=tokens_per_step,
        flops_per_token=flops / tokens_per_step["lmzoo"],
        data=data_info,
    )


def bench_decode(spec: Spec, rounds: int) -> dict:
    """Beam search and greedy, lmzoo vs HF generate, same weights; tokens/s = B * new_tokens returned per call."""
    cfg = models.make_config("seq2seq", spec.model_fields())
    model = hf_t5(cfg).eval()
    module = models.build_model("seq2seq", cfg)
    params = hf.t5_from_hf({k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, cfg)
    params = jax.device_put(params)
    inputs = np.random.default_rng(2).integers(2, spec.vocab_size, (spec.decode_batch, spec.inputs_len), dtype=np.int32)
    never = spec.vocab_size  # an EOS id outside the vocabulary is never produced: every row runs to the full length
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=cfg.decoder_start_id,
        eos_token_id=never,
        pad_token_id=0,
        bos_token_id=None,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        no_repeat_ngram_size=0,
        min_length=0,
    )
    torch_inputs = torch.from_numpy(inputs.astype(np.int64))

    def hf_generate(beams: int, new_tokens: int = spec.new_tokens) -> np.ndarray:
        search = dict(num_beams=beams, early_stopping=True, length_penalty=1.0) if beams > 1 else {}
        with torch.no_grad():
            out = model.generate(
                torch_inputs,
                attention_mask=torch.ones_like(torch_inputs),
                do_sample=False,
                max_new_tokens=new_tokens,
                **search,
            )
        return out[:, 1:].numpy()

    probe_tokens = max(spec.new_tokens // 4, 1)
    hf_threads, probe_s = common.fastest_torch_threads(lambda: hf_generate(1, probe_tokens))

    def lmzoo_beam() -> np.ndarray:
        tokens, _ = decoding.beam_search(
            module,
            params,
            inputs,
            beam_size=spec.beam_size,
            max_new_tokens=spec.new_tokens,
            eos_id=never,
            length_penalty=1.0,
            early_stopping=True,
        )
        return np.asarray(tokens)

    def lmzoo_greedy() -> np.ndarray:
        key = jax.random.key(0)
        return np.asarray(
            decoding.generate_seq2seq(module, params, inputs, rng=key, max_new_tokens=spec.new_tokens, temperature=0.0)
        )

    runs = {
        "lmzoo_beam": lmzoo_beam,
        "hf_beam": lambda: hf_generate(spec.beam_size),
        "lmzoo_greedy": lmzoo_greedy,
        "hf_greedy": lambda: hf_generate(1),
    }
    compile_s, outputs = {}, {}
    for name, run in runs.items():  # first call: jit compile (lmzoo)
        start = time.perf_counter()
        outputs[name] = run()
        compile_s[name] = time.perf_counter() - start
    for name, out in outputs.items():
        if out.shape != (spec.decode_batch, spec.new_tokens):
            raise AssertionError(f"{name} returned {out.shape}, not the full length {spec.new_tokens}")

    def measure(r: int) -> dict[str, float]:
        row = common.rates(runs, dict.fromkeys(runs, spec.decode_batch * spec.new_tokens), r)
        row["beam_ratio"] = row["lmzoo_beam"] / row["hf_beam"]
        row["greedy_ratio"] = row["lmzoo_greedy"] / row["hf_greedy"]
        return row

    per_round = common.measure_rounds("decode round", rounds, measure)
    torch.set_num_threads(2)
    return common.summary(
        per_round,
        compile_s=compile_s,
        hf_threads=hf_threads,
        hf_thread_probe_s={str(k): v for k, v in probe_s.items()},
        hf_thread_probe_tokens=probe_tokens,
        beam_tokens_agree=float(np.mean(outputs["lmzoo_beam"] == outputs["hf_beam"])),
        greedy_tokens_agree=float(np.mean(outputs["lmzoo_greedy"] == outputs["hf_greedy"])),
    )


DATA_COLUMNS = [
    ("T5 data enc tok/s", "t5_data", "{:.0f}"),
    ("T5 step enc tok/s", "t5_step_enc", "{:.0f}"),
    ("T5 data/step", "t5_data_vs_step", "{:.1f}"),
    ("BART data enc tok/s", "bart_data", "{:.0f}"),
    ("BART step enc tok/s", "bart_step_enc", "{:.0f}"),
    ("BART data/step", "bart_data_vs_step", "{:.1f}"),
]
DECODE_COLUMNS = [
    ("lmzoo beam tok/s", "lmzoo_beam", "{:.1f}"),
    ("HF beam tok/s", "hf_beam", "{:.1f}"),
    ("beam lmzoo/HF", "beam_ratio", "{:.2f}"),
    ("lmzoo greedy tok/s", "lmzoo_greedy", "{:.1f}"),
    ("HF greedy tok/s", "hf_greedy", "{:.1f}"),
    ("greedy lmzoo/HF", "greedy_ratio", "{:.2f}"),
]


def main():
    parser = common.rounds_parser(__doc__, "tiny config and test tokenizers, 1 round (smoke test)")
    args = parser.parse_args()
    spec, rounds = (QUICK, 1) if args.quick else (FULL, args.rounds)
    torch.set_num_threads(2)
    transformers.logging.set_verbosity_error()
    load = common.announce("seq2seq", "quick" if args.quick else "full", spec, rounds)
    train = bench_train_and_data(spec, rounds)
    decode = bench_decode(spec, rounds)
    load["end"] = os.getloadavg()[0]

    compile_s, loss, s, t = train["compile_s"], train["loss_after_warmup"], spec.inputs_len, spec.targets_len
    print(
        f"\ntrain: T5 v1.0, {spec.num_layers}+{spec.num_layers} layers, D={spec.emb_dim}, {spec.num_heads}x{spec.head_dim} "
        f"heads, F={spec.mlp_dim}, V={spec.vocab_size}; B={spec.batch_size}, encoder S={s} + decoder T={t} "
        f"(span-corruption lengths), tokens/step = B (S + T) = {spec.batch_size * (s + t)}; {spec.steps_per_round} steps/round; "
        f"{train['flops_per_token'] / 1e6:.1f} MFLOP/token (see Spec.step_flops)"
    )
    print(
        "compile+1st step s: "
        + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items())
        + "; loss after warm-up: "
        + ", ".join(f"{k} {v:.3f}" for k, v in loss.items())
    )
    common.print_table(train, common.TRAIN_VS_TORCH_COLUMNS)
    print(
        f"\ndata pipeline ({spec.batches_per_round} batches/loader/round, single host thread) vs the lmzoo step's "
        f"consumption at the same batch shape, in encoder-input tokens/s (B x {s} per batch):"
    )
    for name, d in train["data"].items():
        print(
            f"  {name} ({d['objective']}): {d['text']}, {d['tokens']} tokens (vocab {d['vocab']}), window {d['window']}, "
            f"batches inputs {d['inputs_shape']} ({d['inputs_fill']:.0%} real) -> targets {d['targets_shape']} "
            f"({d['targets_fill']:.0%} real); built in {d['build_s']:.1f} s"
        )
    print(
        f"  step for BART batches: configs/bart.py architecture at the T5 sizes, decoder T={s}, "
        f"{spec.bart_steps_per_round} steps/round"
    )
    common.print_table(train, DATA_COLUMNS)
    print(
        f"\ndecode: batch {spec.decode_batch}, encoder {s} tokens, {spec.new_tokens} new tokens per row, EOS id "
        f"{spec.vocab_size} (outside the vocabulary, never produced: every row runs to full length); tokens/s = "
        f"{spec.decode_batch} x {spec.new_tokens} returned tokens per call; beam {spec.beam_size}, length penalty 1, "
        f"early stopping; same random weights (HF init, lmzoo via t5_from_hf)"
    )
    probe = decode["hf_thread_probe_s"]
    print(
        f"HF decodes with {decode['hf_threads']} torch thread(s): greedy probe of {decode['hf_thread_probe_tokens']} "
        f"tokens took {probe['1']:.2f} s with 1 thread, {probe['2']:.2f} s with 2"
    )
    print(
        "first call s (lmzoo includes jit compile): "
        + ", ".join(f"{k} {v:.1f}" for k, v in decode["compile_s"].items())
        + f"; tokens agree with HF: beam {decode['beam_tokens_agree']:.1%}, greedy {decode['greedy_tokens_agree']:.1%}"
    )
    common.print_table(decode, DECODE_COLUMNS)

    results = {name: train[f"median_{name}"] for name in TARGETS}
    medians = {
        "train_ratio": train["median_ratio"],
        "mfu": train["median_mfu"],
        "beam_ratio": decode["median_beam_ratio"],
        "greedy_ratio": decode["median_greedy_ratio"],
    }
    print(f"\nload average (1 min) at start {load['start']:.2f}, at end {load['end']:.2f}")
    print("medians: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    print("targets (medians):")
    for name, target in TARGETS.items():
        print(f"  {name:<18} {results[name]:>8.2f}  target > {target:<4}  {common.verdict(results[name] > target)}")
    record = {
        "bench": "seq2seq",
        "config": "quick" if args.quick else "full",
        "spec": dataclasses.asdict(spec),
        "targets_len": t,
        "train": train,
        "decode": decode,
        "load_average": load,
        "medians": medians,
        "targets": {
            name: {"value": results[name], "target": v, "pass": results[name] > v} for name, v in TARGETS.items()
        },
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
