"""The write-ahead log's files: segment names and the head file.

The head file's layout is in the package's documentation (``dedupcore/wal/__init__.py``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct
from pathlib import Path

import dedupcore._core as _core
from dedupcore.errors import CorruptFileError, UnsupportedFormatError
from dedupcore.wal.framing import CHECKSUM

HEAD_MAGIC = b"DDCWALHD"
HEAD_VERSION = 1
HEAD = struct.Struct("<8sHHIQQ")
HEAD_SIZE = HEAD.size + 8
_HEAD_OPEN, _HEAD_CLEAN = 0, 1

_SEGMENT_RE = re.compile(r"wal-(\d{20})\.log")
_TMP_RE = re.compile(r"\.wal-\d{20}\.log\.[^/]*tmp")


def _segment_name(first_lsn: int) -> str:
    return f"wal-{first_lsn:020d}.log"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class LogHead:
    """What a log's head file says (module documentation, "The head file")."""

    newest_segment: int  #: first LSN of the newest segment the log created
    clean: bool  #: closed with every record checkpointed
    last_lsn: int  #: the log's last LSN at that clean close (0 while open)


def _pack_head(head: LogHead) -> bytes:
    state = _HEAD_CLEAN if head.clean else _HEAD_OPEN
    body = HEAD.pack(HEAD_MAGIC, HEAD_VERSION, state, 0, head.newest_segment, head.last_lsn)
    return body + CHECKSUM.pack(_core.hash64(body))


def read_head(path: str | os.PathLike[str]) -> LogHead | None:
    """The head file at ``path`` (None if there is none); CorruptFileError if it is
    damaged, UnsupportedFormatError if a newer version wrote it."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as fh:
            raw = fh.read(HEAD_SIZE + 1)
    except FileNotFoundError:
        return None
    if len(raw) != HEAD_SIZE:
        raise CorruptFileError(
            f"{source}: write-ahead log head file is {len(raw)} bytes, not {HEAD_SIZE}"
        )
    magic, version, state, _reserved, newest, last = HEAD.unpack_from(raw)
    if magic != HEAD_MAGIC:
        raise CorruptFileError(f"{source}: not a write-ahead log head file (magic {magic!r})")
    if version > HEAD_VERSION:
        raise UnsupportedFormatError(
            f"{source}: log head version {version} is newer than this dedupcore reads "
            f"({HEAD_VERSION}); upgrade dedupcore"
        )
    if CHECKSUM.unpack_from(raw, HEAD.size)[0] != _core.hash64(raw[: HEAD.size]):
        raise CorruptFileError(f"{source}: write-ahead log head checksum mismatch")
    if version != HEAD_VERSION or state not in (_HEAD_OPEN, _HEAD_CLEAN) or newest < 1:
        raise CorruptFileError(f"{source}: invalid write-ahead log head fields")
    return LogHead(newest, state == _HEAD_CLEAN, last)
