"""Verifiable rewards for GRPO-style RL: functions of (prompt, completion, row fields) -> float, scored in processes.

A reward function follows the convention of trl's `GRPOTrainer(reward_funcs=...)` and tunix's `reward_fns`:

    fn(prompt=str, completion=str, **row_fields) -> float                   one sample
    fn(prompts=[...], completions=[...], **{field: [...]}) -> list[float]   a batch, when marked @batched

Each function receives the pool's prompt(s) and completion(s) and the row fields that its signature names (all of them
if it takes **kwargs); a row field called prompt(s) or completion(s) is not passed, the pool's own text wins. Built-ins
(`REGISTRY`): "gsm8k" (final-number match), "format" (<think>…</think><answer>…</answer>), "length" (a penalty).
A user's function is named `module:function` (`resolve`).

`RewardPool` calls them in worker processes, so a function that hangs is abandoned rather than stalling the run, and
the CPU-bound parsing runs beside the parent's JAX threads. Host-side Python: stdlib and numpy only.
"""

import collections
import dataclasses
import functools
import importlib
import inspect
import math
import multiprocessing
import numbers
import pickle
import re
import reprlib
import signal
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from multiprocessing import connection

import numpy as np

try:  # a second opinion for answers the plain parse cannot read (LaTeX, expressions); optional
    import math_verify as _math_verify
except ImportError:
    _math_verify = None

RewardFunction = Callable[..., float | Sequence[float]]


def batched(fn: RewardFunction) -> RewardFunction:
    """Marks fn as batched: called once per batch with lists (prompts, completions, fields) -> list[float] [N]."""
    fn.batched = True
    return fn


# --- built-in rewards -------------------------------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number in running text: thousands commas, decimals, a fraction; not the digits of a word ("H2O", "x1").
_NUMBER_IN_TEXT = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_LATEX_FRACTION = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{…} (nested braces allowed), None if there is none or it is unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 1, start + len("\\boxed{")
    for end in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[begin:end]
    return None


