"""Text-to-text generations scored against their references, on a tiny trained Transformer."""

import json
import pathlib

import jax
import numpy as np

from lmzoo import config as config_lib
from lmzoo import decoding, evaluation
from lmzoo.evaluation import reconstruction
from lmzoo.train import loop
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORDS = ["red", "green", "blue", "cat", "dog", "fox", "runs", "sleeps"]


def test_generation_evaluator_decodes_greedily_to_eos_and_scores_references(tmp_path):
    rng = np.random.default_rng(0)
    pairs = tmp_path / "pairs.jsonl"
    targets = set()
    with pairs.open("w") as f:
        for _ in range(40):
            words = " ".join(rng.choice(WORDS, size=3))
            targets.add(words[::-1][:10])
            f.write(json.dumps({"chosen": f"Human: {words}\n\nAssistant: {words[::-1][:10]}"}) + "\n")
    config = config_lib.load_config_file(ROOT / "configs" / "transformer.py", "tiny,hh,test")
    config.data.path, config.data.tokenizer, config.model.vocab_size = str(pairs), {"kind": "byte"}, 258
    loop.train_and_evaluate(config, str(tmp_path / "run"))

    run = run_lib.open_run(str(tmp_path / "run"))
    _, state = run_lib.restore_step(run)
    metrics, examples = evaluation.EVALUATORS["generation"](run, state, "validation")
    assert metrics["generated_examples"] == len(examples) == 4 and metrics["evaluated_batches"] == 1
    assert examples[0]["source"].startswith("Human:") and all(e["reference"].strip() in targets for e in examples)
    assert metrics == {
        **reconstruction.text_metrics([e["generation"] for e in examples], [e["reference"] for e in examples]),
        "generated_examples": 4,
        "evaluated_batches": 1,
    }
    batch = next(iter(run.eval_batches("validation")))
    params, eos = run.compiled.host_params(state), run.tokenizer.eos_id
    tokens = np.asarray(
        decoding.generate_seq2seq(
            run.model,
            params,
            batch["inputs"][:1],
            rng=jax.random.key(0),
            max_new_tokens=16,
            encoder_segment_ids=batch["encoder_segment_ids"][:1],
            temperature=0.0,
            eos_id=eos,
            pad_id=run.tokenizer.pad_id,
        )
    )[0].tolist()
    expected = tokens[: tokens.index(eos)] if eos in tokens else tokens
    assert examples[0]["generation"] == run.tokenizer.decode([t for t in expected if t != run.tokenizer.pad_id])
    run.close()
