"""Reward functions of a dataset task: ``exact``, ``number``, ``math`` and a user's ``module:function``.

A reward maps (prompt text, completion text, reference answer) to a `Score`: a reward in [0, 1] and
whether the completion is correct (what held-out evaluation counts). Rewards run on the trainer only:
workers never see answers.

- ``exact``: 1 when the completion, stripped, is the answer (stripped); else 0.
- ``number``: 1 when the completion's last number equals the answer's (integers, decimals and
  fractions ``a/b``, compared as exact rationals: ``3`` = ``3.0``, ``1/2`` = ``0.5``).
- ``math``: math-verify parses the answer (as ``\\boxed{answer}`` unless it has its own ``$`` or
  ``\\boxed``) and the completion's last `MATH_TAIL_CHARS` characters, and checks numeric or symbolic
  equivalence.
- ``module:function``: ``fn(prompt: str, completion: str, answer: str) -> float`` in [0, 1], loaded
  when the task is made (``aurora topology check`` and the trainer's start): from ``REWARD_DIR/module.py``
  when that file exists (``REWARD_DIR`` on the module path only while it loads), else as an installed
  module. Correct means a reward of 1.

``math`` and a user's function run in a worker process of their own (`Isolated`), one call at a time,
each within ``timeout_s``: sympy can take minutes or all memory on an 18-character reply
(``\\boxed{9^{9^{9}}}``), and a user's function may loop, exit or crash. A call that raises, exits,
times out (the worker is killed and started again) or returns anything but a real number in [0, 1]
scores 0, is counted (`GuardedReward.errors`) and logged, throttled — never a stalled or crashed
trainer.

Invariant: a `GuardedReward` returns a `Score` for every input, within about ``timeout_s``.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import numbers
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Any

import structlog

from aurora.errors import ConfigError
from aurora.events import REWARD_FAILED
from aurora.logs import Throttle
from aurora.rl.imports import import_beside

log = structlog.get_logger("aurora.rl.rewards")

MATH_TAIL_CHARS = 2000
TIMEOUT_S = 5.0
"""The default time a reward call may take in its worker process."""
STARTUP_S = 60.0
"""How long a worker process may take to start and load its reward (sympy alone takes seconds)."""


@dataclass(frozen=True, slots=True)
class Score:
    reward: float
    correct: bool


RewardFn = Callable[[str, str, str], Score]
"""(prompt, completion, answer) -> Score."""


def exact(prompt: str, completion: str, answer: str) -> Score:
    ok = completion.strip() == answer.strip()
    return Score(float(ok), ok)


_VALUE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d[\d,]*)?")


def last_value(text: str) -> Fraction | None:
    """The last number in ``text`` (an integer, a decimal or a fraction ``a/b``; thousands separators
    dropped) as an exact rational; None when there is none (or a fraction over zero)."""
    found = _VALUE.findall(text)
    if not found:
        return None
    num, _, den = found[-1].replace(",", "").partition("/")
    try:
        return Fraction(num) / Fraction(den or 1)
    except (ValueError, ZeroDivisionError):
        return None


def number(prompt: str, completion: str, answer: str) -> Score:
    got, want = last_value(completion), last_value(answer)
    ok = got is not None and got == want
    return Score(float(ok), ok)


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError:  # pragma: no cover - a declared dependency
        raise ConfigError("the math reward needs math-verify (pip install math-verify)", path="task.reward") from None
    # it warns on every call that its own timeouts are off (they use SIGALRM, for the main thread only;
    # the worker process's timeout replaces them)
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


@lru_cache(maxsize=4096)
def _gold(answer: str) -> Any:
    mv = _math_verify()
    if "$" in answer or "\\boxed" in answer:
        return mv.parse(answer, parsing_timeout=None)
    return mv.parse(f"\\boxed{{{answer}}}", parsing_timeout=None) or mv.parse(answer, parsing_timeout=None)


def math_answer(prompt: str, completion: str, answer: str) -> Score:
    mv = _math_verify()
    gold = _gold(answer)
    pred = mv.parse(completion[-MATH_TAIL_CHARS:], parsing_timeout=None)
    ok = bool(gold) and bool(pred) and bool(mv.verify(gold, pred, timeout_seconds=None))
    return Score(float(ok), ok)


BUILT_IN: dict[str, RewardFn] = {"exact": exact, "number": number, "math": math_answer}


def load_function(ref: str, reward_dir: str | None) -> Callable[..., Any]:
    """The function ``module:function`` names, checked to take (prompt, completion, answer); raises
    `ConfigError` naming it."""
    mod_name, _, fn_name = ref.partition(":")
    try:
        mod = import_beside(mod_name, reward_dir, "aurora_reward")
    except BaseException as e:  # a user's module may raise anything while it loads, exit() included
        if isinstance(e, KeyboardInterrupt):
            raise
        where = f" (looked in {reward_dir} first)" if reward_dir else ""
        raise ConfigError(
            f"reward {ref!r}: module {mod_name!r} does not load: {e!r}{where}", path="task.reward"
        ) from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"reward {ref!r}: {mod_name} has no function {fn_name!r}", path="task.reward")
    if inspect.iscoroutinefunction(fn):
        raise ConfigError(f"reward {ref!r}: must be a plain function, not async", path="task.reward")
    try:
        inspect.signature(fn).bind("prompt", "completion", "answer")
    except TypeError:
        raise ConfigError(
            f"reward {ref!r}: must take (prompt, completion, answer), not {inspect.signature(fn)}", path="task.reward"
        ) from None
    except ValueError:
        pass  # no signature to read (a builtin): it is called as it is
    return fn  # type: ignore[no-any-return]


def user(fn: Callable[..., Any]) -> RewardFn:
    """A user's function as a `RewardFn`: its value checked to be a real number in [0, 1]."""

    def call(prompt: str, completion: str, answer: str) -> Score:
        r = fn(prompt, completion, answer)
        if isinstance(r, bool | str) or not (isinstance(r, numbers.Real) or hasattr(r, "__float__")):
            raise ValueError(f"returned {r!r:.100}, not a number in [0, 1]")
        v = float(r)
        if not 0.0 <= v <= 1.0:  # NaN fails this too
            raise ValueError(f"returned {v!r}, not a number in [0, 1]")
        return Score(v, v >= 1.0)

    return call