def _answer_text(text: str) -> str:
    """The part of a reply (or a reference) that states its final answer: the last <answer>…</answer>, else the last
    \\boxed{…}, else the line after the last ####, else the whole text."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1]
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    return text


def _plain_number(text: str) -> Fraction | None:
    """text that is one number once currency, percent, thousands commas, spaces and a trailing period are dropped
    ("$1,234.", "-3/4", "50 %", "\\frac{3}{4}") -> its exact value, else None."""
    text = _LATEX_FRACTION.sub(r"\1/\2", text.replace("\u2212", "-"))
    text = re.sub(r"\\?[$%]|\s|\\!|(?<=\d),(?=\d)", "", text).rstrip(".")
    parts = text.split("/")
    if len(parts) > 2 or not all(_PLAIN_NUMBER.fullmatch(p) for p in parts):
        return None
    value = Fraction(parts[0])
    if len(parts) == 2:
        denominator = Fraction(parts[1])
        if denominator == 0:
            return None
        value /= denominator
    return value


def _final_number(text: str) -> Fraction | None:
    """The value of the final answer in text (see `_answer_text`): the whole answer part if it is one number, else the
    last number in it; None if it holds none."""
    answer = _answer_text(text)
    value = _plain_number(answer)
    if value is None:
        numbers_in_text = _NUMBER_IN_TEXT.findall(answer)
        value = _plain_number(numbers_in_text[-1]) if numbers_in_text else None
    return value


def gsm8k(completion: str, answer: str | float) -> float:
    """1.0 if the completion's final number equals the reference's, else 0.0.

    Args:
        completion: the model's reply. Its answer is the content of the last <answer>…</answer>, else of the last
            \\boxed{…}, else what follows the last ####, else the last number in the text. Tolerates $, %, thousands
            commas, spaces, a trailing period, 72.0 for 72, negative numbers, and fractions (3/4, \\frac{3}{4}) that
            equal the reference.
        answer: the row's reference: a GSM8K worked solution ending in "#### 72", or a bare number.

    An integer reference must be matched exactly, any other within a relative 1e-6. When either side holds no number,
    math_verify (if installed) decides.
    """
    reference_text = _answer_text(str(answer))
    reference, reply = _final_number(reference_text), _final_number(completion)
    if reference is None or reply is None:
        if _math_verify is None:
            return 0.0
        return float(
            _math_verify.verify(_math_verify.parse(reference_text), _math_verify.parse(_answer_text(completion)))
        )
    if reference.denominator == 1:
        return float(reply == reference)
    return float(abs(reply - reference) <= 1e-6 * abs(reference))


THINK_ANSWER = r"<think>(?:(?!</think>).)*</think>\s*<answer>(?:(?!</answer>).)*</answer>"


def think_format(completion: str, *, pattern: str = THINK_ANSWER) -> float:
    """1.0 if the completion, less surrounding whitespace, fullmatches pattern (re.DOTALL), else 0.0.

    The default asks for <think>…</think> then <answer>…</answer> and nothing else, each closed once; bind another
    regex with functools.partial(think_format, pattern=...).
    """
    return float(re.fullmatch(pattern, completion.strip(), re.DOTALL) is not None)


def length_penalty(completion: str, *, max_chars: int = 1000) -> float:
    """-(characters beyond max_chars) / max_chars, clipped at -1: 0.0 up to max_chars, -1.0 from 2 * max_chars."""
    return max(-1.0, -max(0, len(completion) - max_chars) / max_chars)


REGISTRY: dict[str, RewardFunction] = {"gsm8k": gsm8k, "format": think_format, "length": length_penalty}


def resolve(spec: str) -> RewardFunction:
    """A built-in name from REGISTRY, or "module:function" imported from the user's code -> the function."""
    if spec in REGISTRY:
        return REGISTRY[spec]
    module_name, colon, attribute = spec.partition(":")
    if not colon:
        raise ValueError(
            f"unknown reward function {spec!r}: name a built-in ({', '.join(REGISTRY)}) or module:function"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"reward function {spec!r}: cannot import module {module_name!r} ({error}); "
            "put the folder that holds it on PYTHONPATH"
        ) from None
    if not hasattr(module, attribute):
        raise ValueError(
            f"reward function {spec!r}: module {module_name!r} ({module.__file__}) has no attribute {attribute!r}; "
            "define it there or name one that exists"
        )
    fn = getattr(module, attribute)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def resolve_all(names: str, weights: str = "") -> tuple[dict[str, RewardFunction], list[float]]:
    """ "gsm8k,format" and "1.0,0.5" (empty: every weight 1.0) -> ({name: function}, weights), in the order given."""
    specs = [s.strip() for s in names.split(",") if s.strip()]
    if not specs:
        raise ValueError("no reward functions named: give one or more comma-separated names")
    duplicates = sorted({s for s in specs if specs.count(s) > 1})
    if duplicates:
        raise ValueError(f"reward functions named twice: {', '.join(duplicates)}; give each once and weight it")
    if not weights.strip():
        return {s: resolve(s) for s in specs}, [1.0] * len(specs)
    texts = [w.strip() for w in weights.split(",")]
    if len(texts) != len(specs):
        raise ValueError(f"{len(texts)} reward weights ({weights!r}) for {len(specs)} reward functions ({names!r})")
    try:
        values = [float(w) for w in texts]
    except ValueError:
        raise ValueError(f"reward weights {weights!r} are not comma-separated numbers") from None
    return {s: resolve(s) for s in specs}, values


def _unwrapped(fn: RewardFunction) -> RewardFunction:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def reward_name(fn: RewardFunction) -> str:
    """The name metrics use for fn: its __name__ (through functools.partial), else its class's."""
    fn = _unwrapped(fn)
    return getattr(fn, "__name__", type(fn).__name__)


# --- the worker side ----------------------------------------------------------------------------------------------

_GO = "go"  # a worker has loaded the job's function; the clock of its first call starts


def _raise(error: Exception, **_) -> None:
    raise error


def _checked(value) -> tuple[float, str | None]:
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value), None
    return 0.0, f"returned {reprlib.repr(value)} ({type(value).__name__}), not a finite number"


def _call(fn: RewardFunction, kwargs: dict, as_batch: bool, n: int) -> list[tuple[float, str | None]]:
    """One call -> n (reward, error text or None) pairs; n is 1 unless batched."""
    try:
        out = fn(**kwargs)
    except Exception:
        return [(0.0, traceback.format_exc())] * n
    if not as_batch:
        return [_checked(out)]
    if not isinstance(out, Sequence | np.ndarray) or len(out) != n:
        return [(0.0, f"returned {reprlib.repr(out)}, not a list of {n} rewards (one per completion)")] * n
    return [_checked(v) for v in out]


