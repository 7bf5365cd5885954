"""The one-owner lock of a data directory: the ``LOCK`` file, held with ``flock``.

One process owns a data directory at a time; another one that opens it gets
:class:`~dedupcore.errors.StoreLockedError`, whose message names the owner's
process id (written into the file) and the ways to share the directory.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from dedupcore.errors import StoreLockedError

__all__ = ["LOCK_FILE", "OwnerLock", "StoreLockedError"]

LOCK_FILE = "LOCK"


class OwnerLock:
    """The lock of data directory ``directory``: :meth:`take` it, :meth:`release` it.

    The lock goes with the open file, so a process that dies lets go of it;
    the pid in the file is only what a refused opener is told.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fd: int | None = None

    def take(self) -> None:
        """Takes the lock and writes this process's id into the file; raises
        StoreLockedError, naming the owner, while another process holds it."""
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise StoreLockedError(
                f"data directory {self.directory} is owned by process {owner}; one process "
                "owns a directory at a time: share it through `dedupcore serve` and "
                "connect with dedupcore.Client, or open it with readonly=True to inspect it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Lets the lock go (nothing if it is not held)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
