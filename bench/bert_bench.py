"""BERT benchmark: lmzoo's production masked-LM train step vs HuggingFace BertForMaskedLM + torch AdamW, and the
host masking pipeline against the step's consumption.

    python bench/bert_bench.py [--rounds 3] [--quick]

Measures, in interleaved rounds because the machine's speed drifts: (1) MLM train tokens/s of the same encoder
in lmzoo (`compile_trainer` + `masked_lm_task`, the step `lmzoo.train.loop` runs, with MLM logits only at the
M = ceil(0.15 T) + 1 highest-weight positions), in lmzoo with full [B, T, V] logits (as HF computes them) and in
torch eager, all on one batch masked by `mask_rows`, each in a process of its own (`common.Isolated`); (2) examples/s of the real data path of configs/bert.py
(KJV, bert-base-uncased WordPiece, `make_loaders`: mlm_nsp sentence pairs, built when a batch reads them, through
ExampleLoader + masked_pairs,
and its :roberta variant's mlm windows through LMLoader + mlm_from_windows) against the examples/s the lmzoo
step consumes. No targets: ratios are printed; the last line is one JSON record of every number.
"""

import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np
import torch
import transformers

transformers.logging.set_verbosity_error()  # here, so the trainers' own processes get it too
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from configs import bert as bert_configs  # noqa: E402
from lmzoo import (  # noqa: E402
    models,
    tokenizers,
)
from lmzoo.data import readers, sources, transforms  # noqa: E402
from lmzoo.data.loaders import Shard  # noqa: E402
from lmzoo.objectives import losses, tasks  # noqa: E402
from lmzoo.train import run as run_lib  # noqa: E402
from lmzoo.trainers.state import Task  # noqa: E402

MASK_RATE = 0.15


@dataclasses.dataclass(frozen=True)
class Spec:
    vocab_size: int
    emb_dim: int
    num_heads: int
    num_layers: int
    mlp_dim: int
    seq_len: int
    batch_size: int
    steps_per_round: int
    batches_per_round: int  # data pipeline batches timed per loader and round
    num_pair_examples: int  # 0: every sentence with a successor
    max_documents: int  # KJV paragraphs per split; 0 = all

    def model_fields(self) -> dict:
        return dict(
            vocab_size=self.vocab_size,
            max_len=self.seq_len,
            emb_dim=self.emb_dim,
            num_heads=self.num_heads,
            num_layers=self.num_layers,
            mlp_dim=self.mlp_dim,
            dropout_rate=0.0,
            attention_dropout_rate=0.0,
            pooler=False,
            sentence_head=False,
        )


FULL = Spec(
    30522,
    256,
    4,
    4,
    1024,
    seq_len=128,
    batch_size=16,
    steps_per_round=4,
    batches_per_round=20,
    num_pair_examples=0,
    max_documents=0,
)
QUICK = Spec(
    512,
    64,
    2,
    2,
    256,
    seq_len=32,
    batch_size=4,
    steps_per_round=2,
    batches_per_round=5,
    num_pair_examples=256,
    max_documents=200,
)


def full_logits_task(model) -> Task:
    """masked_lm_task with the vocabulary projection at all T positions (`Bert.__call__`), as HF computes it."""

    def loss(params, frozen, carry, batch, rng, *, step, train):
        logits = model.apply({"params": params}, batch["inputs"], deterministic=not train, rngs={"dropout": rng})
        value, metrics = losses.token_loss(logits, batch)
        return value, (metrics, carry)

    return dataclasses.replace(tasks.masked_lm_task(model, mask_rate=MASK_RATE), loss=loss)


def lmzoo_trainer(spec: Spec, batch: dict[str, np.ndarray], optim_config, full_logits: bool) -> common.LmzooTrainer:
    """lmzoo's MLM train step: logits at the masked positions only (`masked_lm_task`), or at all of them."""
    model = models.build_model("bert", spec.model_fields())
    task = full_logits_task(model) if full_logits else tasks.masked_lm_task(model, mask_rate=MASK_RATE)
    return common.LmzooTrainer(task, batch, optim_config)