def _serve(conn: connection.Connection) -> None:
    """A worker's loop: jobs (pickled function, batched, calls) in; _GO, then one message of pairs per call, out."""
    # Ctrl-C reaches the whole process group; the parent decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent is gone
            return
        if job is None:
            return
        blob, as_batch, calls = job
        try:
            fn = pickle.loads(blob)
        except Exception as error:  # a module the worker cannot import: every call reports it
            fn = functools.partial(_raise, error)
        conn.send(_GO)
        for kwargs, n in calls:
            conn.send(_call(fn, kwargs, as_batch, n))


# --- the pool -----------------------------------------------------------------------------------------------------

# A worker may take this long to start and to import a job's function before its first call's clock starts.
_START_S = 60.0


@dataclasses.dataclass(frozen=True)
class Scores:
    """The rewards of one batch of N completions from F functions.

    Attributes:
        names: the F function names, in order.
        total: [N] float32, the weighted sum over the functions.
        per_function: [F, N] float32, each function's rewards (0 where it failed).
        failures: name -> samples of this batch scored 0 because the function raised, passed the timeout, or
            returned NaN, inf or something other than a number.
    """

    names: tuple[str, ...]
    total: np.ndarray
    per_function: np.ndarray
    failures: dict[str, int]


class RewardFunctionError(RuntimeError):
    """A reward function failed on every sample of a batch: a bug rather than a bad completion, so the run stops.

    Attributes:
        name: the function's name.
        traceback: the text of its first failure.
    """

    def __init__(self, name: str, traceback_text: str, samples: int):
        super().__init__(
            f"reward function {name!r} failed on all {samples} samples of a batch; the first failure:\n{traceback_text}"
        )
        self.name = name
        self.traceback = traceback_text


@dataclasses.dataclass(frozen=True)
class _Function:
    """What the pool knows of one function: fields it takes (None: all, **kwargs) and requires, pickled once."""

    name: str
    blob: bytes
    batched: bool
    takes: frozenset[str] | None
    requires: frozenset[str]

    @classmethod
    def of(cls, name: str, fn: RewardFunction) -> "_Function":
        try:
            blob = pickle.dumps(fn)
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise ValueError(
                f"reward function {name!r} cannot be sent to the reward worker processes ({error}): define it at "
                "module level (name it module:function) and bind settings with functools.partial, not a lambda "
                "or a nested function"
            ) from None
        # A partial's bound keywords are settings, not fields: a row field of that name must not override them.
        bound = set(fn.keywords) if isinstance(fn, functools.partial) else set()
        params = [p for p in inspect.signature(fn).parameters.values() if p.name not in bound]
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        return cls(
            name=name,
            blob=blob,
            batched=getattr(_unwrapped(fn), "batched", False),
            takes=None if any(p.kind == p.VAR_KEYWORD for p in params) else frozenset(p.name for p in named),
            requires=frozenset(p.name for p in named if p.default is p.empty),
        )

    @property
    def texts(self) -> tuple[str, str]:
        return ("prompts", "completions") if self.batched else ("prompt", "completion")

    def kwargs(self, prompt, completion, fields: dict) -> dict:
        """The call's keyword arguments: the texts and the row fields the function takes."""
        given = {k: v for k, v in fields.items() if k not in self.texts}
        given.update(zip(self.texts, (prompt, completion), strict=True))
        return given if self.takes is None else {k: v for k, v in given.items() if k in self.takes}


def _refuse_missing_fields(specs: Iterable["_Function"], fields: Iterable[str]) -> None:
    fields = set(fields)
    for fn in specs:
        missing = sorted(fn.requires - set(fn.texts) - fields)
        if missing:
            raise ValueError(
                f"reward function {fn.name!r} takes the row field(s) {', '.join(map(repr, missing))}, which the "
                f"rows lack; they have: {', '.join(sorted(fields)) or 'no fields'}"
            )


def check_fields(functions: Mapping[str, RewardFunction], fields: Iterable[str]) -> None:
    """Raises ValueError if a function ({name: function}) requires a row field `fields` lacks: at set-up, before
    generating."""
    _refuse_missing_fields([_Function.of(name, fn) for name, fn in functions.items()], fields)


@dataclasses.dataclass
class _Job:
    """Calls of one function on some samples of the batch, as one worker runs them in order."""

    function: int
    indices: list[int]  # the samples, in call order (one call for them all if batched)
    calls: list[tuple[dict, int]]  # (kwargs, samples it scores)
    batched: bool


