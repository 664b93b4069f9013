"""check_values names every bad field and its fix; check_variants rejects unknown variant words."""

import pathlib

import pytest

from lmzoo import config as config_lib
from lmzoo import objectives


def _config(**overrides):
    c = config_lib.base_config()
    c.train.batch_size, c.eval.batch_size = 8, 16
    for field, value in overrides.items():
        section, key = field.split("__")
        c[section][key] = value
    return c


def test_defaults_pass():
    config_lib.check_values(_config(), data_parallel_size=8)


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "train__batch_size",
            0,
            "config.train.batch_size=0: must be a positive integer; set --config.train.batch_size=N",
        ),
        ("train__batch_size", -4, "config.train.batch_size=-4: must be a positive integer"),
        ("train__keep_checkpoints", 0, "config.train.keep_checkpoints=0: must be a positive integer"),
        ("train__log_every", 0, "config.train.log_every=0: must be a positive integer"),
        ("eval__batch_size", 0, "config.eval.batch_size=0: must be a positive integer"),
        ("data__seq_len", 0, "config.data.seq_len=0: must be a positive integer"),
        (
            "eval__batch_size",
            12,
            "config.eval.batch_size=12: must be a multiple of the 8 data-parallel devices; set --config.eval.batch_size=8",
        ),
        (
            "train__batch_size",
            4,
            "config.train.batch_size=4: must be a multiple of 8 (grad_accum_steps=1 x 8 data-parallel devices); set --config.train.batch_size=8",
        ),
        ("data__validation_fraction", 1.0, "config.data.validation_fraction=1.0: must be between 0 and 1"),
        ("data__sampler", "sequentail", "config.data.sampler='sequentail': choose 'random' or 'sequential'"),
        ("optim__learning_rate", 0.0, "config.optim.learning_rate=0.0: must be > 0"),
        ("sharding__mesh_shape", (-1, -1, 1), "config.sharding.mesh_shape=(-1, -1, 1): must be 3 sizes"),
    ],
)
def test_bad_value_is_named_with_its_fix(field, value, message):
    with pytest.raises(ValueError, match="invalid config values") as raised:
        config_lib.check_values(_config(**{field: value}), data_parallel_size=8)
    assert message in str(raised.value)


def test_microbatches_must_split_over_the_devices():
    with pytest.raises(ValueError, match=r"batch_size=8: must be a multiple of 16 \(grad_accum_steps=2 x 8"):
        config_lib.check_values(_config(train__grad_accum_steps=2), data_parallel_size=8)


def test_ppo_demonstration_rows_must_split_over_the_devices():
    from configs import hh_ppo

    config = hh_ppo.get_config("tiny")
    config.train.batch_size, config.eval.batch_size = 16, 16
    config.objective.update(minibatches=4, ptx_coef=0.5, ptx_batch_size=4)
    ppo = objectives.build(config)

    def check(devices):
        more = ppo.value_problems(data_parallel_size=devices, batches=True)
        config_lib.check_values(config, data_parallel_size=devices, more_problems=tuple(more))

    check(4)  # minibatch parts of 1 row: padded by the partitioner
    with pytest.raises(
        ValueError, match=r"objective.ptx_batch_size=4 must be a multiple of the 8 data-parallel devices"
    ):
        check(8)
    assert ppo.value_problems(data_parallel_size=8, batches=False) == []  # a run opened to restore params
    config.objective.ptx_coef = 0.0  # no demonstrations are read
    ppo = objectives.build(config)
    check(8)


def test_text_to_text_target_length_is_checked():
    config = _config(data__target_seq_len=0)
    config.objective = objectives.objective_section("text_to_text")
    more = objectives.build(config).value_problems(data_parallel_size=1, batches=True)
    with pytest.raises(ValueError, match="config.data.target_seq_len=0: must be a positive integer"):
        config_lib.check_values(config, data_parallel_size=8, more_problems=tuple(more))


def test_every_problem_is_listed_at_once():
    with pytest.raises(ValueError) as raised:
        config_lib.check_values(_config(train__batch_size=0, train__log_every=0, optim__eps=0.0), data_parallel_size=1)
    assert [line.split("=")[0].strip() for line in str(raised.value).splitlines()[1:]] == [
        "config.train.batch_size",
        "config.train.log_every",
        "config.optim.eps",
    ]


def test_check_variants():
    assert config_lib.check_variants("tiny,nsp", known=("tiny", "nsp")) == ("tiny", "nsp")
    assert config_lib.check_variants(None, known=("tiny",)) == ()
    with pytest.raises(ValueError, match="unknown config variant 'tinyy' in 'tinyy'; known variants: tiny"):
        config_lib.check_variants("tinyy", known=("tiny",))


@pytest.mark.parametrize(
    "path", sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.py")), ids=lambda p: p.stem
)
def test_every_config_refuses_an_unknown_variant(path):
    with pytest.raises(ValueError, match="unknown config variant 'tinyy'"):
        config_lib.load_config_file(path, "tinyy")


def test_a_missing_config_file_is_named():
    root = pathlib.Path(__file__).resolve().parents[1]
    with pytest.raises(FileNotFoundError, match="config file '.*configs/gpt2_124m.py:tiny' not found"):
        config_lib.load_config_file(f"{root}/configs/gpt2_124m.py:tiny")


def test_the_tokenizer_is_switched_on_the_command_line():
    """--config.data.tokenizer.path is a key of every config whose tokenizer section the base config gives, so the
    default run moves to GPT-2 BPE with two flags (issue 27)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    argv = ["--config.data.tokenizer.kind=gpt2", "--config.data.tokenizer.path=/some/gpt2"]
    config_lib.check_overrides(argv, default=str(root / "configs" / "default.py"))
