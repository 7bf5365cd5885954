"""What differs between platforms, in one place (docs/compatibility.md, "Platforms").

Linux is the platform dedupcore is tested on. Elsewhere the write-ahead log's
flush falls back to what the platform offers, and the daemon's peer check,
which needs ``SO_PEERCRED``, refuses to start instead of serving unchecked.
"""

from __future__ import annotations

import os
import socket
import sys

from dedupcore.errors import UnsupportedPlatformError

__all__ = ["fdatasync", "peer_credentials_option"]


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
