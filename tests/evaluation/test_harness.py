"""lm-eval parity: a random GPT-2 and a random Llama (grouped-query attention) from HF score the same through
lm-eval's HF backend and the lmzoo model."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -r requirements-test.txt)")
transformers = pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval", reason="pip install -r requirements-test.txt")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from lmzoo import tokenizers  # noqa: E402
from lmzoo.cli import harness as cli_harness  # noqa: E402
from lmzoo.convert import gpt2, llama, safetensors_reader  # noqa: E402
from lmzoo.evaluation import harness  # noqa: E402
from lmzoo.models import build_model, make_config  # noqa: E402
from lmzoo.train import run as run_lib  # noqa: E402

TEXTS = ["the movie was great fun", "the plot was terrible and slow", "a great cast, a dull script", "terrible acting"]
TASK = """task: tiny_sentiment
dataset_path: json
dataset_kwargs:
  data_files:
    train: {dir}/train.jsonl
    test: {dir}/test.jsonl
output_type: multiple_choice
training_split: train
test_split: test
fewshot_split: train
doc_to_text: "{{{{context}}}} It was"
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - metric: acc
"""


CONVERTERS = {"gpt2": gpt2, "llama": llama}


def random_hf_model(family: str, vocab_size: int, eos_id: int):
    """A random HF decoder of `family` with 32 positions (a Llama with 4 query and 2 kv heads); norm scales near 1."""
    torch.manual_seed(0)
    ids = dict(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id)
    if family == "llama":
        shape = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
        config = transformers.LlamaConfig(**ids, **shape, max_position_embeddings=32, num_key_value_heads=2)
        model, norm = transformers.LlamaForCausalLM(config), "norm"
    else:
        dropouts = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        config = transformers.GPT2Config(**ids, **dropouts, n_positions=32, n_embd=32, n_layer=2, n_head=4)
        model, norm = transformers.GPT2LMHeadModel(config), "ln"
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if norm in name and name.endswith("weight") else 0.0, 0.2 if norm in name else 0.15)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CONVERTERS))
def hf_folder(request, tmp_path_factory):
    """An HF folder of the family: random weights (max_len 32), a byte-level BPE trained on TEXTS."""
    import tokenizers as hf

    folder = tmp_path_factory.mktemp(f"hf_{request.param}")
    bpe = hf.Tokenizer(hf.models.BPE())
    bpe.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(
        vocab_size=290, special_tokens=["<|endoftext|>"], initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(TEXTS * 10, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    fast.save_pretrained(str(folder))
    random_hf_model(request.param, len(fast), fast.eos_token_id).save_pretrained(str(folder))
    (folder / "train.jsonl").write_text(
        "".join(
            json.dumps({"context": t, "choices": ["terrible", "great"], "gold": int("great" in t)}) + "\n"
            for t in TEXTS
        )
    )
    test = [
        ("great fun", 1),
        ("slow and dull", 0),
        ("the cast was terrible", 0),
        ("a great movie", 1),
        ("the script", 1),
    ]
    (folder / "test.jsonl").write_text(
        "".join(json.dumps({"context": c, "choices": ["terrible", "great"], "gold": g}) + "\n" for c, g in test)
    )
    return folder


@pytest.fixture(scope="module")
def models(hf_folder):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    hf_config, state_dict = safetensors_reader.read_safetensors_dir(str(hf_folder))
    family = hf_config["model_type"]
    fields, params = CONVERTERS[family].read_checkpoint(hf_config, state_dict)
    tokenizer = tokenizers.HFTokenizer.from_file(str(hf_folder / "tokenizer.json"))
    loaded = run_lib.Loaded(
        model=build_model(family, make_config(family, fields)), params=params, tokenizer=tokenizer, config=None, step=0
    )
    reference = HFLM(pretrained=str(hf_folder), tokenizer=str(hf_folder), device="cpu", dtype="float32", batch_size=4)
    return harness.LmzooLM(loaded, batch_size=4), reference


def requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


@pytest.mark.parity
def test_loglikelihoods_match_the_hf_backend(models):
    ours, reference = models
    pairs = [
        ("the movie was", " great"),
        ("", "terrible acting"),
        ("a great cast, ", "a dull script"),
        ("the plot " * 12, "was slow"),
    ]
    got, expected = (
        ours.loglikelihood(requests("loglikelihood", pairs)),
        reference.loglikelihood(requests("loglikelihood", pairs)),
    )
    np.testing.assert_allclose([g[0] for g in got], [e[0] for e in expected], atol=1e-4, rtol=0)
    assert [g[1] for g in got] == [e[1] for e in expected]
    long_text = [(" ".join(TEXTS * 3),), ("great fun",)]  # the first needs several windows of 32 tokens
    np.testing.assert_allclose(
        ours.loglikelihood_rolling(requests("loglikelihood_rolling", long_text)),
        reference.loglikelihood_rolling(requests("loglikelihood_rolling", long_text)),
        atol=1e-4,
        rtol=0,
    )


@pytest.mark.parity
def test_greedy_generation_matches_the_hf_backend(models):
    ours, reference = models
    gen = [
        ("the movie was", {"until": ["."], "max_gen_toks": 6, "do_sample": False}),
        ("terrible", {"until": ["\n"], "max_gen_toks": 6}),
    ]
    assert ours.generate_until(requests("generate_until", gen)) == reference.generate_until(
        requests("generate_until", gen)
    )


@pytest.mark.parity
def test_same_accuracy_on_a_local_task(models, hf_folder, tmp_path):
    ours, reference = models
    (tmp_path / "tiny_sentiment.yaml").write_text(TASK.format(dir=hf_folder))
    manager = TaskManager(include_path=str(tmp_path))
    results = [
        lm_eval.simple_evaluate(
            model=lm,
            tasks=["tiny_sentiment"],
            task_manager=manager,
            num_fewshot=2,
            random_seed=0,
            fewshot_random_seed=0,
        )["results"]["tiny_sentiment"]["acc,none"]
        for lm in (ours, reference)
    ]
    assert results[0] == results[1]


def test_registered_next_to_lm_evals_own_models():
    from lm_eval.api.registry import get_model

    assert get_model("lmzoo") is cli_harness.WorkdirLM and get_model("hf") is HFLM


def test_a_ppo_policy_is_scored_by_its_decoder(models):
    """A PPO run's model is its decoder with a value head: lm-eval scores the decoder, as --generate and export do."""
    from lmzoo.models import heads

    ours, _ = models
    loaded = run_lib.Loaded(
        model=heads.LMWithValueHead(ours.model),
        params={"decoder": ours.params, "value_head": {}},
        tokenizer=ours.tokenizer,
        config=None,
        step=0,
    )
    policy = harness.LmzooLM(loaded, batch_size=4)
    assert policy.model is ours.model and policy.params is ours.params
    pairs = requests("loglikelihood", [("The movie was", " great")])
    assert policy.loglikelihood(pairs) == ours.loglikelihood(pairs)
