"""PEFT LoRA adapters <-> lmzoo (`lmzoo.lora.peft`, `lmzoo.lora`): parity with `peft` on a random HF
Llama of odd shapes both ways, the merged export, a scanned model, and the errors for adapters of another base."""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmzoo import lora
from lmzoo.convert import export, llama
from lmzoo.lora import peft
from lmzoo.models import build_model, make_config

TOL = 1e-5
VOCAB = 61
# hidden 48 with 3 query heads (head_dim 16) sharing 1 key/value head; an MLP of 40.
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_attention_heads=3,
    num_key_value_heads=1,
    num_hidden_layers=2,
    intermediate_size=40,
    max_position_embeddings=32,
    rms_norm_eps=1e-5,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))


def lmzoo_config(**overrides):
    return make_config("llama", {**llama.config_from_hf({**SHAPE, "model_type": "llama"}), **overrides})


@functools.cache
def logits_fn(cfg):
    model = build_model("llama", cfg)
    return jax.jit(lambda params: model.apply({"params": params}, jnp.asarray(TOKENS)))


@pytest.fixture(scope="module")
def hf():
    """(torch, transformers, peft, a seeded random float32 LlamaForCausalLM factory, its state dict as numpy)."""
    torch = pytest.importorskip("torch", reason="PEFT parity needs torch (pip install -r requirements-test.txt)")
    transformers = pytest.importorskip("transformers", reason="PEFT parity needs transformers")
    hf_peft = pytest.importorskip("peft", reason="PEFT parity needs peft (pip install -r requirements-test.txt)")

    def base_model():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**SHAPE)
        return transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").float().eval()

    state_dict = {key: value.detach().numpy().copy() for key, value in base_model().state_dict().items()}
    return torch, transformers, hf_peft, base_model, state_dict


def hf_logits(torch, model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.numpy()


@pytest.fixture(scope="module")
def peft_folder(hf, tmp_path_factory):
    """A PEFT adapter (r 4, alpha 8, q/k/v/o/gate/up/down) with random nonzero A and B, and PEFT's logits with it."""
    torch, _, hf_peft, base_model, _ = hf
    torch.manual_seed(1)
    model = hf_peft.get_peft_model(
        base_model(), hf_peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=HF_TARGETS)
    ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.1)
    folder = tmp_path_factory.mktemp("peft_adapter")
    model.save_pretrained(str(folder))
    with model.disable_adapter():
        base = hf_logits(torch, model)
    return folder, hf_logits(torch, model), base


