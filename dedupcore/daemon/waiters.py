"""The daemon's WAIT op: clients waiting on keys another owner holds, woken on the
event loop when a key may have changed (docs/daemon.md, "Waiting on keys").

A waiter is a future in a registry by key digest, with one timer (``loop.call_at``)
for the earlier of its timeout and the first lease end of its keys. Every
completion and release the daemon applies wakes the waiters of its keys once its
commit is durable (:meth:`Waiters.wake`); the timer wakes them when the first lease
runs out, or answers "timeout". No thread waits, and nothing polls.

Only a store that the daemon alone writes can tell it every change: the embedded
store (a :class:`~dedupcore.api.deferred.DeferredStore` that says how long its
keys are held, ``held_until``). For any other authority (Redis, SQL, stacks) the
changes may come from elsewhere, and a WAIT is answered "poll": the client asks
again after its backoff. So is a WAIT past the caps, or one sent while the daemon
stops; a closed connection's waiters are dropped.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import dedupcore._engine as _engine
from dedupcore.api import ClaimBatch
from dedupcore.api.deferred import DeferredStore
from dedupcore.api.waiting import MAX_WAIT_SECONDS
from dedupcore.daemon.protocol import POLL, TIMED_OUT, WOKEN, FrameError

if TYPE_CHECKING:
    from dedupcore.daemon.connection import Connection

__all__ = ["Waiters"]


class _Waiter:
    __slots__ = ("batch", "conn", "deadline", "digests", "future", "timer")

    def __init__(
        self, conn: Connection, batch: ClaimBatch, future: asyncio.Future[str], deadline: float
    ) -> None:
        self.conn = conn
        self.batch = batch
        self.digests = set(_engine.split_digests(batch.digests))
        self.future = future
        self.deadline = deadline  # on the loop's clock
        self.timer: asyncio.TimerHandle | None = None


class Waiters:
    """The waiters of one daemon (see the module docstring): at most ``max_waiters`` in
    all and ``per_connection`` of one connection; ``counters`` is the daemon's."""

    def __init__(
        self, store: Any, *, max_waiters: int, per_connection: int, counters: dict[str, int]
    ) -> None:
        held_until = getattr(store, "held_until", None)
        #: How long a batch's keys are held (None: the daemon does not wake waiters).
        self._held_until: Callable[[ClaimBatch], float | None] | None = (
            held_until if isinstance(store, DeferredStore) and callable(held_until) else None
        )
        self._limits = store.limits
        self.max_waiters = max_waiters
        self.per_connection = per_connection
        self.counters = counters
        for name in (
            "waits",
            "waits_woken",
            "waits_timed_out",
            "waits_polled",
            "waits_over_cap",
            "waits_dropped",
        ):
            counters[name] = 0
        self._by_digest: dict[bytes, set[_Waiter]] = {}
        self._by_conn: dict[Connection, set[_Waiter]] = {}
        self.count = 0  # waiters registered now (the ``waiters`` gauge of STATS)
        self._closed = False

    @property
    def wakes(self) -> bool:
        """Whether this daemon wakes waiters (else every WAIT is answered "poll")."""
        return self._held_until is not None

    async def wait(self, conn: Connection, args: dict[str, Any]) -> str:
        """Serves a WAIT of ``conn``: its answer (bad arguments raise, as for every op)."""
        batch, timeout = self._checked(args)
        counters = self.counters
        counters["waits"] += 1
        if self._held_until is None or self._closed or conn.peer_done:
            counters["waits_polled"] += 1
            return POLL
        mine = self._by_conn.get(conn)
        if self.count >= self.max_waiters or (mine and len(mine) >= self.per_connection):
            counters["waits_over_cap"] += 1
            counters["waits_polled"] += 1
            return POLL
        until = self._held_until(batch) if batch.keys else None
        if until is None or until <= time.monotonic():
            counters["waits_woken"] += 1  # not held (or its lease ran out): ask again now
            return WOKEN
        if timeout <= 0:
            counters["waits_timed_out"] += 1
            return TIMED_OUT
        loop = asyncio.get_running_loop()
        w = _Waiter(conn, batch, loop.create_future(), loop.time() + timeout)
        self._add(w)
        self._arm(w, until)
        try:
            return await w.future
        finally:
            self._remove(w)  # cancelled (the loop is closing) or answered

    def changed(self, digests: bytes, durable: asyncio.Future[None] | None) -> None:
        """Keys were completed or released: their waiters are woken once ``durable`` (the
        commit the change waits for, None: none) is done. A waiter that comes meanwhile
        finds the keys no longer held and is answered at once."""
        if not self.count:
            return
        if durable is None or durable.done():
            self.wake(digests)
        else:
            durable.add_done_callback(lambda _: self.wake(digests))

    def wake(self, digests: bytes) -> None:
        """Wakes the waiters of these keys (concatenated digests): they were completed or
        released, and the commit that did it is durable."""
        for w in self._of(digests):
            self._answer(w, WOKEN, "waits_woken")

    def renewed(self, digests: bytes) -> None:
        """These keys' leases were renewed (EXTEND_MANY): their waiters' timers follow
        the new first lease end, earlier or later."""
        for w in self._of(digests):
            if w.timer is not None:
                w.timer.cancel()
                w.timer = None
            self._lease_check(w)

    def drop(self, conn: Connection) -> None:
        """The connection closed (or its peer stopped sending): its waiters are answered
        "poll" at once and forgotten."""
        for w in list(self._by_conn.get(conn, ())):
            self._answer(w, POLL, "waits_dropped")

    def close(self) -> None:
        """The daemon stops: every waiter is answered "poll" at once, and so is every
        WAIT from now on (waiters do not hold up the drain)."""
        self._closed = True
        for ws in list(self._by_conn.values()):
            for w in list(ws):
                self._answer(w, POLL, "waits_polled")

    # -- inside ------------------------------------------------------------------------

    def _of(self, digests: bytes) -> set[_Waiter]:
        """The waiters of any of these keys."""
        found: set[_Waiter] = set()
        if self._by_digest:
            for d in _engine.split_digests(digests):
                ws = self._by_digest.get(d)
                if ws:
                    found.update(ws)
        return found

    def _checked(self, args: dict[str, Any]) -> tuple[ClaimBatch, float]:
        for name in ("ns", "keys", "timeout"):
            if name not in args:
                raise FrameError(f"missing argument {name!r}")
        ns, keys, timeout = args["ns"], args["keys"], args["timeout"]
        if not isinstance(ns, str):
            raise TypeError(f"argument 'ns' has type {type(ns).__name__}")
        if not isinstance(keys, list):
            raise TypeError(f"argument 'keys' has type {type(keys).__name__}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"argument 'timeout' has type {type(timeout).__name__}")
        if not math.isfinite(timeout) or not 0 <= timeout <= MAX_WAIT_SECONDS:
            raise ValueError(
                f"timeout must be between 0 and {MAX_WAIT_SECONDS:.0f} seconds, got {timeout!r}"
            )
        return ClaimBatch(keys, namespace=ns, limits=self._limits), float(timeout)

    def _add(self, w: _Waiter) -> None:
        for d in w.digests:
            self._by_digest.setdefault(d, set()).add(w)
        self._by_conn.setdefault(w.conn, set()).add(w)
        self.count += 1

    def _remove(self, w: _Waiter) -> None:
        mine = self._by_conn.get(w.conn)
        if mine is None or w not in mine:
            return
        mine.discard(w)
        if not mine:
            del self._by_conn[w.conn]
        for d in w.digests:
            ws = self._by_digest.get(d)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del self._by_digest[d]
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None
        self.count -= 1

    def _answer(self, w: _Waiter, answer: str, counter: str) -> None:
        self._remove(w)
        if not w.future.done():
            w.future.set_result(answer)
            self.counters[counter] += 1

    def _arm(self, w: _Waiter, until: float) -> None:
        """The timer for the earlier of the waiter's deadline and ``until`` (a lease end
        on ``time.monotonic()``, told in the loop's clock from now)."""
        loop = w.future.get_loop()
        at = min(w.deadline, loop.time() + (until - time.monotonic()))
        w.timer = loop.call_at(at, self._on_timer, w)

    def _on_timer(self, w: _Waiter) -> None:
        w.timer = None
        if w.future.done():
            return
        loop = w.future.get_loop()
        if loop.time() >= w.deadline:
            self._answer(w, TIMED_OUT, "waits_timed_out")
        else:
            self._lease_check(w)

    def _lease_check(self, w: _Waiter) -> None:
        """Wakes a waiter whose first lease ran out (or whose key is no longer held);
        else arms its timer for the first lease end (a timer that fired early, or a
        lease renewed meanwhile)."""
        assert self._held_until is not None
        try:
            until = self._held_until(w.batch)
        except Exception:  # a failed store: the client's claim says how
            until = None
        if until is None or until <= time.monotonic():
            self._answer(w, WOKEN, "waits_woken")
        else:
            self._arm(w, until)
