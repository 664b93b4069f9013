"""The shared conversion mechanism on hand-made tables: layouts both ways and the one validator."""

import numpy as np
import pytest

from lmzoo.convert import mapping, tables

LAYOUT = tables.Layout(name="HF toy", family="toy", prefix="body.", heads=frozenset({"head.weight"}))


def toy_entries() -> list[tables.Entry]:
    """A fused Conv1D query/key/value [4, 3 * 4] and an nn.Linear head [5, 4]."""
    table = []
    for index, name in enumerate(("query", "key", "value")):
        table += tables.conv1d("qkv", ("attn", name), 4, 4, out_shape=(2, 2), part=(index, 3))
    return table + tables.linear("head", ("head",), 4, 5, bias=False)


def toy_state_dict() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "body.qkv.weight": rng.normal(size=(4, 12)).astype(np.float32),
        "body.qkv.bias": rng.normal(size=(12,)).astype(np.float32),
        "head.weight": rng.normal(size=(5, 4)).astype(np.float32),
    }


def test_layouts_round_trip():
    state_dict = toy_state_dict()
    params = mapping.materialize(tables.to_sources(*tables.read_hf(state_dict, LAYOUT, toy_entries())))
    np.testing.assert_array_equal(
        params["attn"]["key"]["kernel"], state_dict["body.qkv.weight"][:, 4:8].reshape(4, 2, 2)
    )
    np.testing.assert_array_equal(params["attn"]["value"]["bias"], state_dict["body.qkv.bias"][8:].reshape(2, 2))
    np.testing.assert_array_equal(params["head"]["kernel"], state_dict["head.weight"].T)
    back = tables.to_hf(params, LAYOUT, toy_entries())
    assert list(back) == list(state_dict)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)
    unprefixed = tables.to_hf(params, LAYOUT, toy_entries(), prefixed=False)
    assert sorted(unprefixed) == ["head.weight", "qkv.bias", "qkv.weight"]


def test_one_validator_both_directions():
    state_dict = toy_state_dict()
    broken = {
        "body.qkv.weight": state_dict["body.qkv.weight"][:3],
        "body.extra": np.zeros(2),
        "head.weight": state_dict["head.weight"],
    }
    message = r"HF toy state dict does not match the config: unexpected keys \['extra'\], missing keys \['qkv.bias'\], misshapen qkv.weight: \(3, 12\) \(expected \(4, 12\)\)"
    with pytest.raises(ValueError, match=message):
        tables.read_hf(broken, LAYOUT, toy_entries())

    params = mapping.materialize(tables.to_sources(*tables.read_hf(state_dict, LAYOUT, toy_entries())))
    params["attn"]["query"]["kernel"] = np.zeros((4, 4))
    params["attn"]["key"].pop("bias")
    params["lm_head"] = {"kernel": np.zeros((4, 5))}
    message = (
        r"lmzoo params for HF toy does not match the config: unexpected keys \['lm_head/kernel'\], missing keys "
        r"\['attn/key/bias'\], misshapen attn/query/kernel: \(4, 4\) \(expected \(4, 2, 2\)\)"
    )
    with pytest.raises(ValueError, match=message):
        tables.to_hf(params, LAYOUT, toy_entries())


def test_scanned_layout_round_trip():
    per_layer = {"blocks": {f"layer_{i}": {"w": np.full((2,), i, np.float32)} for i in range(3)}, "out": np.ones(1)}
    target = {"blocks": {"layers": {"w": np.zeros((3, 2))}}, "out": np.zeros(1)}
    stacked = mapping.materialize(mapping.to_layout(per_layer, target))
    np.testing.assert_array_equal(stacked["blocks"]["layers"]["w"], [[0, 0], [1, 1], [2, 2]])
    again = mapping.unstack_layers(stacked)
    assert mapping.flatten(again).keys() == mapping.flatten(per_layer).keys()
    np.testing.assert_array_equal(again["blocks"]["layer_2"]["w"], [2, 2])
    relaid = mapping.to_layout(stacked, per_layer)  # the other way: a scanned stack split where the target loops
    assert mapping.flatten(relaid).keys() == mapping.flatten(per_layer).keys()
    np.testing.assert_array_equal(relaid["blocks"]["layer_1"]["w"], [1, 1])
    same = mapping.flatten(mapping.to_layout(per_layer, per_layer))  # already in the target's layout: as it is
    assert all(leaf is mapping.flatten(per_layer)[key] for key, leaf in same.items())
