"""The files dedupcore writes: one header frame, atomic replacement, owner-only modes, syncs.

Every binary file of the package (a Bloom filter, a fuse filter, a
write-ahead log segment, the log's head file) starts with the same frame,
little-endian: an 8-byte magic, a 2-byte format version right after it, the
format's own fields, and, as the header's last 8 bytes, the XXH64 (seed 0) of
the header bytes before them. :class:`FileHeader` writes and checks that frame
for one format, in one order: the magic, a version newer than this dedupcore
reads (:class:`~dedupcore.errors.UnsupportedFormatError`), the checksum, then
the version itself. The layouts are in each format's module
(``dedupcore/bloom.py``, ``dedupcore/fuse.py``, ``dedupcore/wal/framing.py``,
``dedupcore/wal/segments.py``).

A file is replaced whole or not at all (:func:`atomic_write`), and what
dedupcore writes is its owner's only: files 0600 (:data:`FILE_MODE`),
directories 0700 (:data:`DIR_MODE`), whatever the umask (the keys tell what
a consumer saw; docs/reliability.md). The flush of a log's data goes through
:func:`fdatasync`, which is the platform's (``dedupcore/_platform.py``).
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dedupcore._core as _core
import dedupcore._platform as _platform
from dedupcore.errors import CorruptFileError, UnsupportedFormatError

__all__ = [
    "CHECKSUM",
    "DIR_MODE",
    "FILE_MODE",
    "FileHeader",
    "atomic_write",
    "fdatasync",
    "fsync_dir",
    "mkdir_private",
    "open_dir",
    "resize_durably",
    "seal",
    "unlink_quiet",
    "write_all",
]

#: Mode of every file dedupcore creates: the owner's only.
FILE_MODE = 0o600
#: Mode of every directory dedupcore creates.
DIR_MODE = 0o700
#: The checksum that closes every header: XXH64 (seed 0), 8 bytes.
CHECKSUM = struct.Struct("<Q")
_PREFIX = struct.Struct("<8sH")  # magic, version: the same in every format


def seal(head: bytes) -> bytes:
    """``head`` with its last 8 bytes replaced by the XXH64 (seed 0) of the bytes before them."""
    body = head[: -CHECKSUM.size]
    return body + CHECKSUM.pack(_core.hash64(body))


@dataclass(frozen=True)
class FileHeader:
    """The header of one file format: magic, version, its fields, the checksum last.

    ``layout`` is the whole header, magic first (``8s``), version second
    (``H``), checksum last (``Q``). The other fields describe the format's
    error messages: ``name`` is what the magic says the file is,
    ``newer`` how a newer version is named, ``invalid`` the problem of an
    older or zero version (``{version}`` is replaced), ``mismatch`` the
    problem of a wrong checksum.
    """

    layout: struct.Struct
    magic: bytes
    version: int
    name: str
    newer: str = "format version"
    invalid: str = "invalid format version {version}"
    mismatch: str = "header checksum mismatch"

    @property
    def size(self) -> int:
        """Bytes of the header, checksum included."""
        return self.layout.size

    def pack(self, *fields: Any) -> bytes:
        """The header of this format's current version with ``fields`` (those between
        the version and the checksum), checksummed."""
        return seal(self.layout.pack(self.magic, self.version, *fields, 0))

    def problem(self, head: bytes | memoryview, source: str) -> str | None:
        """Why ``head`` (at least :attr:`size` bytes) is not a valid header, or None.

        Raises :class:`UnsupportedFormatError` naming ``source`` for a version
        newer than this dedupcore reads: that file is not damaged.
        """
        magic, version = _PREFIX.unpack_from(head)
        if magic != self.magic:
            return f"not {self.name} (magic {magic!r})"
        if version > self.version:
            raise UnsupportedFormatError(
                f"{source}: {self.newer} {version} is newer than this dedupcore reads "
                f"({self.version}); upgrade dedupcore"
            )
        checked = self.size - CHECKSUM.size
        if CHECKSUM.unpack_from(head, checked)[0] != _core.hash64(head[:checked]):
            return self.mismatch
        if version != self.version:
            return self.invalid.format(version=version)
        return None

    def unpack(self, head: bytes | memoryview, source: str) -> tuple[Any, ...]:
        """The fields of a valid header between the version and the checksum.

        :class:`CorruptFileError` naming ``source`` when ``head`` is shorter than
        the header or not a valid one; :class:`UnsupportedFormatError` for a
        newer version.
        """
        if len(head) < self.size:
            raise CorruptFileError(
                f"{source}: truncated: {len(head)} bytes, shorter than the {self.size}-byte header"
            )
        problem = self.problem(head, source)
        if problem is not None:
            raise CorruptFileError(f"{source}: {problem}")
        return self.layout.unpack_from(head)[2:-1]


# -- writing -------------------------------------------------------------------


def open_dir(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of a directory, to fsync it."""
    return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Makes the entries of a directory durable: a file's fsync does not make its name
    durable, so a file created, renamed or deleted needs its directory's too."""
    fd = open_dir(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fdatasync(fd: int) -> None:
    """Flushes a file's data and the metadata needed to read it back, the platform's way
    (``dedupcore/_platform.py``, looked up at each call)."""
    _platform.fdatasync(fd)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Writes every byte (os.write may write less than asked)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


def resize_durably(path: str | os.PathLike[str], size: int) -> None:
    """Cuts or extends the file at ``path`` to ``size`` bytes, then fsyncs it."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def mkdir_private(path: Path) -> None:
    """Creates ``path`` and its missing parents with mode 0o700 (``mkdir -p`` ignores the mode
    for parents): the filters tell which keys were seen, so only the owner may read them."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for directory in reversed(missing):
        directory.mkdir(mode=DIR_MODE, exist_ok=True)


def atomic_write(path: str | os.PathLike[str], chunks: Iterable[bytes | memoryview]) -> None:
    """Writes a file so that readers see the old or the new content, never a mix.

    Temp file in the same directory (``.<name>.<random>.tmp``, mode 0600),
    fsync, rename over the target, fsync of the directory (so the rename
    itself survives a power loss).
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def unlink_quiet(path: Path) -> None:
    """Removes a file that may already be gone."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
