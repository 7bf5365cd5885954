"""Group commit: the requests decided on the event loop are made durable together
(docs/daemon.md, "The request path of the embedded store").
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["INLINE_COMMIT_BYTES", "LONE_STREAK", "Committer", "Decided"]

#: The event loop waits for a commit itself (no thread hop) only when the log it
#: writes is at most this big: a commit that carries a large batch's records
#: would stop every other connection for its write and sync.
INLINE_COMMIT_BYTES = 64 << 10

#: ... and only after this many groups of one request in a row, each handed over
#: with nothing else in flight: while several connections take turns, a group of
#: one is a moment between their requests, and a sync on the loop would keep it
#: from reading theirs (docs/daemon.md, "Group commit").
LONE_STREAK = 8


#: A request decided on the loop whose commit is still to come: (request id, answer,
#: the commit, when its handling started).
Decided = tuple[int, Any, asyncio.Future[None], float]


class Committer:
    """Makes the requests decided on the event loop durable, a group at a time.

    The requests decided in one pass of the loop are gathered; at the start of
    the next pass they are handed over together. When the group is one
    request, no commit is running, none is queued, no other request is in
    flight (``others_in_flight(n)``: requests beside the group's n), the log
    to write is small (INLINE_COMMIT_BYTES) and the LONE_STREAK groups before
    it were alike, the loop itself waits for the log (one ``fdatasync``, no
    thread hop: a lone client's claim costs one wake-up less). Otherwise the
    store's native commit thread writes and syncs the group without the GIL
    while the loop goes on deciding, and its eventfd wakes the loop to answer
    the group; the requests decided meanwhile form the next group, started as
    soon as that commit is done
    (docs/daemon.md, "Group commit"). Where the store has no native commit
    (a log that syncs nothing, or I/O of the store's own under way), the
    commit thread takes the group: each of its rounds takes every group
    queued meanwhile, waits once until the highest LSN among them is durable,
    then resolves all their futures in one callback on the loop."""

    def __init__(
        self,
        store: Any,
        loop: asyncio.AbstractEventLoop,
        others_in_flight: Callable[[int], bool] = lambda n: False,
    ) -> None:
        self._store = store
        self._loop = loop
        self._others_in_flight = others_in_flight
        # A plain lock (not the default RLock): the loop takes it without a Python call.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []
        self._running = False  # a round of the commit thread is under way
        self._gathered: list[tuple[int, asyncio.Future[None]]] = []
        # The group the native commit thread is making durable, and the requests
        # decided since, for the commit after it (loop only).
        self._native: list[tuple[int, asyncio.Future[None]]] | None = None
        self._next: list[tuple[int, asyncio.Future[None]]] = []
        self._native_fd: int | None = None  # watched by the loop once the first started
        self._closed = False
        self._lone = 0  # groups of one in a row, with nothing else in flight (LONE_STREAK)
        self.rounds = 0  # waits for the log, each covering every request queued meanwhile
        self.inline_rounds = 0  # of them, waits on the loop itself
        self.native_rounds = 0  # of them, commits of the native thread
        self._thread = threading.Thread(target=self._run, name="dedupcore-commit", daemon=True)
        self._thread.start()

    def wait(self, lsn: int, *, gather: bool = False) -> asyncio.Future[None] | None:
        """A future resolved (on the loop) once the log is durable through ``lsn``.
        Called on the loop. A lone request with a small commit, unless ``gather``, is
        committed here and now: None comes back (durable: no future, no pass of the
        loop for the hand-over), or the commit's error is raised. With ``gather``
        the commit waits for the end of this pass of the loop, so that requests
        other connections sent meanwhile share it."""
        if not self._gathered:
            if not gather:
                # Not gathered: a commit without a sync (cheap on the loop), or a
                # task's; the streak is the gathered groups' rule.
                with self._lock:
                    lone = self._alone(1) and self._small()
                if lone:
                    self.rounds += 1
                    self.inline_rounds += 1
                    try:
                        self._store.wait_durable(lsn)
                    except BaseException:
                        # As _commit: a second wait says whether the records were
                        # durable before the commit failed, else raises its error.
                        self._store.wait_durable(lsn)
                    return None
            self._loop.call_soon(self._hand_over)
        fut = self._loop.create_future()
        self._gathered.append((lsn, fut))
        return fut

    def _alone(self, n: int) -> bool:
        """Whether a group of ``n`` requests is alone (lock held): one request, no
        commit running or queued, no other request in flight."""
        return not (
            self._running
            or self._waiting
            or self._native is not None
            or n != 1
            or self._others_in_flight(n)
        )

    def _small(self) -> bool:
        """Whether the log a commit would write now is small enough for the loop."""
        return bool(self._store.commit_bytes() <= INLINE_COMMIT_BYTES)

    def _inline(self, n: int) -> bool:
        """Whether the loop commits a gathered group of ``n`` requests itself (lock
        held): alone, with a small commit, after LONE_STREAK groups alike in a row.
        Counts the streak: a group of several means other connections are busy, and
        the native thread syncs it while the loop decides what they send next."""
        self._lone = self._lone + 1 if self._alone(n) else 0
        return self._lone > LONE_STREAK and self._small()

    def _hand_over(self) -> None:
        """The requests of the last pass of the loop: committed here when nothing else
        commits and the commit is small, else by the native commit thread (after the
        commit it is making, if any), else queued for the commit thread."""
        batch, self._gathered = self._gathered, []
        if not batch:
            return
        if self._native is not None:
            self._next.extend(batch)
            self._lone = 0
            return
        with self._cond:
            # After close() the thread may be gone: the loop commits itself.
            here = self._closed or self._inline(len(batch))
        if here:
            self._commit_here(batch)
        elif not self._start_native(batch):
            with self._cond:
                self._waiting.extend(batch)
                self._cond.notify()

    def _start_native(self, batch: list[tuple[int, asyncio.Future[None]]]) -> bool:
        """Starts the native commit thread on everything the log has queued (``batch``'s
        records among it); False where the store cannot (see WriteAheadLog.start_commit)."""
        try:
            if not self._store.start_commit():
                return False
        except Exception:
            # The log failed starting it: the commit thread's wait gives each its error.
            return False
        if self._native_fd is None:
            fd = self._store.commit_fd()
            if fd is None:
                raise AssertionError("a native commit started without its descriptor")
            self._native_fd = fd
            self._loop.add_reader(fd, self._native_done)
        self._native = batch
        self.rounds += 1
        self.native_rounds += 1
        return True

    def _native_done(self) -> None:
        """The native commit thread's descriptor became readable: answers the group it
        made durable and starts the next."""
        if not self._store.finish_commit() or self._native is None:
            return  # still running (a spurious wake-up), or nothing of the loop's
        batch, self._native = self._native, None
        _resolve(self._commit(batch))  # durable now (or failed): no wait
        if self._next:
            self._gathered = self._next + self._gathered
            self._next = []
            self._hand_over()

    def _commit_here(self, batch: list[tuple[int, asyncio.Future[None]]]) -> None:
        """Commits a group on the loop itself and resolves its futures."""
        self.rounds += 1
        self.inline_rounds += 1
        _resolve(self._commit(batch))

    def close(self) -> None:
        """Finishes the waits queued so far, then stops the thread."""
        if self._native_fd is not None:
            self._loop.remove_reader(self._native_fd)
            self._native_fd = None
        pending = (self._native or []) + self._next
        self._native, self._next = None, []
        if pending:
            _resolve(self._commit(pending))
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _commit(
        self, batch: list[tuple[int, asyncio.Future[None]]]
    ) -> list[tuple[asyncio.Future[None], BaseException | None]]:
        """Waits until the log is durable through the batch's highest LSN; what to
        resolve each future with."""
        try:
            self._store.wait_durable(max(lsn for lsn, _ in batch))
            return [(fut, None) for _, fut in batch]
        except BaseException:
            # The commit failed: the requests whose records were durable before
            # it are still answered; the others get the error their own wait gives.
            done: list[tuple[asyncio.Future[None], BaseException | None]] = []
            for lsn, fut in sorted(batch, key=lambda item: item[0]):
                try:
                    self._store.wait_durable(lsn)
                    done.append((fut, None))
                except BaseException as exc:
                    done.append((fut, exc))
            return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._running = False
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                batch, self._waiting = self._waiting, []
                self._running = True
            self.rounds += 1
            done = self._commit(batch)
            try:
                self._loop.call_soon_threadsafe(_resolve, done)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return


def _resolve(done: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    for fut, exc in done:
        if fut.done():  # the request timed out or its connection went away
            continue
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
