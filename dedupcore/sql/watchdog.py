"""The watchdog that cuts a SQL connection still waiting at its call's deadline.

docs/timeouts.md: psycopg has no wait limit of its own, and a server that
stopped never runs its statement_timeout, so a thread shuts the socket down.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

__all__ = ["Watchdog"]


class Watchdog:
    """Cuts the connection of a transaction still waiting at its deadline.

    psycopg waits for a reply without a timeout of its own, and the server's
    statement_timeout cannot fire in a server that does not run (stopped,
    or on a host that froze while its kernel still acknowledges packets, so
    TCP keepalive does not notice either). A thread that shuts the socket
    down at the deadline wakes the waiting call, which then fails as a lost
    connection (:class:`~dedupcore.errors.UnavailableError`); the next call connects again.
    The deadline is the call's (docs/timeouts.md), or ``limit`` seconds
    after the transaction started if that comes first. The thread sleeps
    until the deadline of the transaction it watches, and ends after a
    while without any.
    """

    #: Seconds without a transaction after which the thread ends.
    IDLE = 30.0

    def __init__(self, limit: float | None = None) -> None:
        self.limit = limit
        self.cuts = 0
        self._cond = threading.Condition()
        self._fd: int | None = None
        self._until = 0.0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(self, fd: int | None, until: float | None = None) -> Iterator[None]:
        """Watches the socket ``fd`` for the block's duration (nothing when None).

        ``until``: the call's deadline (``time.monotonic()`` seconds), or None.
        """
        if self.limit is not None:
            own = time.monotonic() + self.limit
            until = own if until is None else min(until, own)
        if fd is None or fd < 0 or until is None:
            yield
            return
        with self._cond:
            self._fd, self._until = fd, until
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dedupcore-sql-watchdog", daemon=True
                )
                self._thread.start()
            else:
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._fd = None

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._fd is None:
                    if not self._cond.wait(self.IDLE) and self._fd is None:
                        self._thread = None
                        return
                    continue
                wait = self._until - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                # Under the lock: the transaction cannot finish (and its connection
                # cannot be closed, freeing the descriptor) in the meantime.
                self.cuts += 1
                with contextlib.suppress(OSError):
                    cut = socket.socket(fileno=os.dup(self._fd))
                    try:
                        cut.shutdown(socket.SHUT_RDWR)
                    finally:
                        cut.close()  # the duplicate only; the driver owns the socket
                self._fd = None
