"""Waiting on keys another owner holds: ``claim(..., wait=seconds)``, written once for
the sync and the async API (docs/conveniences.md, "Waiting for the first attempt").

A claim answered IN_PROGRESS is asked again when its key changes, until it
is answered otherwise or ``wait`` seconds have passed: DUPLICATE with the
first attempt's result once it completed, NEW once it was released or its
lease ran out, and IN_PROGRESS when the time is up. How a store learns that
a key changed is its ``_wait_change`` primitive: the embedded store and the
memory table wake their waiters when a key changes or a lease runs out; a
store without a notification asks again after a backoff.
"""

from __future__ import annotations

import math
import random
import time

from dedupcore.api.answers import Claim, Outcome
from dedupcore.api.batches import ClaimBatch

__all__ = ["MAX_WAIT_SECONDS", "Waiting", "backoff", "check_wait"]

#: The longest ``wait=``: an hour, far beyond a request's patience.
MAX_WAIT_SECONDS = 3600.0
#: A store that polls asks again after this, doubled per round, up to POLL_MAX.
POLL_FIRST = 0.005
POLL_MAX = 0.25


def check_wait(wait: object) -> float:
    """``wait=``: seconds in [0, MAX_WAIT_SECONDS] (TypeError/ValueError otherwise)."""
    if isinstance(wait, bool) or not isinstance(wait, (int, float)):
        raise TypeError(f"wait must be a number of seconds, not {type(wait).__name__}")
    if not math.isfinite(wait) or not 0 <= wait <= MAX_WAIT_SECONDS:
        raise ValueError(f"wait must be between 0 and {MAX_WAIT_SECONDS:.0f} seconds, got {wait!r}")
    return float(wait)


def backoff(attempt: int, left: float) -> float:
    """How long a polling store waits before asking again: doubling from POLL_FIRST to
    POLL_MAX, with jitter (waiters of one key do not ask in step), never past ``left``."""
    step = min(POLL_MAX, POLL_FIRST * (1 << min(attempt, 16)))
    return max(0.0, min(left, step * random.uniform(0.5, 1.0)))


class Waiting:
    """A claim batch's answers while some keys are IN_PROGRESS and time is left.

    A driver asks :meth:`pending` for the batch of the keys to ask again
    (None when there are none or the time is up), waits on the store's
    ``_wait_change`` for at most :meth:`left` seconds, claims that batch
    again and hands the answers to :meth:`answered`.
    """

    def __init__(self, batch: ClaimBatch, claims: list[Claim], wait: float) -> None:
        self.batch = batch
        self.claims = claims
        self.deadline = time.monotonic() + wait
        self.attempt = 0
        self._indexes: list[int] = []

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def pending(self) -> ClaimBatch | None:
        digest = self.batch.digest
        # A later copy of a key this batch claimed NEW is held by this caller: not waited on.
        mine = {digest(i) for i, c in enumerate(self.claims) if c.outcome is Outcome.NEW}
        self._indexes = [
            i
            for i, c in enumerate(self.claims)
            if c.outcome is Outcome.IN_PROGRESS and digest(i) not in mine
        ]
        if not self._indexes or self.left() <= 0:
            return None
        return self.batch.subset(self._indexes)

    def answered(self, claims: list[Claim]) -> None:
        for i, c in zip(self._indexes, claims, strict=True):
            self.claims[i] = c
        self.attempt += 1
