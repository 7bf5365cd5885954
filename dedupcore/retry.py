"""One retry policy: how many times to try again, and how long to wait before each try.

:class:`RetryPolicy` is what :class:`dedupcore.Client` and
:class:`dedupcore.aio.Client` use to reconnect to the daemon, and what the
broker wrappers (:mod:`dedupcore.integrations`) use to retry a completion
the store could not take. The waits grow exponentially: the n-th wait
(counting from 0) is ``min(cap, initial * multiplier ** n)``, shortened by a
random part of at most ``jitter`` of itself, so that many clients that lost
the same daemon at the same moment do not all come back in the same
instant. ``attempts`` is the number of *retries* (waits), not counting the
first try.

The default (:data:`DEFAULT_RETRY`): 5 retries, 0.05 s doubling up to 1 s,
10 % jitter. The cap is 1 s for every user: the daemon is a local process
whose restart takes well under a second, so a longer wait only delays the
recovery (docs/conveniences.md, "Retries").

Calls are retried by :meth:`RetryPolicy.call` (sync) and
:meth:`RetryPolicy.acall` (asyncio); both take the sleep function, so tests
pass a fake clock.

:class:`Deadline` is the other half: one time limit for a whole call of a
remote authority (docs/timeouts.md). It is taken when the public call
starts; every attempt in it (a connect, a send, each reply, a retry's
backoff sleep, a reconnect) gets the time left instead of a fresh full
timeout, and a retry starts only while at least :data:`RETRY_FLOOR` of the
timeout is left. :func:`deadline_scope` makes it the current one of the
thread (a context variable), so the drivers' hooks deep inside a call
(redis-py's connections, the SQL watchdog) see the same deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

__all__ = [
    "DEFAULT_RETRY",
    "RETRY_FLOOR",
    "Deadline",
    "RetryPolicy",
    "current_deadline",
    "deadline_scope",
    "one_call",
    "policy_from_args",
]

T = TypeVar("T")

#: The most retries a policy may ask for (a bound against a mistyped huge number).
MAX_ATTEMPTS = 1_000_000


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries with capped exponential backoff and jitter (see the module docstring).

    - ``attempts``: retries after the first try (0: try once);
    - ``initial``: the first wait, in seconds (> 0);
    - ``cap``: the longest wait (>= ``initial``);
    - ``multiplier``: each wait is this many times the one before (>= 1);
    - ``jitter``: 0..1, the largest part of a wait that is randomly cut off
      (0: exact waits; 0.1: each wait is 90..100 % of its nominal value).
    """

    attempts: int = 5
    initial: float = 0.05
    cap: float = 1.0
    multiplier: float = 2.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise TypeError(f"attempts must be an int, not {type(self.attempts).__name__}")
        if not 0 <= self.attempts <= MAX_ATTEMPTS:
            raise ValueError(f"attempts must be in 0..{MAX_ATTEMPTS}, got {self.attempts}")
        initial = _number("initial", self.initial)
        cap = _number("cap", self.cap)
        multiplier = _number("multiplier", self.multiplier)
        jitter = _number("jitter", self.jitter)
        if not initial > 0:
            raise ValueError(f"initial must be > 0 seconds, got {initial}")
        if cap < initial:
            raise ValueError(f"cap ({cap}) must be >= initial ({initial})")
        if multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {multiplier}")
        if not 0 <= jitter <= 1:
            raise ValueError(f"jitter must be in 0..1, got {jitter}")

    def nominal(self, n: int) -> float:
        """The n-th wait (from 0) before jitter: ``min(cap, initial * multiplier ** n)``."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if self.multiplier == 1 or self.initial >= self.cap:
            return min(self.initial, self.cap)
        # Past the wait that reaches the cap, the cap (a large n must not overflow).
        if n >= math.log(self.cap / self.initial) / math.log(self.multiplier):
            return self.cap
        return min(self.cap, self.initial * self.multiplier**n)

    def delay(self, n: int, rand: Callable[[], float] = random.random) -> float:
        """The n-th wait (from 0) with its jitter; ``rand()`` is uniform in [0, 1)."""
        return self.nominal(n) * (1.0 - self.jitter * rand())

    def delays(self, rand: Callable[[], float] = random.random) -> Iterator[float]:
        """The ``attempts`` waits of one retried operation, in order."""
        for n in range(self.attempts):
            yield self.delay(n, rand)

    def call(
        self,
        fn: Callable[[], T],
        *,
        retry_on: type[BaseException] | tuple[type[BaseException], ...],
        sleep: Callable[[float], object] = time.sleep,
        rand: Callable[[], float] = random.random,
    ) -> T:
        """``fn()``, tried again after each wait while it raises ``retry_on``.

        The last failure is re-raised once the retries are used up; any
        other exception is raised at once.
        """
        waits = self.delays(rand)
        while True:
            try:
                return fn()
            except retry_on:
                wait = next(waits, None)
                if wait is None:
                    raise
            sleep(wait)

    async def acall(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        retry_on: type[BaseException] | tuple[type[BaseException], ...],
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> T:
        """:meth:`call` for a coroutine function: ``await fn()``, waits with ``await sleep``."""
        waits = self.delays(rand)
        while True:
            try:
                return await fn()
            except retry_on:
                wait = next(waits, None)
                if wait is None:
                    raise
            await sleep(wait)


#: 5 retries, 0.05 s doubling up to 1 s, 10 % jitter.
DEFAULT_RETRY = RetryPolicy()


def policy_from_args(
    retry: RetryPolicy | None,
    *,
    retries: int | None = None,
    backoff: float | None = None,
    retries_name: str = "retries",
) -> RetryPolicy:
    """The policy of a constructor taking ``retry=`` or the shorthands ``retries=``, ``backoff=``.

    ``retries`` is ``attempts`` and ``backoff`` is ``initial`` of the default
    policy; giving ``retry`` together with a shorthand is a TypeError.
    """
    if retry is not None:
        if not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, not {type(retry).__name__}")
        if retries is not None or backoff is not None:
            raise TypeError(f"give retry= or {retries_name}=/backoff=, not both")
        return retry
    if retries is None and backoff is None:
        return DEFAULT_RETRY
    attempts = DEFAULT_RETRY.attempts if retries is None else retries
    initial = DEFAULT_RETRY.initial if backoff is None else backoff
    if isinstance(initial, (int, float)) and not isinstance(initial, bool):
        cap = max(DEFAULT_RETRY.cap, float(initial))  # a first wait above 1 s stays as given
    else:
        cap = DEFAULT_RETRY.cap  # the policy names the wrong type
    return RetryPolicy(attempts=attempts, initial=initial, cap=cap)


# -- one deadline per call ---------------------------------------------------------------

#: A retry starts only while at least this share of the call's timeout is left
#: (after its backoff sleep): less is too short for a connect and a reply.
RETRY_FLOOR = 0.1


class Deadline:
    """The time limit of one call: ``timeout`` seconds from its start on ``clock``.

    Each attempt asks :meth:`budget` for its wait (connect, send, one reply)
    and a retry asks :meth:`retry_wait` for its backoff sleep; neither ever
    gives more than the time left (docs/timeouts.md).
    """

    __slots__ = ("_clock", "at", "timeout")

    def __init__(self, timeout: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        timeout = _number("timeout", timeout)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self._clock = clock
        #: When the call must have ended, on ``clock``.
        self.at = clock() + timeout

    def left(self) -> float:
        """Seconds until the deadline (0.0 once it has passed)."""
        return max(0.0, self.at - self._clock())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.at - self._clock() <= 0.0

    def budget(self, cap: float | None = None) -> float:
        """The longest the next wait may take: the time left, at most ``cap`` (None: no cap).

        0.0 means no time is left: the caller fails the attempt instead of waiting
        (0 would make a socket non-blocking, not a wait of no time).
        """
        left = self.left()
        return left if cap is None else min(left, max(0.0, cap))

    def retry_wait(self, backoff: float) -> float | None:
        """The sleep before a retry, or None when no retry is to start.

        A retry needs :data:`RETRY_FLOOR` of the timeout left once it starts:
        with less left, None. Otherwise the ``backoff`` sleep, cut so that the
        floor is still left after it.
        """
        floor = self.timeout * RETRY_FLOOR
        left = self.left()
        if left < floor:
            return None
        return min(max(0.0, backoff), left - floor)

    def __repr__(self) -> str:
        return f"Deadline(timeout={self.timeout}, left={self.left():.3f})"


_CURRENT: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar(
    "dedupcore_deadline", default=None
)


def current_deadline() -> Deadline | None:
    """The deadline of the call this thread (or task) is in, if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def deadline_scope(
    timeout: float | None, *, clock: Callable[[], float] = time.monotonic
) -> Iterator[Deadline | None]:
    """Runs the block as one call with a deadline ``timeout`` s from now (None: no deadline).

    A call inside another call keeps the earlier of the two deadlines: an
    inner call never extends the outer one's time.
    """
    outer = _CURRENT.get()
    if timeout is None:
        yield outer
        return
    mine = Deadline(timeout, clock=clock)
    if outer is not None and outer.at <= mine.at:
        yield outer
        return
    token = _CURRENT.set(mine)
    try:
        yield mine
    finally:
        _CURRENT.reset(token)


P = ParamSpec("P")
R = TypeVar("R")


def one_call(method: Callable[P, R]) -> Callable[P, R]:
    """Runs a store's method as one call under its deadline (the store's ``timeout``).

    The store's ``timeout`` attribute is seconds or None (no deadline).
    """

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        timeout: Any = getattr(args[0], "timeout", None)
        with deadline_scope(timeout):
            return method(*args, **kwargs)

    return call
