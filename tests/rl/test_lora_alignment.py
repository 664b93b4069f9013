"""LoRA through the alignment chain (config.lora): a reward model trains adapters over the SFT trunk with its new head
in full (PEFT's modules_to_save); PPO and GRPO train adapters over the frozen SFT reference, held once, with the value
head in full; a LoRA reward model serves PPO as its merged model; a killed LoRA PPO run resumes exactly; eval.py and
`lmzoo.load` see the merged policy. GRPO samples from chat rows' prompts rendered through a chat template.

One 2-step SFT run on a slice of the real HH-RLHF file serves every case."""

import gzip
import itertools
import json
import pathlib

import jax
import numpy as np
import pytest
from flax import traverse_util

import lmzoo
from lmzoo import config as config_lib
from lmzoo import lora, objectives, weights
from lmzoo.data import chat, comparisons
from lmzoo.objectives import base as objectives_base
from lmzoo.train import loop
from lmzoo.train import run as run_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]
REAL_FILE = ROOT.parent / "shared" / "data" / "hh_rlhf" / "harmless-base_test.jsonl.gz"
TARGETS = "query|value|wo"


def tiny_config(spec: str, data: str, steps: int = 2, **lora_fields):
    path, _, variant = spec.partition(":")
    config = config_lib.load_config_file(ROOT / "configs" / path, variant)
    config.data.path = data
    config.train.steps = config.train.checkpoint_every = steps
    config.optim.decay_steps = 2  # a run stopped at step 1 resumes to 2 on the same schedule
    config.lora.update(targets=TARGETS, rank=2, alpha=4.0, **lora_fields)
    return config


def flat(tree) -> dict[str, np.ndarray]:
    return {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(jax.device_get(tree)).items()}


def latest(workdir):
    run = run_lib.build(run_lib.load_saved(str(workdir)), str(workdir))
    step, state, _ = run.checkpointer.restore_latest(run.abstract_state)
    run.close()
    return step, jax.device_get(state)


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """A 60-pair slice of the real file, a 2-step SFT run (full) and a 2-step LoRA reward model over it."""
    if not REAL_FILE.exists():
        pytest.skip("needs ../shared/data")
    root = tmp_path_factory.mktemp("lora_rl")
    data = root / "hh.jsonl"
    with gzip.open(REAL_FILE, "rt", encoding="utf-8") as f:
        data.write_text("".join(itertools.islice(f, 60)))
    sft = tiny_config("hh_sft.py:tiny", str(data))
    sft.lora.targets = ""
    loop.train_and_evaluate(sft, str(root / "sft"))
    rm = tiny_config("hh_rm.py:tiny", str(data))
    rm.init_from = f"ckpt:{root / 'sft'}"
    loop.train_and_evaluate(rm, str(root / "rm"))
    return {"root": root, "data": str(data), "sft": root / "sft", "rm": root / "rm"}


def test_a_lora_reward_model_trains_adapters_and_its_head_in_full(stages):
    step, state = latest(stages["rm"])
    trained = flat(state.params)
    heads = {k for k in trained if not k.endswith(("lora_a", "lora_b"))}
    assert heads == {"classifier/kernel", "classifier/bias"}  # the new head, trained in full; no trunk weight
    assert any(k.endswith("query/lora_b") and np.abs(v).max() > 0 for k, v in trained.items())
    # its model is the SFT trunk plus the adapters, and the trained head
    loaded = lmzoo.load(str(stages["rm"]))
    sft = flat(weights.checkpoint_params(str(stages["sft"])))
    model = flat(loaded.params)
    for name in ("backbone/wte/embedding", "backbone/blocks/layer_0/attn/key/kernel"):  # not targeted: the SFT's
        np.testing.assert_array_equal(model[name], sft[name.removeprefix("backbone/")])
    adapted = lora.LoraConfig(TARGETS, rank=2, alpha=4.0)
    query = "blocks/layer_0/attn/query"
    expected = lora.merge({"backbone": weights.checkpoint_params(str(stages["sft"]))}, state.params, adapted)
    np.testing.assert_allclose(model[f"backbone/{query}/kernel"], flat(expected)[f"backbone/{query}/kernel"], atol=1e-6)
    np.testing.assert_array_equal(model["classifier/kernel"], trained["classifier/kernel"])
    assert not np.array_equal(model[f"backbone/{query}/kernel"], sft[f"{query}/kernel"])


