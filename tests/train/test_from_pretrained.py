"""`init_from=hf:` as a `from_pretrained` user expects it, through train.py's own steps in process (its flags on a
FlagValues of their own, then what its main runs): config.model takes the checkpoint's config.json (a config file's
fields are defaults, a contradicting command-line override is an error), a model too large for the memory it would
live in is refused before it is built (the dry run too), and docs/finetune.md's Llama 3 chain (LoRA SFT, LoRA DPO from
it, the merged export, eval.py --chat) runs on a Llama-3-style checkpoint named as the docs name it,
meta-llama/Meta-Llama-3-8B-Instruct, here a tiny random one in a Hugging Face cache laid out in the test
(tests/convert/llama3_folder.py: no pad token, <|eot_id|> and <|end_of_text|> both end a generation)."""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest
from absl import flags

from lmzoo import config as config_lib
from lmzoo.cli import export as export_cli
from lmzoo.train import loop

ROOT = pathlib.Path(__file__).resolve().parents[2]
HUB_ID, COMMIT = "meta-llama/Meta-Llama-3-8B-Instruct", "0123456789abcdef0123456789abcdef01234567"


def _load(name: str, path: pathlib.Path):
    """The script or module at `path` as module `name` (reused when already loaded: absl flags are defined once)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


TRAIN = _load("train_from_pretrained", ROOT / "train.py")
EVAL = _load("eval_cli", ROOT / "eval.py")  # the name tests/evaluation/test_eval_cli.py and test_docs.py load it as
LLAMA3 = _load("llama3_folder", ROOT / "tests" / "convert" / "llama3_folder.py")
# docs/finetune.md's stages shrunk: rows of 64 tokens, 4 a step, 2 steps, one evaluation of one batch.
SHRUNK = [
    "--config.data.seq_len=64",
    "--config.train.batch_size=4",
    "--config.train.grad_accum_steps=1",
    "--config.eval.batch_size=4",
    "--config.train.steps=2",
    "--config.optim.decay_steps=2",
    "--config.train.eval_every=2",
    "--config.train.checkpoint_every=2",
    "--config.train.log_every=1",
    "--config.eval.max_batches=1",
]


def parsed(argv: list[str]) -> flags.FlagValues:
    """train.py's flags parsed from `argv` as its __main__ parses them."""
    argv = config_lib.resolve_config_path(argv)
    config_lib.check_overrides(argv, default=str(ROOT / "configs" / "default.py"))
    flag_values = flags.FlagValues()
    TRAIN.define_flags(flag_values, ["train.py", *argv])
    flag_values(["train.py", *argv])
    return flag_values


