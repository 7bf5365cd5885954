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
    """The lock's part of :class:`~dedupcore.store.DedupStore` (mixed in)."""

    path: Path
    _lock_fd: int | None

    def _take_lock(self) -> None:
        lock_path = self.path / LOCK_FILE
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise StoreLockedError(
                f"data directory {self.path} is owned by process {owner}; one process "
                "owns a directory at a time: share it through `dedupcore serve` and "
                "connect with dedupcore.Client, or open it with readonly=True to inspect it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
