"""What differs between platforms, in one place (docs/compatibility.md, "Platforms").

Linux is the platform dedupcore is tested on. Elsewhere the write-ahead log's
flush falls back to what the platform offers, and the daemon's peer check,
which needs ``SO_PEERCRED``, refuses to start instead of serving unchecked.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import sys
from collections.abc import Callable
from typing import cast

from dedupcore.errors import UnsupportedPlatformError

__all__ = ["fdatasync", "peer_credentials_option", "trim_heap"]


def fdatasync(fd: int) -> None:
    """Flushes a file's data, and the metadata needed to read it back, to the disk.

    ``os.fdatasync`` where the platform has it (Linux); on macOS
    ``fcntl(F_FULLFSYNC)``, since its ``fsync`` leaves the data in the drive's
    cache, where a power loss can take it; ``os.fsync`` elsewhere. Failures
    raise ``OSError`` as the call made does.
    """
    if sys.platform == "darwin":
        import fcntl

        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
        return
    # Looked up at each call, not bound at import, so that a test may replace it.
    sync = getattr(os, "fdatasync", None)
    if sync is None:
        os.fsync(fd)
    else:
        sync(fd)


def peer_credentials_option() -> int:
    """``socket.SO_PEERCRED``, with which the daemon reads a peer's pid, uid and gid.

    Raises :class:`~dedupcore.errors.UnsupportedPlatformError` off Linux, so
    that ``dedupcore serve`` says so before it listens rather than admitting
    every peer: other systems lack the option or (OpenBSD) fill it with
    another layout than Linux's ``struct ucred``, which the daemon reads.
    """
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None or not sys.platform.startswith("linux"):
        raise UnsupportedPlatformError(
            "dedupcore serve checks each peer's uid and gids with Linux's SO_PEERCRED, "
            f"which {sys.platform} does not have: the daemon runs on Linux "
            "(docs/compatibility.md)"
        )
    return int(option)


def trim_heap() -> bool:
    """Returns the free memory of the C heap to the system, where the C library
    can (glibc's ``malloc_trim``): memory ``free`` gave back stays mapped to the
    process otherwise. True if some was returned; False when none was, or the
    platform has no such call. The GIL is let go meanwhile."""
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return cast(Callable[[int], int], trim)