def torch_trainer(spec: Spec, batch: dict[str, np.ndarray], optim_config) -> common.TorchTrainer:
    """HF BertForMaskedLM (sdpa attention, labels -100 at unmasked positions) + torch AdamW as lmzoo trains."""
    torch.manual_seed(0)
    hf_config = transformers.BertConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.emb_dim,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        intermediate_size=spec.mlp_dim,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=spec.seq_len,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        tie_word_embeddings=True,
    )
    model = transformers.BertForMaskedLM._from_config(hf_config, attn_implementation="sdpa")
    inputs = {"input_ids": batch["inputs"], "labels": np.where(batch["weights"] > 0, batch["targets"], -100)}
    return common.TorchTrainer(
        model, inputs, optim_config, decays=lambda name, param: param.ndim == 2 and "embeddings" not in name
    )


def masked_batch(spec: Spec, tokenizer: tokenizers.Tokenizer) -> dict[str, np.ndarray]:
    """[CLS] random word pieces [SEP] rows, 15% masked by `mask_rows` (static, example ids 0..B-1)."""
    rng = np.random.default_rng(0)
    words = rng.integers(tokenizer.mask_id + 1, spec.vocab_size, (spec.batch_size, spec.seq_len - 2), dtype=np.int32)
    column = lambda i: np.full((spec.batch_size, 1), i, np.int32)  # noqa: E731
    tokens = np.concatenate([column(tokenizer.cls_id), words, column(tokenizer.sep_id)], axis=1)
    ids = np.arange(spec.batch_size)
    return transforms.mask_rows(
        tokens,
        ids,
        np.zeros_like(ids),
        seed=0,
        static=True,
        mask_id=tokenizer.mask_id,
        vocab_size=spec.vocab_size,
        special_ids=sorted(tokenizer.special_ids.values()),
        rate=MASK_RATE,
    )


def data_loaders(spec: Spec) -> tuple[tokenizers.Tokenizer, dict, dict]:
    """(tokenizer, {objective: train loader}, description) from configs/bert.py (mlm_nsp) and :roberta (mlm)."""
    config = bert_configs.get_config("bert")
    documents = [text for split, text in sources.source_from_config(config.data).documents() if split == "train"]
    corpus = pathlib.Path(tempfile.mkdtemp(prefix="bert-bench-")) / "train.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[: spec.max_documents or None]))
    tokenizer = tokenizers.HFTokenizer.wordpiece(config.data.tokenizer.path)
    loaders, info = {}, {"text": config.data.path, "vocab": config.data.tokenizer.path}
    for variant in ("bert", "roberta"):
        config = bert_configs.get_config(variant)
        config.train.batch_size, config.data.seq_len = spec.batch_size, spec.seq_len
        if config.objective.name == "mlm_nsp":
            config.objective.num_pair_examples, config.objective.num_eval_pairs = spec.num_pair_examples, 16
        name, start = config.objective.name, time.perf_counter()
        train = readers.CorpusSplit(config, "train", sources.FileCorpus((corpus,), description="bench corpus"))
        loaders[name] = run_lib.validated_objective(config).train_loader(tokenizer, train, Shard())
        seconds = time.perf_counter() - start
        size = loaders[name].num_examples if name == "mlm_nsp" else loaders[name].splits[0].num_tokens
        info[name] = {
            "loader": type(loaders[name]).__name__,
            "build_s": seconds,
            "size": size,
            "size_unit": "pairs" if name == "mlm_nsp" else "tokens",
        }
    return tokenizer, loaders, info