@pytest.mark.parity
def test_peft_adapter_in_lmzoo_matches_peft_and_exports_merged(hf, peft_folder, tmp_path):
    torch, transformers, _, _, state_dict = hf
    folder, theirs, base = peft_folder
    cfg = lmzoo_config()
    params = llama.from_hf(state_dict, cfg)
    adapters, config = peft.load_peft(str(folder), params, "llama", cfg)
    assert config == lora.LoraConfig("key|out|query|value|wi_0|wi_1|wo", rank=4, alpha=8.0, dropout=0.05)
    merged = lora.merge(params, adapters, config)
    ours = np.asarray(logits_fn(cfg)(merged))
    diff = float(np.max(np.abs(ours - theirs)))
    print(
        f"PEFT -> lmzoo: max |lmzoo - PEFT| logits {diff:.2e} (the adapter moves them by {np.abs(theirs - base).max():.2f})"
    )
    assert diff <= TOL
    assert np.abs(theirs - base).max() > 0.1

    export.export_hf("llama", cfg, jax.device_get(merged), str(tmp_path))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    diff = float(np.max(np.abs(hf_logits(torch, exported) - theirs)))
    print(f"merged export: max |HF(merged) - PEFT| logits {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parity
def test_lmzoo_adapter_in_peft_matches_lmzoo(hf, tmp_path):
    torch, _, hf_peft, base_model, state_dict = hf
    cfg = lmzoo_config()
    params = llama.from_hf(state_dict, cfg)
    config = lora.LoraConfig("query|key|value|out|wi_0|wi_1|wo", rank=4, alpha=6.0, rslora=True)
    abstract = jax.eval_shape(build_model("llama", cfg).init, jax.random.key(0), jnp.asarray(TOKENS))["params"]
    adapters = nn.unbox(lora.init_adapters(jax.random.key(0), abstract, config))
    rng = np.random.default_rng(1)
    adapters = jax.tree.map(lambda x: rng.normal(0.0, 0.05, x.shape).astype(np.float32), adapters)
    summary = peft.save_peft(str(tmp_path), adapters, config, "llama", cfg)
    assert summary["tensors"] == 2 * 7 * 2 and summary["target_modules"] == sorted(HF_TARGETS)
    ours = np.asarray(logits_fn(cfg)(lora.merge(params, adapters, config)))
    theirs = hf_logits(torch, hf_peft.PeftModel.from_pretrained(base_model(), str(tmp_path)).eval())
    diff = float(np.max(np.abs(ours - theirs)))
    moved = float(np.max(np.abs(ours - np.asarray(logits_fn(cfg)(params)))))
    print(f"lmzoo -> PEFT: max |PEFT - lmzoo| logits {diff:.2e} (the adapter moves them by {moved:.2f})")
    assert diff <= TOL and moved > 0.1


@pytest.mark.parity
def test_peft_adapter_loads_into_a_scanned_model(hf, peft_folder):
    *_, state_dict = hf
    folder, theirs, _ = peft_folder
    cfg = lmzoo_config(scan_layers=True)
    abstract = nn.unbox(jax.eval_shape(build_model("llama", cfg).init, jax.random.key(0), jnp.asarray(TOKENS)))
    from lmzoo.convert import mapping

    params = mapping.materialize(mapping.to_layout(llama.from_hf(state_dict, lmzoo_config()), abstract["params"]))
    adapters, config = peft.load_peft(str(folder), params, "llama", cfg)
    assert adapters["blocks"]["layers"]["attn"]["out"]["lora_a"].shape == (2, 3, 16, 4)
    ours = np.asarray(logits_fn(cfg)(lora.merge(params, adapters, config)))
    assert float(np.max(np.abs(ours - theirs))) <= TOL


def random_adapters(cfg, config, seed=0):
    abstract = jax.eval_shape(build_model("llama", cfg).init, jax.random.key(0), jnp.asarray(TOKENS))["params"]
    adapters = nn.unbox(lora.init_adapters(jax.random.key(seed), abstract, config))
    return abstract, jax.device_get(adapters)


def test_an_adapter_of_another_base_names_what_differs(tmp_path):
    config = lora.LoraConfig("query|wo", rank=4, alpha=8.0)
    wider = lmzoo_config(emb_dim=60, num_layers=3)
    _, adapters = random_adapters(wider, config)
    peft.save_peft(str(tmp_path), adapters, config, "llama", wider)
    cfg = lmzoo_config()
    abstract, _ = random_adapters(cfg, config)
    with pytest.raises(ValueError, match="another base") as error:
        peft.load_peft(str(tmp_path), nn.unbox(abstract), "llama", cfg)
    message = str(error.value)
    assert (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight: adapter (4, 60), model expects (4, 48)"
        in message
    )
    assert (
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight: adapter (60, 4), model expects (48, 4)" in message
    )
    assert "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight: the model has no linear" in message


def test_unsupported_adapters_and_families_are_refused(tmp_path):
    cfg = lmzoo_config()
    config = lora.LoraConfig("query", rank=2, alpha=2.0)
    abstract, adapters = random_adapters(cfg, config)
    peft.save_peft(str(tmp_path), adapters, config, "llama", cfg)
    written = json.loads((tmp_path / peft.CONFIG_FILE).read_text())
    assert written["target_modules"] == ["q_proj"] and written["r"] == 2
    (tmp_path / peft.CONFIG_FILE).write_text(json.dumps({**written, "use_dora": True, "bias": "all"}))
    with pytest.raises(ValueError, match="use_dora=True, bias='all'; lmzoo reads plain LoRA"):
        peft.load_peft(str(tmp_path), nn.unbox(abstract), "llama", cfg)
    with pytest.raises(
        ValueError, match=r"PEFT adapters are read and written for \['deepseek', 'llama', 'qwen3_5'\].*'gpt2'"
    ):
        peft.save_peft(str(tmp_path), adapters, config, "gpt2", {"vocab_size": 32})
    # Only some layers adapted: PEFT's target_modules names each module in full.
    some = {"blocks": {"layer_1": adapters["blocks"]["layer_1"]}}
    summary = peft.save_peft(str(tmp_path / "one_layer"), some, config, "llama", cfg)
    assert summary["target_modules"] == ["model.layers.1.self_attn.q_proj"]
    loaded, loaded_config = peft.load_peft(str(tmp_path / "one_layer"), nn.unbox(abstract), "llama", cfg)
    assert loaded_config.targets == r"blocks/layer_1/attn/query" and list(loaded["blocks"]) == ["layer_1"]