@pytest.mark.parametrize("variant", ["tiny", "tiny,grpo"])
def test_lora_ppo_trains_over_the_frozen_reference_and_resumes_exactly(stages, variant, tmp_path):
    def config(steps):
        c = tiny_config(f"hh_ppo.py:{variant}", stages["data"], steps=steps)
        c.objective.update(sft=f"ckpt:{stages['sft']}", reward_model=f"ckpt:{stages['rm']}")
        if "grpo" in variant:
            c.objective.samples_per_prompt = 2
        return c

    final = loop.train_and_evaluate(config(2), str(tmp_path / "straight"))
    loop.train_and_evaluate(config(1), str(tmp_path / "resumed"))
    loop.train_and_evaluate(config(2), str(tmp_path / "resumed"))
    (step_a, a), (step_b, b) = latest(tmp_path / "straight"), latest(tmp_path / "resumed")
    assert step_a == step_b == 2
    jax.tree.map(np.testing.assert_array_equal, (a.params, a.opt_state, a.kl_coef), (b.params, b.opt_state, b.kl_coef))
    trained = flat(a.params)
    assert {k for k in trained if not k.endswith(("lora_a", "lora_b"))} == {"value_head/kernel", "value_head/bias"}
    assert all(k.startswith("decoder/") for k in trained if k.endswith(("lora_a", "lora_b")))
    assert any(k.endswith("lora_b") and np.abs(v).max() > 0 for k, v in trained.items())
    # the optimizer state covers what is trained, no base weight
    moments = {leaf.size for leaf in jax.tree.leaves(a.opt_state)}
    assert max(moments) <= max(v.size for v in trained.values())
    # the model eval.py, export and `lmzoo.load` see: the reference merged with the adapters, the trained value head
    loaded = flat(lmzoo.load(str(tmp_path / "straight")).params)
    sft = flat(weights.checkpoint_params(str(stages["sft"])))
    np.testing.assert_array_equal(loaded["decoder/wte/embedding"], sft["wte/embedding"])
    assert not np.array_equal(
        loaded["decoder/blocks/layer_0/attn/query/kernel"], sft["blocks/layer_0/attn/query/kernel"]
    )
    np.testing.assert_array_equal(loaded["value_head/kernel"], trained["value_head/kernel"])
    assert np.isfinite(final["score"]) and np.isfinite(final["kl"])
    # ckpt: of the run (a later stage's init_from) is the merged policy's decoder
    from_ckpt = flat(weights.read_params(f"ckpt:{tmp_path / 'straight'}", "gpt", {}, None))
    np.testing.assert_allclose(
        from_ckpt["blocks/layer_0/attn/query/kernel"], loaded["decoder/blocks/layer_0/attn/query/kernel"], atol=1e-6
    )


def test_lora_ppo_refuses_a_separate_value_network(stages, tmp_path):
    config = tiny_config("hh_ppo.py:tiny", stages["data"])
    config.objective.update(sft=f"ckpt:{stages['sft']}", reward_model=f"ckpt:{stages['rm']}", value_model="reward")
    with pytest.raises(ValueError, match="set --config.objective.value_model=head"):
        loop.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


CHATML = (  # Qwen's template: the generation prompt opens the assistant's turn
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_lora_grpo_samples_from_chat_prompts_rendered_through_the_template(stages, tmp_path):
    # trl's prompt-only rows, GRPO's usual dataset: {"prompt": [messages]}
    prompts = [{"prompt": chat.hh_rows(c)[1]["prompt"]} for c in comparisons.read_comparisons(stages["data"])]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in prompts))
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    config = tiny_config("hh_ppo.py:tiny,grpo", str(tmp_path / "chat.jsonl"), steps=1)
    config.data.seq_len = config.model.max_len
    config.objective.update(
        sft=f"ckpt:{stages['sft']}",
        reward_model=f"ckpt:{stages['rm']}",
        samples_per_prompt=2,
        prompt_len=48,
        response_len=8,
        chat_template=str(tmp_path / "chat_template.jinja"),
    )
    objective = objectives.get("ppo")(config)
    train = objective.read()["train"]
    prompts = objective._prompts(train, "train split")
    tokenizer = objectives_base.fixed_tokenizer(config)
    first = tokenizer.decode([i for i, m in zip(prompts["prompts"][0], prompts["prompt_mask"][0]) if m])
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in train[0].prompt)
    assert rendered.endswith(first.removesuffix("<|im_start|>assistant\n"))  # the end kept when cut to prompt_len
    assert first.endswith("<|im_end|>\n<|im_start|>assistant\n") and len(first) == 48  # byte tokens: 48 bytes
    final = loop.train_and_evaluate(config, str(tmp_path / "grpo"))
    assert np.isfinite(final["score"]) and np.isfinite(final["kl"])
