"""Tool environments: the calculator's arithmetic, formatting and refusals, episodes in text, resolving by name."""

import sys

import pytest

from lmzoo.rl import environments
from lmzoo.rl.environments import CalculatorEnv, Step, calculate, run_episode


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("48/2", "24"),
        ("7/3", "2.333333"),
        ("2**10", "1024"),
        ("-(3+4)*2", "-14"),
        ("1e3", "1000"),
        ("0.1+0.2", "0.3"),
        ("1/8", "0.125"),
        ("17//5 + 17%5", "5"),
        (" 2.5 * 4 ", "10"),
        ("+3 - -2", "5"),
        ("2**-0.5", "0.707107"),
        ("10**-7", "1e-07"),
        ("1/3 - 1/3", "0"),
    ],
)
def test_calculator_arithmetic_and_formatting(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    "expression, message",
    [
        ("x + 1", "name 'x'"),
        ("abs(-3)", "Call"),
        ("__import__('os').system('true')", "Call"),
        ("(1).real", "Attribute"),
        ("'a' * 3", "constant 'a'"),
        ("True + 1", "constant True"),
        ("2 ^ 3", "operator BitXor"),
        ("[1, 2]", "List"),
        ("9**9**9", "exponent"),
        ("2**101", "exponent"),
        ("10**16", "magnitude"),
        ("1e15 * 10", "magnitude"),
        ("1e999", "magnitude"),
        ("(-8) ** (1/3)", "complex"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("3 +* 4", "malformed"),
        ("", "malformed"),
        ("1\x002", "malformed"),
        ("1+" * 200 + "1", "longer than"),
    ],
)
def test_calculator_refuses(expression, message):
    result = calculate(expression)
    assert result.startswith("error: ") and message in result, result


def test_calculator_refuses_division_by_zero_in_exact_words():
    assert calculate("48/(2-2)") == "error: division by zero"


def test_calculator_step_answers_a_trailing_call_and_ends_on_anything_else():
    env = CalculatorEnv()
    assert env.stop_strings == ("</calc>",)
    assert env.reset({"question": "q"}) == ""
    assert env.step("Half of 48 is <calc>48/2</calc>") == Step("<result>24</result>", 0.0, False)
    assert env.step("<calc>1/0</calc>\n") == Step("<result>error: division by zero</result>", 0.0, False)
    # Only the last call is answered: the earlier one was already answered in an earlier turn.
    assert env.step("<calc>1+1</calc> so <calc>2*3</calc>").observation == "<result>6</result>"
    assert env.step("The answer is 24.") == Step("", 0.0, True)
    assert env.step("<calc>48/2</calc> and then some").done
    assert env.step("just a closing </calc>").done


def test_stop_at_cuts_after_the_earliest_stop_string():
    stops = ("</calc>", "<stop>")
    assert environments.stop_at("a <calc>1+1</calc> b <stop>", stops) == "a <calc>1+1</calc>"
    assert environments.stop_at("a <stop> <calc>1</calc>", stops) == "a <stop>"
    assert environments.stop_at("no stop here", stops) == "no stop here"
    assert environments.stop_at("anything", ()) == "anything"


def _scripted(turns):
    """A policy that replays turns, recording the context it was given each time."""
    contexts = []

    def policy_turn(context):
        contexts.append(context)
        return turns[len(contexts) - 1]

    return policy_turn, contexts


def test_run_episode_alternates_policy_and_environment_segments():
    turns = ["Half: <calc>48/2</calc>", " then <calc>24*3</calc>", " so the answer is 72."]
    policy_turn, contexts = _scripted(turns)
    episode = run_episode(CalculatorEnv(), {"question": "q"}, policy_turn, max_turns=5)
    assert episode.segments == [
        (turns[0], True),
        ("<result>24</result>", False),
        (turns[1], True),
        ("<result>72</result>", False),
        (turns[2], True),
    ]
    assert (episode.reward, episode.turns, episode.hit_turn_limit) == (0.0, 3, False)
    # Each turn sees everything written after the prompt so far, observations included.
    assert contexts == ["", turns[0] + "<result>24</result>", "".join(text for text, _ in episode.segments[:4])]


def test_run_episode_cuts_an_overshooting_turn_at_the_stop_string():
    policy_turn, _ = _scripted(["<calc>2**10</calc><result>999</result> made up", "Done."])
    episode = run_episode(CalculatorEnv(), {}, policy_turn, max_turns=4)
    assert episode.segments[:2] == [("<calc>2**10</calc>", True), ("<result>1024</result>", False)]
    assert episode.turns == 2 and not episode.hit_turn_limit


class _Scored(environments.Environment):
    """Greets at reset, rewards every turn 1.0, and ends the episode only on "bye"."""

    def reset(self, row):
        return row["greeting"]

    def step(self, text):
        return Step("ok", 1.0, text == "bye")


def test_run_episode_starts_with_the_reset_observation_and_sums_rewards():
    policy_turn, contexts = _scripted(["hi", "bye"])
    episode = run_episode(_Scored(), {"greeting": "hello"}, policy_turn, max_turns=3)
    assert episode.segments == [("hello", False), ("hi", True), ("ok", False), ("bye", True), ("ok", False)]
    assert contexts[0] == "hello"
    assert (episode.reward, episode.turns, episode.hit_turn_limit) == (2.0, 2, False)


def test_turn_limit_ends_an_endless_episode_and_reports_it():
    calls = []

    def endless(context):
        calls.append(context)
        return "<calc>1+1</calc>"

    episode = run_episode(CalculatorEnv(), {}, endless, max_turns=3)
    assert len(calls) == 3
    assert (episode.turns, episode.hit_turn_limit) == (3, True)
    assert [is_policy for _, is_policy in episode.segments] == [True, False] * 3


def test_an_episode_ending_on_the_last_allowed_turn_did_not_hit_the_limit():
    policy_turn, _ = _scripted(["<calc>1</calc>", "1"])
    episode = run_episode(CalculatorEnv(), {}, policy_turn, max_turns=2)
    assert (episode.turns, episode.hit_turn_limit) == (2, False)


def test_run_episode_needs_a_turn():
    with pytest.raises(ValueError, match="max_turns"):
        run_episode(CalculatorEnv(), {}, lambda context: "", max_turns=0)


def test_base_environment_without_step_says_what_to_define():
    with pytest.raises(NotImplementedError, match="step"):
        environments.Environment().step("text")


def test_resolve_registry_name():
    assert environments.resolve("calculator") is CalculatorEnv
    assert environments.REGISTRY["calculator"] is CalculatorEnv


def test_resolve_unknown_name_is_one_line_naming_it_and_the_fix():
    with pytest.raises(ValueError) as raised:
        environments.resolve("calculater")
    message = str(raised.value)
    assert "\n" not in message and "'calculater'" in message
    assert "calculator" in message and "module:Class" in message


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """tmp_path on sys.path, with the modules imported from it forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_resolve_module_class(module_dir):
    (module_dir / "my_envs.py").write_text(
        "from lmzoo.rl.environments import Environment, Step\n"
        "\n"
        "class Echo(Environment):\n"
        "    stop_strings = ('</echo>',)\n"
        "\n"
        "    def step(self, text):\n"
        "        return Step(text.upper(), 0.5, True)\n"
    )
    env = environments.resolve("my_envs:Echo")()
    assert env.stop_strings == ("</echo>",)
    assert env.step("hey") == Step("HEY", 0.5, True)


def test_resolve_module_errors_name_the_module_and_the_fix(module_dir):
    (module_dir / "broken_envs.py").write_text("import no_such_dependency_xyz\n")
    (module_dir / "plain_envs.py").write_text("VALUE = 3\n")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'.*PYTHONPATH"):
        environments.resolve("no_such_module_xyz:Env")
    with pytest.raises(ValueError, match="'plain_envs' has no class or function 'Missing'"):
        environments.resolve("plain_envs:Missing")
    with pytest.raises(ValueError, match="'VALUE'"):
        environments.resolve("plain_envs:VALUE")
    # A module that exists but fails on its own import keeps its own error.
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        environments.resolve("broken_envs:Env")