@dataclasses.dataclass
class _Running:
    job: _Job
    deadline: float
    done: int = 0  # samples of job.indices scored so far
    started: bool = False  # the worker has loaded the function (sent _GO)


class _Tally:
    """One batch's results: values [F, N], failed [F, N], and each function's first error that was not a timeout."""

    def __init__(self, functions: int, n: int):
        self.values = np.zeros((functions, n), np.float32)
        self.failed = np.zeros((functions, n), bool)
        self.first_error: dict[int, str] = {}

    def record(self, f: int, indices: list[int], results: list[tuple[float, str | None]], *, timeout=False) -> None:
        for i, (value, error) in zip(indices, results, strict=True):
            self.values[f, i] = value
            if error is not None:
                self.failed[f, i] = True
                if not timeout:
                    self.first_error.setdefault(f, error)


class _Worker:
    """One worker process running `_serve`, and the parent's end of its pipe."""

    def __init__(self, context: multiprocessing.context.BaseContext):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), name="lmzoo-reward", daemon=True)
        self.process.start()
        child.close()

    def stop(self, *, kill: bool) -> int | None:
        """Asks the worker to finish (or kills it: hung, or dead already), waits for it -> its exit code."""
        if not kill:
            try:
                self.conn.send(None)
                self.process.join(timeout=5.0)
            except OSError:  # it is already gone
                pass
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()
        return self.process.exitcode


