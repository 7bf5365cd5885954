"""Partitions by event time (docs/sql-partitions.md): spans, event times, tolerances."""

from __future__ import annotations

import datetime

from dedupcore.ids import time_of

#: Seconds an event time may differ between deliveries of one message and still find
#: its first claim across a partition boundary (docs/sql-partitions.md).
DEFAULT_TOLERANCE = 300.0
#: Seconds per partition of ``SqlStore(partition=...)``.
PARTITION_SPANS = {"day": 86400, "hour": 3600}


def id_time(key: bytes | str) -> float:
    """The time inside a time-ordered id (:mod:`dedupcore.ids`), in unix seconds."""
    return time_of(key) / 1000.0


def check_event_time(value: object, what: str = "event_time") -> float:
    """An event time as unix seconds: an int or float, or an aware ``datetime``."""
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            raise ValueError(f"{what} must be an aware datetime (with tzinfo), got {value!r}")
        value = value.timestamp()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{what} must be unix seconds (int or float) or an aware datetime, "
            f"not {type(value).__name__}"
        )
    t = float(value)
    if not 0.0 <= t < _MAX_EVENT_TIME:
        raise ValueError(f"{what} must be unix seconds in 0..{_MAX_EVENT_TIME:.0f}, got {value!r}")
    return t


_MAX_EVENT_TIME = 253402300800.0  # 10000-01-01


def _check_tolerance(value: object, span: int | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"partition_tolerance must be seconds (int or float), not {type(value).__name__}"
        )
    t = float(value)
    if not 0.0 <= t < (span if span is not None else 86400):
        raise ValueError(
            f"partition_tolerance must be seconds in [0, the partition's span), got {value!r}"
        )
    return t


def _floor(t: float, span: int) -> int:
    """The start of the partition holding ``t``."""
    return int(t // span) * span