def bench(spec: Spec, rounds: int) -> dict:
    tokenizer, loaders, data_info = data_loaders(spec)
    batch = masked_batch(spec, tokenizer)
    optim_config = bert_configs.get_config("bert").optim
    trainers = {
        "lmzoo": common.Isolated(lmzoo_trainer, spec, batch, optim_config, False),
        "lmzoo_full": common.Isolated(lmzoo_trainer, spec, batch, optim_config, True),
        "torch": common.Isolated(torch_trainer, spec, batch, optim_config),
    }
    steps_per_round = dict.fromkeys(trainers, spec.steps_per_round)
    tokens_per_step, n = dict.fromkeys(trainers, spec.batch_size * spec.seq_len), spec.batches_per_round

    def measure(r: int) -> dict[str, float]:
        row = common.train_rates(trainers, steps_per_round, tokens_per_step, r)
        for name, loader in loaders.items():
            seconds = common.timed(lambda lo=loader, steps=range(r * n, (r + 1) * n): [lo.batch(s) for s in steps])
            row[name] = spec.batch_size * n / seconds
        row["ratio"] = row["lmzoo"] / row["torch"]
        row["full_ratio"] = row["lmzoo_full"] / row["torch"]
        row["masked_speedup"] = row["lmzoo"] / row["lmzoo_full"]
        row["step_examples"] = row["lmzoo"] / spec.seq_len
        for name in loaders:
            row[f"{name}_vs_step"] = row[name] / row["step_examples"]
        return row

    return common.trainer_rounds(
        trainers,
        "round",
        rounds,
        measure,
        masked_positions_per_row=float(batch["weights"].sum(axis=1).mean()),
        data=data_info,
    )


TRAIN_COLUMNS = [
    ("lmzoo tok/s", "lmzoo", "{:.0f}"),
    ("lmzoo full-logits tok/s", "lmzoo_full", "{:.0f}"),
    ("torch tok/s", "torch", "{:.0f}"),
    ("lmzoo/torch", "ratio", "{:.3f}"),
    ("full/torch", "full_ratio", "{:.3f}"),
    ("lmzoo/full", "masked_speedup", "{:.3f}"),
]
PIPELINE_COLUMNS = [
    ("step ex/s", "step_examples", "{:.1f}"),
    ("mlm_nsp ex/s", "mlm_nsp", "{:.0f}"),
    ("mlm ex/s", "mlm", "{:.0f}"),
    ("mlm_nsp/step", "mlm_nsp_vs_step", "{:.1f}"),
    ("mlm/step", "mlm_vs_step", "{:.1f}"),
]


def main():
    parser = common.rounds_parser(__doc__, "tiny config and 200 KJV paragraphs, 1 round (smoke test)")
    args = parser.parse_args()
    spec, rounds = (QUICK, 1) if args.quick else (FULL, args.rounds)
    load = common.announce("bert", "quick" if args.quick else "full", spec, rounds)
    result = bench(spec, rounds)
    load["end"] = os.getloadavg()[0]

    compile_s, loss, data = result["compile_s"], result["loss_after_warmup"], result["data"]
    print(
        f"\ntrain (MLM only): B={spec.batch_size} T={spec.seq_len} ({spec.batch_size * spec.seq_len} tokens/step), "
        f"{spec.steps_per_round} steps/round, {result['masked_positions_per_row']:.1f} masked positions/row; "
        "lmzoo computes the vocabulary projection at the M = ceil(0.15 T) + 1 top-weight positions, "
        "full-logits lmzoo and HF at all T"
    )
    print(
        "compile+1st step s: "
        + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items())
        + "; loss after warm-up: "
        + ", ".join(f"{k} {v:.4f}" for k, v in loss.items())
    )
    common.print_table(result, TRAIN_COLUMNS)
    print(
        f"\ndata pipeline ({spec.batches_per_round} batches/loader/round, single host thread) vs the lmzoo step's "
        f"consumption; {data['text']}, {data['vocab']}"
    )
    for name in ("mlm_nsp", "mlm"):
        d = data[name]
        print(f"  {name}: {d['loader']} over {d['size']} {d['size_unit']}, built in {d['build_s']:.1f} s")
    common.print_table(result, PIPELINE_COLUMNS)

    print(f"\nload average (1 min) at start {load['start']:.2f}, at end {load['end']:.2f}")
    medians = {
        k: result[f"median_{k}"] for k in ("ratio", "full_ratio", "masked_speedup", "mlm_nsp_vs_step", "mlm_vs_step")
    }
    print("medians: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    record = {
        "bench": "bert",
        "config": "quick" if args.quick else "full",
        "spec": dataclasses.asdict(spec),
        "results": result,
        "load_average": load,
        "medians": medians,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