class RewardPool:
    """Reward functions scored in parallel worker processes, with a per-call timeout.

    The workers are started once (multiprocessing "forkserver", or "spawn" where that is missing; never "fork", whose
    child would inherit the parent's JAX threads mid-flight) and reused across batches.

    Dispatch: per-sample functions go out as one job per worker per function (N / workers samples), so a batch costs
    a few IPC round trips, not N. The worker sends each sample's result back as soon as it has it, so the parent
    knows which sample is running and since when: a sample that passes timeout_s scores 0 and is counted; its worker
    is killed and replaced at once (no hung worker outlives its batch, whatever the function is stuck in, C code
    included), and the job's remaining samples go to the front of the queue. One hung sample costs only itself.
    A batched function is one call for the batch: a timeout scores the whole batch 0, every sample counted.

    A function that raises or returns a bad value on some samples scores them 0, counted in Scores.failures, and
    the batch goes on; one that fails on every sample (at least one failure not a timeout) raises
    RewardFunctionError with its first traceback.

    Args:
        functions: {name: function} (as `resolve_all` returns), or functions named by `reward_name`. Each must be
            picklable: a built-in, a module-level function, or functools.partial of one.
        weights: one per function, for Scores.total.
        timeout_s: seconds a per-sample call (or a batched function's one call) may take.
        workers: worker processes.

    Attributes:
        names: the F function names, the order of Scores.per_function.
    """

    def __init__(
        self,
        functions: Mapping[str, RewardFunction] | Sequence[RewardFunction],
        weights: Sequence[float],
        *,
        timeout_s: float = 10.0,
        workers: int = 2,
    ):
        named = list(functions.items()) if isinstance(functions, Mapping) else [(reward_name(f), f) for f in functions]
        names = [n for n, _ in named]
        if not named:
            raise ValueError("RewardPool needs at least one reward function")
        if len(set(names)) != len(names):
            raise ValueError(f"reward functions share a name ({names}); pass {{name: function}} to tell them apart")
        if len(weights) != len(named):
            raise ValueError(f"{len(weights)} reward weights for {len(named)} reward functions ({', '.join(names)})")
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"RewardPool needs workers >= 1 and timeout_s > 0, not {workers} and {timeout_s}")
        self.names = tuple(names)
        self._functions = [_Function.of(n, f) for n, f in named]
        self._weights = np.asarray(weights, np.float32)
        self._timeout_s = timeout_s
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        self._context = multiprocessing.get_context(method)
        self._workers = [_Worker(self._context) for _ in range(workers)]

    def check_fields(self, fields: Iterable[str]) -> None:
        """Raises ValueError if a function requires a field the rows lack; call it at set-up, before generating."""
        _refuse_missing_fields(self._functions, fields)

    def score(self, prompts: Sequence[str], completions: Sequence[str], rows: Sequence[dict]) -> Scores:
        """N prompts, completions and their dataset rows -> Scores (total [N], per_function [F, N], failures)."""
        n = len(completions)
        if len(prompts) != n or len(rows) != n:
            raise ValueError(
                f"{len(prompts)} prompts, {n} completions and {len(rows)} rows: give one of each per sample"
            )
        if not self._workers:
            raise RuntimeError("this RewardPool is closed")
        fields = set.intersection(*(set(r) for r in rows)) if rows else set()
        self.check_fields(fields)
        jobs: collections.deque[_Job] = collections.deque()
        chunk = max(1, -(-n // len(self._workers)))
        for f, fn in enumerate(self._functions):
            if fn.batched and n:
                columns = {k: [r[k] for r in rows] for k in fields}
                jobs.append(_Job(f, list(range(n)), [(fn.kwargs(list(prompts), list(completions), columns), n)], True))
            elif not fn.batched:
                for start in range(0, n, chunk):
                    indices = list(range(start, min(n, start + chunk)))
                    calls = [(fn.kwargs(prompts[i], completions[i], rows[i]), 1) for i in indices]
                    jobs.append(_Job(f, indices, calls, False))
        tally = _Tally(len(self._functions), n)
        self._run(jobs, tally)
        for f, fn in enumerate(self._functions):
            if n and tally.failed[f].all() and f in tally.first_error:
                raise RewardFunctionError(fn.name, tally.first_error[f], n)
        return Scores(
            names=self.names,
            total=self._weights @ tally.values,
            per_function=tally.values,
            failures={fn.name: int(tally.failed[f].sum()) for f, fn in enumerate(self._functions)},
        )

    def _run(self, jobs: collections.deque[_Job], tally: _Tally) -> None:
        """Runs the jobs on the workers into tally; a call that hangs or kills its worker scores 0."""
        running: dict[int, _Running] = {}  # worker slot -> its job
        while jobs or running:
            for slot, worker in enumerate(self._workers):
                if slot not in running and jobs:
                    job = jobs.popleft()
                    if not worker.process.is_alive():  # died between batches (killed from outside, out of memory)
                        worker.stop(kill=True)
                        worker = self._workers[slot] = _Worker(self._context)
                    worker.conn.send((self._functions[job.function].blob, job.batched, job.calls))
                    running[slot] = _Running(job, time.monotonic() + _START_S)
            slots = {self._workers[s].conn: s for s in running}
            wait_s = max(0.0, min(r.deadline for r in running.values()) - time.monotonic())
            for conn in connection.wait(list(slots), timeout=wait_s):
                slot = slots[conn]
                run = running[slot]
                try:
                    while conn.poll():
                        message = conn.recv()
                        run.deadline = time.monotonic() + self._timeout_s
                        if message == _GO:
                            run.started = True
                        else:
                            tally.record(run.job.function, run.job.indices[run.done : run.done + len(message)], message)
                            run.done += len(message)
                except (EOFError, OSError):
                    self._abandon(slot, run, jobs, tally, timeout=False)
                    del running[slot]
                    continue
                if run.done == len(run.job.indices):
                    del running[slot]
            now = time.monotonic()
            for slot, run in list(running.items()):
                if run.deadline <= now:
                    self._abandon(slot, run, jobs, tally, timeout=True)
                    del running[slot]

    def _abandon(
        self, slot: int, run: _Running, jobs: collections.deque[_Job], tally: _Tally, *, timeout: bool
    ) -> None:
        """Kills slot's worker (hung, or dead already) and starts another. The sample it was on scores 0 and the
        job's later samples go to the front of the queue; the whole job scores 0 if it is batched or never started
        (a worker that cannot start or load the function would fail each sample the same way, slowly)."""
        code = self._workers[slot].stop(kill=True)
        self._workers[slot] = _Worker(self._context)
        if timeout:
            reason = f"passed the {self._timeout_s} s reward timeout"
        elif run.started:
            reason = f"the reward worker process died (exit code {code}) while scoring this sample"
        else:
            reason = (
                f"the reward worker process died while starting (exit code {code}); its traceback is on stderr "
                "(a script that makes a RewardPool must guard its top level with if __name__ == '__main__')"
            )
        job, remaining = run.job, run.job.indices[run.done :]
        lost = remaining[:1] if run.started and not job.batched else remaining
        tally.record(job.function, lost, [(0.0, reason)] * len(lost), timeout=timeout)
        if len(lost) < len(remaining):
            jobs.appendleft(_Job(job.function, remaining[1:], job.calls[run.done + 1 :], False))

    def close(self) -> None:
        """Stops the workers; the pool cannot score afterwards."""
        for worker in self._workers:
            worker.stop(kill=False)
        self._workers = []

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