def train(argv: list[str], workdir: pathlib.Path) -> pathlib.Path:
    """What `python train.py ARGV --workdir=WORKDIR` runs (train.main, one process)."""
    flag_values = parsed(argv)
    TRAIN.take_pretrained_fields(flag_values.config, TRAIN.command_line_overrides(flag_values))
    loop.train_and_evaluate(flag_values.config, str(workdir))
    return workdir


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(snapshot folder, special ids) of HUB_ID in a Hugging Face cache (HF_HUB_CACHE) holding the tiny checkpoint,
    whose model always says <|end_of_text|>, and chat rows beside it."""
    root = tmp_path_factory.mktemp("hub")
    repo = root / "models--meta-llama--Meta-Llama-3-8B-Instruct"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    ids = LLAMA3.write_folder(snapshot, says="<|end_of_text|>")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    rows, pairs = LLAMA3.conversations(16)
    for name, lines in (("conversations.jsonl", rows), ("pairs.jsonl", pairs)):
        (root / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_CACHE", str(root))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield snapshot, ids


def test_a_config_files_model_is_a_default_the_checkpoint_replaces(hub, capsys):
    snapshot, _ = hub
    argv = [
        "--config=configs/llama.py:tiny",
        f"--config.init_from=hf:{HUB_ID}",
        "--config.data.tokenizer.kind=init_from",
    ]
    flag_values = parsed(argv)
    summary = TRAIN.dry_run(flag_values.config, "runs/x", TRAIN.command_line_overrides(flag_values))
    model = flag_values.config.model
    checkpoint = json.loads((snapshot / "config.json").read_text())
    assert (
        (model.vocab_size, model.emb_dim, model.num_layers)
        == (310, 32, 2)
        == tuple(checkpoint[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers"))
    )
    assert (model.num_heads, model.num_kv_heads, model.mlp_dim, model.max_len) == (4, 2, 64, 256)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and "num_layers 1->2" in printed[0] and "emb_dim 128->32" in printed[0]
    assert "state needs about" in summary and "host memory" in summary
    # a command-line override that agrees is kept; one that contradicts is the error, unless a partial load is asked
    agreeing = parsed([*argv, "--config.model.num_layers=2"])
    TRAIN.take_pretrained_fields(agreeing.config, TRAIN.command_line_overrides(agreeing))
    contradicting = parsed([*argv, "--config.model.num_layers=4"])
    with pytest.raises(ValueError, match=r"config.model.num_layers=4, checkpoint 2\. Drop the override"):
        TRAIN.dry_run(contradicting.config, "runs/x", TRAIN.command_line_overrides(contradicting))
    partial = parsed([*argv, "--config.model.num_layers=4", "--config.init_from_partial=True"])
    TRAIN.take_pretrained_fields(partial.config, TRAIN.command_line_overrides(partial))
    assert (partial.config.model.num_layers, partial.config.model.emb_dim) == (4, 32)


def test_a_model_too_large_for_memory_is_refused_before_it_is_built(monkeypatch, tmp_path):
    monkeypatch.setattr(config_lib, "available_memory", lambda: 100_000)
    flag_values = parsed(["--config=configs/llama.py:tiny"])
    refusal = r"state needs about \d\.\d\d MB of host memory \([\d,]+ parameters.*more than the 100 kB available.*"
    with pytest.raises(ValueError, match=refusal + r"mesh_shape='\(1,-1,1\)'.*param_dtype=bfloat16"):
        TRAIN.dry_run(flag_values.config, str(tmp_path / "run"))
    with pytest.raises(ValueError, match=refusal):
        loop.train_and_evaluate(flag_values.config, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "config.json").exists()


def test_llama3_8b_in_float32_is_refused_by_the_dry_run_with_the_numbers():
    """Through the real entry: 8,030,261,248 parameters and AdamW's two moments in float32, 96 GB."""
    if (config_lib.available_memory() or math.inf) > 96e9:
        pytest.skip("this machine has the memory for it")
    command = [sys.executable, "train.py", "--config=configs/llama.py:llama3_8b", "--dry_run", "--workdir=runs/no"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(
        "error: the llama model's state needs about 96.36 GB"
    )
    assert "8,030,261,248 parameters" in result.stderr and "--config.sharding.mesh_shape" in result.stderr


@pytest.fixture(scope="module")
def sft(hub, tmp_path_factory):
    root = pathlib.Path(hub[0]).parents[2]
    argv = ["--config=configs/llama_sft.py:llama3_8b", f"--config.data.path={root / 'conversations.jsonl'}", *SHRUNK]
    return train(argv, tmp_path_factory.mktemp("llama3_8b_sft") / "run")


@pytest.fixture(scope="module")
def dpo(hub, sft, tmp_path_factory):
    root = pathlib.Path(hub[0]).parents[2]
    argv = [
        "--config=configs/llama_sft.py:llama3_8b,dpo",
        f"--config.objective.sft=ckpt:{sft}",
        f"--config.data.path={root / 'pairs.jsonl'}",
        *SHRUNK,
    ]
    return train(argv, tmp_path_factory.mktemp("llama3_8b_dpo") / "run")


def test_the_sft_stage_trains_the_checkpoints_shape_with_its_tokenizer(hub, sft):
    _, ids = hub
    saved = json.loads((sft / "config.json").read_text())
    assert saved["init_from"] == f"hf:{HUB_ID}" and saved["data"]["tokenizer"]["kind"] == "init_from"
    model = saved["model"]
    assert (model["emb_dim"], model["num_layers"], model["vocab_size"], model["mlp_dim"]) == (32, 2, 310, 64)
    assert (model["param_dtype"], model["scan_layers"], model["remat_policy"]) == (
        "bfloat16",
        True,
        "full",
    )  # the file's
    spec = json.loads((sft / "tokenizer" / "spec.json").read_text())
    assert spec["special_ids"] == {"eos": ids["eot"], "bos": ids["bos"], "pad": ids["reserved_0"]}
    assert spec["eos_ids"] == [ids["eot"], ids["end_of_text"]]
    assert math.isfinite(json.loads((sft / "metrics.jsonl").read_text().splitlines()[0])["loss"])


def test_the_dpo_stage_runs_from_it_and_starts_at_ln_2(dpo):
    first = json.loads((dpo / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-3)  # the policy starts as the reference


def test_the_merged_export_writes_the_checkpoints_tokens_template_and_eos_ids(hub, dpo, tmp_path):
    import transformers

    snapshot, ids = hub
    out = tmp_path / "exported"
    assert export_cli.export_workdir(str(dpo), str(out))["tokenizer"]
    original, exported = (transformers.AutoTokenizer.from_pretrained(str(f)) for f in (snapshot, out))
    messages = [{"role": "user", "content": "Hello, how are you?"}]
    text = original.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert exported.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    assert (exported.bos_token, exported.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    assert exported.pad_token == "<|reserved_special_token_0|>"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [ids["eot"], ids["end_of_text"]]


def test_eval_chat_wraps_the_prompt_in_the_template_and_ends_the_turn_at_any_eos_id(hub, dpo, capsys):
    """The model says <|end_of_text|> (generation_config.json's second eos id) at once: the reply is empty."""
    args = [f"--workdir={dpo}", "--generate=Hello, how are you?", "--chat", "--max_new_tokens=3", "--temperature=0"]
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["eval.py", *args])
    try:
        EVAL.main(["eval.py"])
    finally:
        flags.FLAGS.unparse_flags()
    assert capsys.readouterr().out.splitlines()[-1] == ""
