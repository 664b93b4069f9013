"""Environments for multi-turn RL episodes with tools, driven on the host in text.

An episode starts from a prompt row. `Environment.reset(row)` gives the first observation, appended
after the prompt (usually ""). The policy then writes a turn; generation stops at one of the
environment's `stop_strings` (e.g. "</calc>") so the environment can answer. `Environment.step(text)`
reads that turn and returns a `Step`: the observation the environment inserts into the context
next, the turn's reward, and whether the episode is over. Turns alternate until `done`.

The observation's tokens go into the context the policy conditions on, but they are masked out of
the loss: the policy did not choose them, so there is no log-probability of the policy to improve.
The trainer does that masking; an environment only returns text.

An environment may never say `done` (a policy that calls the tool forever), so the caller bounds
an episode with `max_turns`: after that many policy turns it ends the episode as if done=True and
counts it as having hit the turn limit. `run_episode` is that loop in text, for tests and evaluation.

Environments are named in configs by `REGISTRY` key or as "module:Class" (see `resolve`).
"""

import ast
import importlib
import operator
from collections.abc import Callable
from typing import Any, NamedTuple


class Step(NamedTuple):
    """What the environment returns for one policy turn.

    Attributes:
        observation: text the environment inserts into the context after the turn ("" for none).
        reward: reward of this turn.
        done: True when the episode is over; the policy writes no further turn.
    """

    observation: str
    reward: float
    done: bool


class Episode(NamedTuple):
    """One episode in text, as `run_episode` drives it.

    Attributes:
        segments: the text after the prompt, in order, as (text, is_policy): policy turns are
            True, environment observations False (the reset observation first, when non-empty).
        reward: sum of the rewards of every step.
        turns: number of policy turns.
        hit_turn_limit: True when the episode was ended by max_turns, not by the environment.
    """

    segments: list[tuple[str, bool]]
    reward: float
    turns: int
    hit_turn_limit: bool


class Environment:
    """Base class of an environment: answer each policy turn with a `Step`.

    Attributes:
        stop_strings: strings at which the policy's turn must stop so the environment can answer;
            the turn passed to `step` ends with the stop string. Empty: a turn runs to end-of-sequence.
    """

    stop_strings: tuple[str, ...] = ()

    def reset(self, row: dict) -> str:
        """Starts an episode for the prompt row; returns the first observation, appended after the prompt."""
        return ""

    def step(self, text: str) -> Step:
        """Reads the policy's latest turn; returns the observation to insert, the turn's reward and done."""
        raise NotImplementedError(f"{type(self).__name__} must define step(text) -> Step")


def stop_at(text: str, stop_strings: tuple[str, ...]) -> str:
    """Returns text up to and including its earliest stop string, or text unchanged when none occurs.

    A sampler that decodes a fixed number of tokens overshoots the stop string; cutting here gives
    the turn the environment would have seen had generation stopped there.
    """
    ends = [text.find(stop) + len(stop) for stop in stop_strings if stop in text]
    return text[: min(ends)] if ends else text