def resolve(ref: str, reward_dir: str | None) -> RewardFn:
    """The plain function behind ``ref`` (in this process; no guard, no worker)."""
    if ref in BUILT_IN:
        return BUILT_IN[ref]
    return user(load_function(ref, reward_dir))


def _serve(conn: Any, ref: str, reward_dir: str | None) -> None:
    """The worker process: score each (prompt, completion, answer) that arrives, one at a time."""
    try:
        fn = resolve(ref, reward_dir)
    except BaseException as e:  # noqa: BLE001
        conn.send(("err", f"cannot load: {e!r}"[:300]))
        return
    conn.send(("ready",))
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            s = fn(*args)
            conn.send(("ok", s.reward, s.correct))
        except BaseException as e:  # noqa: BLE001  (exit() included: the worker answers and goes on)
            conn.send(("err", repr(e)[:300]))


class Isolated:
    """A reward run in a worker process (see the module docstring): started on the first call, killed
    and started again after a call that times out or kills it. One caller at a time."""

    def __init__(self, ref: str, reward_dir: str | None, timeout_s: float = TIMEOUT_S) -> None:
        self.ref, self.reward_dir, self.timeout_s = ref, reward_dir, timeout_s
        self._proc: Any = None
        self._conn: Any = None

    def _start(self) -> None:
        """Start the worker and wait (at most `STARTUP_S`) until it has loaded the reward."""
        ctx = multiprocessing.get_context("spawn")  # the trainer has threads: no fork
        ours, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(theirs, self.ref, self.reward_dir), daemon=True)
        self._proc.start()
        theirs.close()
        self._conn = ours
        if not ours.poll(STARTUP_S):
            self.stop()
            raise TimeoutError(f"its worker process did not load the reward within {STARTUP_S:g} s")
        got = ours.recv()
        if got[0] != "ready":
            self.stop()
            raise RuntimeError(got[1])

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None

    def __call__(self, prompt: str, completion: str, answer: str) -> Score:
        try:
            if self._proc is None or not self._proc.is_alive():
                self.stop()
                self._start()
            self._conn.send((prompt, completion, answer))
            if not self._conn.poll(self.timeout_s):
                self.stop()
                raise TimeoutError(f"took more than {self.timeout_s:g} s (its worker was stopped)")
            got = self._conn.recv()
        except (EOFError, OSError) as e:
            self.stop()
            raise RuntimeError(f"its worker process ended ({e!r})") from None
        if got[0] != "ok":
            raise RuntimeError(got[1])
        return Score(float(got[1]), bool(got[2]))


@dataclass
class GuardedReward:
    """A reward that never raises: a failing call scores 0 and is counted and logged (throttled)."""

    name: str
    fn: RewardFn
    errors: int = 0
    throttle: Throttle = field(default_factory=Throttle)

    def __call__(self, prompt: str, completion: str, answer: str) -> Score:
        try:
            return self.fn(prompt, completion, answer)
        except Exception as e:  # noqa: BLE001  (in-process rewards are ours; a worker's errors come back as these)
            self.errors += 1
            suppressed = self.throttle.allow(self.name, time.monotonic())
            if suppressed is not None:
                log.warning(
                    REWARD_FAILED, reward=self.name, error=repr(e)[:300], errors=self.errors, suppressed=suppressed
                )
            return Score(0.0, False)


def make_reward(ref: str, reward_dir: str | None = None, timeout_s: float = TIMEOUT_S) -> GuardedReward:
    """The reward ``ref`` names (see the module docstring); raises `ConfigError` for one that cannot be
    made (a user's function is loaded here once, to check it, and again in its worker)."""
    if ref in ("exact", "number"):
        return GuardedReward(ref, BUILT_IN[ref])
    if ref == "math":
        _math_verify()
    else:
        load_function(ref, reward_dir)
    return GuardedReward(ref, Isolated(ref, reward_dir, timeout_s))
