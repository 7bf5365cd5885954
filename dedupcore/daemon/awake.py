"""The event loop kept polling for a short while after it writes a reply
(docs/daemon.md, "Polling for the reply").

Asleep in ``epoll_wait()``, the loop thread is woken by the kernel when a
request arrives, from another core: on a virtual machine that is most of a
small request's time. :class:`Awake` keeps the loop from sleeping for as
long as its :class:`~dedupcore._spin.Spin` says after each reply: a callback
that puts itself back in the ready queue makes every pass of the loop poll
with a zero timeout, and gives the core to any other runnable thread
(``sched_yield``) before the next pass. A request that arrives meanwhile is
read at once, with no wake-up. The adaptive spin follows the typical time
from a reply to the next request, so a daemon whose clients send
seldom never spins.
"""

from __future__ import annotations

import asyncio
import os
import time

from dedupcore._spin import Spin

__all__ = ["Awake"]


class Awake:
    """Polling after replies for one event loop (``loop`` is set when it starts).

    ``spin``: None adapts, 0 never polls, else seconds after every reply.
    ``counters["polled_requests"]`` counts the requests that arrived while the
    loop polled.
    """

    __slots__ = (
        "_active",
        "_clock",
        "_counters",
        "_read",
        "_replied_at",
        "_spin",
        "_until",
        "loop",
    )

    def __init__(self, spin: float | None, counters: dict[str, int]) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._spin = Spin(spin)
        self._counters = counters
        self._clock = time.perf_counter
        self._until = 0.0
        self._active = False
        self._replied_at = 0.0  # when the last reply was written, until a request came
        self._read = False  # a request was read since the last poll

    def replied(self) -> None:
        """A reply was written: the loop polls for the spin's budget from now."""
        now = self._clock()
        self._replied_at = now
        budget = self._spin.budget()
        if budget and self.loop is not None:
            self._until = now + budget
            if not self._active:
                self._active = True
                self.loop.call_soon(self._poll)

    def arrived(self) -> None:
        """Bytes of a request were read: the wait since the last reply is counted."""
        self._read = True
        if self._replied_at:
            self._spin.took(self._clock() - self._replied_at)
            self._replied_at = 0.0
            if self._active:
                self._counters["polled_requests"] += 1

    def _poll(self) -> None:
        if self._clock() < self._until:
            if self._read:
                # The last pass read requests: the loop has work, not a core to give.
                self._read = False
            else:
                os.sched_yield()
            assert self.loop is not None
            self.loop.call_soon(self._poll)
        else:
            self._active = False
