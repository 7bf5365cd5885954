"""The daemon's JSON log lines keep an exception's traceback and a logged stack
(docs/daemon.md, "The log")."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from dedupcore.cli.serve import _JsonFormatter


@pytest.fixture
def lines() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger of its own whose records go through the daemon's formatter."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(_JsonFormatter())
    logger = logging.getLogger("dedupcore.test-log-format")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    try:
        yield logger, out
    finally:
        logger.removeHandler(handler)


def _entries(out: io.StringIO) -> list[dict[str, Any]]:
    text = out.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]  # one object a line


def _checkpoint() -> None:
    try:
        raise OSError(28, "No space left on device")
    except OSError as exc:
        raise RuntimeError("checkpoint could not write LMDB") from exc


def test_a_record_with_exc_info_carries_the_traceback_and_its_cause(
    lines: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = lines
    try:
        _checkpoint()
    except RuntimeError:
        logger.exception("background checkpoint/sweep/compaction failed; will retry")
    [entry] = _entries(out)
    assert entry["level"] == "ERROR"
    assert entry["msg"] == "background checkpoint/sweep/compaction failed; will retry"
    exc = entry["exc"]
    assert exc.startswith("Traceback (most recent call last):")
    assert "OSError: [Errno 28] No space left on device" in exc  # the cause
    assert "direct cause of the following exception" in exc
    assert exc.rstrip().endswith("RuntimeError: checkpoint could not write LMDB")
    assert "in _checkpoint" in exc
    assert "stack" not in entry


def test_a_record_with_stack_info_carries_the_stack(
    lines: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = lines
    logger.warning("slow commit: %d ms", 250, stack_info=True)
    [entry] = _entries(out)
    assert entry["msg"] == "slow commit: 250 ms"
    assert entry["stack"].startswith("Stack (most recent call last):")
    assert "test_a_record_with_stack_info_carries_the_stack" in entry["stack"]
    assert "exc" not in entry


def test_a_plain_record_has_the_four_fields(lines: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = lines
    logger.info("serving %r", "x")
    [entry] = _entries(out)
    assert set(entry) == {"ts", "level", "logger", "msg"}
    assert entry["logger"] == "dedupcore.test-log-format" and entry["msg"] == "serving 'x'"
