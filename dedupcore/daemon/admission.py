"""What the daemon admits, and when: connections within the open-file limit,
request bytes within a shared budget, small requests before the slices of large
batches, every wait within its deadline (docs/daemon.md, "Limits").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections import deque
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

__all__ = ["SMALL_FRAME", "Budget", "SmallRequests", "connection_cap", "within"]

T = TypeVar("T")

log = logging.getLogger("dedupcore.daemon")

#: A request frame of at most this many bytes is small (a claim of up to a few
#: thousand keys): it may pass larger ones waiting for the buffer budget, and
#: while one is being answered, large batches wait between two slices.
SMALL_FRAME = 64 << 10


def connection_cap(wanted: int, reserve: int) -> int:
    """``wanted`` connections, or fewer so that ``reserve`` descriptors stay free.

    Raises the soft ``RLIMIT_NOFILE`` to the hard limit where allowed, then
    leaves room for the descriptors already open and ``reserve`` more (the
    store's log segments, LMDB and archive files, the thread pool).
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft == resource.RLIM_INFINITY:
        return wanted
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    cap = max(1, soft - in_use - reserve)
    if cap < wanted:
        log.warning(
            "serving at most %d connections, not %d: the open-file limit is %d, %d descriptors "
            "are open and %d are kept for the store",
            cap,
            wanted,
            soft,
            in_use,
            reserve,
        )
        return cap
    return wanted


class Budget:
    """Bytes of request frames held (being read or not yet answered), across connections."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.waits = 0  # reservations that had to wait
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def fits(self, n: int) -> bool:
        """Whether ``n`` bytes can be reserved at once, without waiting."""
        return self.used + n <= self.limit and (not self._waiters or n <= SMALL_FRAME)

    def wait(self, n: int, fut: asyncio.Future[None]) -> tuple[int, asyncio.Future[None]]:
        """Queues a reservation of ``n`` bytes that does not fit yet: ``fut`` is resolved,
        in order, once they are reserved. Returns the entry to :meth:`cancel` it by."""
        self.waits += 1
        entry = (n, fut)
        self._waiters.append(entry)
        return entry

    def cancel(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        """Gives up a reservation queued by :meth:`wait` (granted or not)."""
        n, fut = entry
        if fut.done() and not fut.cancelled():
            self.give(n)  # granted just as the wait was given up
            return
        fut.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(entry)
        self._wake()

    def give(self, n: int) -> None:
        self.used -= n
        if self._waiters:
            self._wake()

    def _wake(self) -> None:
        # In order; a small frame may pass a large one that does not fit yet.
        for entry in list(self._waiters):
            n, fut = entry
            head = entry is self._waiters[0]
            if fut.done():
                self._waiters.remove(entry)
            elif self.used + n <= self.limit and (head or n <= SMALL_FRAME):
                self._waiters.remove(entry)
                self.used += n
                fut.set_result(None)


class SmallRequests:
    """The small requests (frames of at most SMALL_FRAME bytes) read and not yet answered.

    A large claim batch's next slice waits until there are none, for a short
    while at most (:meth:`drained`): a single claim then waits for no slice.
    """

    def __init__(self) -> None:
        self.count = 0
        self._none = asyncio.Event()
        self._none.set()

    def add(self) -> None:
        self.count += 1
        self._none.clear()

    def done(self) -> None:
        self.count -= 1
        if not self.count:
            self._none.set()

    async def drained(self, seconds: float) -> None:
        """Returns once none is in flight, or after ``seconds``."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._none.wait(), seconds)


async def within(aw: Awaitable[T], seconds: float) -> T:
    """Awaits with a deadline; ``asyncio.timeout`` where available (no extra task)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)  # pragma: no cover