def run_episode(env: Environment, row: dict, policy_turn: Callable[[str], str], *, max_turns: int) -> Episode:
    """Drives one episode in text; returns its `Episode`.

    policy_turn receives the episode's text so far after the prompt (the concatenated segments; the
    caller prepends the prompt it rendered from row) and returns the next turn, which is cut at the
    environment's first stop string. Empty observations add no segment. After max_turns policy turns
    without done, the episode ends with hit_turn_limit=True.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be at least 1, got {max_turns}")
    segments = []
    observation = env.reset(row)
    if observation:
        segments.append((observation, False))
    reward = 0.0
    for turn in range(1, max_turns + 1):
        text = stop_at(policy_turn("".join(segment for segment, _ in segments)), env.stop_strings)
        segments.append((text, True))
        step = env.step(text)
        reward += step.reward
        if step.observation:
            segments.append((step.observation, False))
        if step.done:
            return Episode(segments, reward, turn, hit_turn_limit=False)
    return Episode(segments, reward, max_turns, hit_turn_limit=True)


# The calculator's limits: a policy can write 9**9**9, which would hang the host or exhaust memory,
# and GSM8K arithmetic never needs numbers anywhere near these.
MAX_EXPRESSION_CHARS = 256
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e15

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_ALLOWED = "use only numbers, + - * / // % ** and parentheses"


class _Refused(Exception):
    """An expression the calculator will not evaluate; the message follows "error: "."""


def _checked(value: Any) -> int | float:
    """Returns value when it is a real number of magnitude at most MAX_MAGNITUDE, else refuses it."""
    if isinstance(value, complex):  # a negative base to a fractional power
        raise _Refused("complex result")
    # Written as `not <=` so that NaN, which compares false with everything, is refused too.
    if not abs(value) <= MAX_MAGNITUDE:
        raise _Refused(f"magnitude exceeds {MAX_MAGNITUDE:g}")
    return value


def _describe(node: ast.AST) -> str:
    """Returns a short name of a refused syntax node for the error message."""
    if isinstance(node, ast.Name):
        return f"name {node.id!r}"
    if isinstance(node, ast.Constant):
        return f"constant {node.value!r}"
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        return f"operator {type(node.op).__name__}"
    return type(node).__name__


def _evaluate(node: ast.AST) -> int | float:
    """Returns the value of an allowed expression node; every intermediate result is checked."""
    # bool is a subclass of int, but True/False are names to a reader, not numbers.
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise _Refused(f"exponent {right:g} exceeds {MAX_EXPONENT}")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise _Refused("division by zero") from None
        except OverflowError:  # a float power past the float range
            raise _Refused(f"magnitude exceeds {MAX_MAGNITUDE:g}") from None
    raise _Refused(f"{_describe(node)} not allowed; {_ALLOWED}")


def format_number(value: int | float) -> str:
    """Returns value as an integer when it is integral after rounding to 6 decimals, else with up to
    6 decimals and trailing zeros stripped ("24", "2.333333", "0.125"). A non-zero value that would
    round to 0 keeps 6 significant digits in scientific form ("1e-07") rather than read as 0."""
    rounded = round(value, 6)
    if rounded == int(rounded):
        if rounded == 0 and value != 0:
            return f"{value:.6g}"
        return str(int(rounded))
    return f"{value:.6f}".rstrip("0")


def calculate(expression: str) -> str:
    """Returns the value of an arithmetic expression formatted by `format_number`, or "error: ..."
    when it is refused: malformed, too long, using anything beyond numbers, + - * / // % **, unary
    minus/plus and parentheses, dividing by zero, or with an exponent or any result too large.

    The expression is parsed with `ast` and only the allowed nodes are evaluated; nothing is ever
    passed to eval or exec, so names, calls and attribute access cannot run.
    """
    expression = expression.strip()
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError):  # ValueError: a null byte in the text
        return f"error: malformed expression; {_ALLOWED}"
    try:
        return format_number(_evaluate(tree.body))
    except _Refused as refused:
        return f"error: {refused}"


class CalculatorEnv(Environment):
    """A calculator tool for GSM8K-style arithmetic.

    A policy turn that ends with <calc>EXPR</calc> gets the observation <result>VALUE</result>,
    where VALUE is `calculate(EXPR)`: <calc>48/2</calc> -> <result>24</result>, and a refused
    expression gives <result>error: division by zero</result> and the like; done=False, and the
    policy continues after </result>. Any other turn is the answer and ends the episode with reward
    0.0: the answer is scored by the reward functions on the whole completion.
    """

    stop_strings = ("</calc>",)
    call_open, call_close = "<calc>", "</calc>"
    result_open, result_close = "<result>", "</result>"

    def step(self, text: str) -> Step:
        """Returns the result of the turn's trailing calculator call, or done when there is none."""
        text = text.rstrip()
        start = text.rfind(self.call_open, 0, len(text) - len(self.call_close))
        if not text.endswith(self.call_close) or start < 0:
            return Step("", 0.0, True)
        expression = text[start + len(self.call_open) : len(text) - len(self.call_close)]
        return Step(f"{self.result_open}{calculate(expression)}{self.result_close}", 0.0, False)


REGISTRY: dict[str, type[Environment]] = {"calculator": CalculatorEnv}


def resolve(name: str) -> Callable[..., Environment]:
    """Returns the environment class (or factory) named by a `REGISTRY` key or "module:Class".

    "module:Class" imports module and returns its attribute Class, which may also be a function
    returning an Environment; the caller builds the environment with its keyword arguments.
    """
    if ":" not in name:
        if name not in REGISTRY:
            raise ValueError(f"unknown environment {name!r}; choose one of {sorted(REGISTRY)} or give 'module:Class'")
        return REGISTRY[name]
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        # Only the named module (or a parent package) missing is the user's spelling; an import
        # failing inside that module is its own bug and keeps its traceback.
        if error.name is None or not f"{module_name}.".startswith(f"{error.name}."):
            raise
        raise ValueError(
            f"environment {name!r}: cannot import module {module_name!r}; check the spelling or put it on PYTHONPATH"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(
            f"environment {name!r}: module {module_name!r} has no class or function {attribute!r}; "
            "give 'module:Class' naming one defined there"
        )
    return factory
