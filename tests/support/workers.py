"""What the worker processes of the framework kill tests share (Celery, Dramatiq,
FastStream): lines for the test to read, a once-per-run marker, and the pause at a
named point where the test kills the worker (tests/README.md, "Nothing left to luck")."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["first", "paused", "say"]


_said = threading.Lock()


def say(line: str) -> None:
    """A line for the test, written whole and flushed at once (it reads the worker's
    output line by line; two threads printing at once would interleave a text and its
    newline, as ``print`` writes them apart)."""
    with _said:
        sys.stdout.write(f"{line}\n")
        sys.stdout.flush()


def first(home: Path, name: str) -> bool:
    """True the first time any run of any worker process asks for ``name`` under ``home``."""
    try:
        os.close(os.open(home / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def paused(home: Path, item: Any, point: str, *, pid: bool = False) -> str | None:
    """The key of ``item`` when it asks to pause at ``point`` (``{"id": ..., "pause":
    point}``) and no run paused there before, after saying ``PAUSED <key> <point>`` (and
    the process id with ``pid``); else None. The caller then waits to be killed."""
    if not isinstance(item, dict) or item.get("pause") != point:
        return None
    key = str(item["id"])
    if not first(home, f"paused-{key}-{point}"):
        return None
    say(f"PAUSED {key} {point} {os.getpid()}" if pid else f"PAUSED {key} {point}")
    return key
