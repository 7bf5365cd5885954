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
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["DEFAULT_RETRY", "RetryPolicy", "policy_from_args"]

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
