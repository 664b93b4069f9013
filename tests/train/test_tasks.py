"""End-to-end smoke tests of the encoder objectives through train_and_evaluate (real data in ../shared/data)."""

import importlib.util
import json
import pathlib
import sys

import jax
import numpy as np
import pytest
from absl import flags

from lmzoo import testing
from lmzoo.evaluation.generation import sample_text
from lmzoo.train import loop
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
pytestmark = pytest.mark.skipif(not SHARED.exists(), reason="needs ../shared/data (KJV, SST-2, bert vocab)")


def _config(name: str, arg: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


@pytest.fixture(scope="module")
def bert_tiny(tmp_path_factory):
    """configs/bert.py:tiny trained once (its workdir, its final evaluation): the `tiny` case of the masked-LM test,
    the classifier's pretraining checkpoint and the distillation teacher, which all only read it."""
    workdir = tmp_path_factory.mktemp("bert_tiny")
    return workdir, loop.train_and_evaluate(_config("bert", "tiny"), str(workdir))


@pytest.mark.parametrize("variant", ["tiny", "tiny,roberta", "tiny,albert"])
def test_masked_lm_pretraining_runs(tmp_path, variant, request):
    if variant == "tiny":  # the module's shared run; asked for here so that the other variants do not train it
        final = request.getfixturevalue("bert_tiny")[1]
    else:
        final = loop.train_and_evaluate(_config("bert", variant), str(tmp_path))
    assert np.isfinite(final["loss"]) and final["tokens"] > 0
    if variant != "tiny,roberta":
        assert 0.0 <= final["sentence_accuracy"] <= 1.0


def test_classifier_fine_tunes_from_a_pretraining_checkpoint(tmp_path, bert_tiny):
    config = _config("sst2", "tiny")
    config.init_from = f"ckpt:{bert_tiny[0]}"
    final = loop.train_and_evaluate(config, str(tmp_path / "finetune"))
    assert 0.0 <= final["accuracy"] <= 1.0 and final["examples"] == 256 and 0.0 <= final["macro_f1"] <= 1.0


def test_gpt_classifier_fine_tunes_from_a_decoder_checkpoint(tmp_path):
    """Radford et al.'s [START] a [EXTRACT] on SST-2 from a causal-LM run; the token table gains three rows."""
    pretrain = testing.tiny_config(sample_tokens=0)
    loop.train_and_evaluate(pretrain, str(tmp_path / "pretrain"))
    config = _config("sst2", "tiny,gpt")
    config.model.update({k: pretrain.model[k] for k in ("num_layers", "emb_dim", "num_heads", "mlp_dim", "max_len")})
    config.init_from = f"ckpt:{tmp_path / 'pretrain'}"
    final = loop.train_and_evaluate(config, str(tmp_path / "finetune"))
    assert 0.0 <= final["accuracy"] <= 1.0 and final["examples"] == 256
    run = run_lib.open_run(str(tmp_path / "finetune"))
    batch = next(iter(run.eval_batches("validation")))
    extract = batch["inputs"][np.arange(len(batch["inputs"])), batch["segment_ids"].sum(axis=1) - 1]
    assert (batch["inputs"][:, 0] == 258).all() and (extract == 260).all() and "token_types" not in batch
    run.close()
    pretrained = run_lib.load(str(tmp_path / "pretrain")).params["wte"]["embedding"]
    tuned = run_lib.load(str(tmp_path / "finetune")).params["backbone"]["wte"]["embedding"]
    assert pretrained.shape == (258, 32) and tuned.shape == (261, 32)


def test_distillation_trains_student_against_frozen_teacher(tmp_path, bert_tiny):
    config = _config("distilbert", "tiny")
    config.objective.teacher = f"ckpt:{bert_tiny[0]}"
    final = loop.train_and_evaluate(config, str(tmp_path / "student"))
    assert np.isfinite(final["distill_loss"]) and 0.0 <= final["cosine_loss"] <= 2.0
    student = run_lib.open_run(str(tmp_path / "student"))
    state, _ = run_lib.restore_or_init(student)
    student.close()
    teacher = run_lib.load(str(bert_tiny[0]))
    for a, b in zip(jax.tree.leaves(state.frozen["teacher"]), jax.tree.leaves(teacher.params), strict=True):
        np.testing.assert_array_equal(a, b)  # the teacher never changes: read again from its workdir on resume
    assert len(state.params["blocks"]) == 1
    saved = {p.name for p in (tmp_path / "student" / "checkpoints" / "4" / "state" / "d").parent.rglob("*")}
    assert not any("teacher" in name for name in saved)  # frozen parameters are not checkpointed


# eval.py defines its flags on absl's FLAGS when loaded, so it is loaded once per process, as the module "eval_cli"
# (tests/evaluation/test_eval_cli.py and tests/test_matrix.py run it so too).
EVAL = sys.modules.get("eval_cli")
if EVAL is None:
    _spec = importlib.util.spec_from_file_location("eval_cli", ROOT / "eval.py")
    EVAL = sys.modules["eval_cli"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(EVAL)


def run_eval(capsys, *args: str) -> str:
    """Runs eval.py's main in this process with `args` (absl's flags reset to their defaults around it); returns what
    it printed. A process of its own would add only its start-up (imports, the programs read back from the compilation
    cache): what the test checks is the evaluation's output, and a failing one raises here."""
    capsys.readouterr()  # what the test printed before (the training's progress) is not eval.py's output
    flags.FLAGS.unparse_flags()
    try:
        flags.FLAGS(["eval.py", *args])
        EVAL.main(["eval.py"])
    finally:
        flags.FLAGS.unparse_flags()
    return capsys.readouterr().out


@pytest.mark.parametrize("name,beam_size", [("t5", 2), ("bart", 1), ("transformer", 1)])
def test_denoising_pretraining_runs(tmp_path, capsys, name, beam_size):
    final = loop.train_and_evaluate(_config(name, "tiny,test"), str(tmp_path))
    assert np.isfinite(final["loss"]) and final["tokens"] > 0
    run = run_lib.open_run(str(tmp_path))
    _, state = run_lib.restore_step(run)
    text = sample_text(
        run,
        run.compiled.host_params(state),
        "The Time Traveller",
        max_new_tokens=4,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=0,
    )
    assert isinstance(text, str) and len(run.tokenizer.encode(text)) <= 4
    run.close()
    out = run_eval(capsys, f"--workdir={tmp_path}", "--reconstruct=3", f"--beam_size={beam_size}", "--max_batches=1")
    line = json.loads(out.splitlines()[0])
    assert line["reconstruct_examples"] == 3 and line["beam_size"] == beam_size and 0.0 <= line["bleu"] <= 100.0
    for key in ("rouge1", "rouge2", "rougeL", "exact_match", "target_token_accuracy", "copy_bleu", "copy_exact_match"):
        assert 0.0 <= line[key] <= (100.0 if key == "copy_bleu" else 1.0), key
    assert "[reconstruction]" in out and "[original]" in out


def test_text_to_text_trains_on_dialogue_pairs(tmp_path):
    """The Transformer on HH-RLHF (conversation so far -> final response) through train_and_evaluate."""
    final = loop.train_and_evaluate(_config("transformer", "tiny,hh,test"), str(tmp_path))
    assert np.isfinite(final["loss"]) and final["tokens"] > 0
    too_long = _config("transformer", "tiny,hh,test")
    too_long.data.target_seq_len = too_long.model.max_len + 1
    with pytest.raises(ValueError, match="config.data.target_seq_len=33 .* longer than the model's positions"):
        run_lib.build(too_long, str(tmp_path / "too_long"))


@pytest.mark.parametrize("variant", ["tiny", "tiny,mistral"])
def test_llama_trains_through_the_loop_and_samples_past_its_context(tmp_path, variant):
    """The Llama block (GQA, RoPE; Mistral's window) trains on Shakespeare and generates beyond max_len (64)."""
    final = loop.train_and_evaluate(_config("llama", variant), str(tmp_path))
    assert np.isfinite(final["loss"]) and final["tokens"] > 0
    run = run_lib.open_run(str(tmp_path))
    _, state = run_lib.restore_step(run)
    kwargs = dict(max_new_tokens=80, temperature=0.0, top_k=0, top_p=1.0, seed=0, note_window=False)
    text = sample_text(run, run.compiled.host_params(state), "ROMEO:", **kwargs)
    assert len(run.tokenizer.encode(text)) == 80
    run.close()
