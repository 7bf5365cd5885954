"""Partitions by event time (docs/sql-partitions.md): where a key lives, and its lookup.

Declarative ``RANGE`` partitions make retention a ``DROP`` of old partitions
(:func:`dedupcore.sql.retention.drop_partitions`). Both PostgreSQL and
MariaDB require the partition key in every unique constraint, so a
partitioned table's primary key is ``(namespace, key, part)``. Were
``part`` the arrival day, a redelivery on a later day would insert a second
row and be answered NEW. So ``part`` comes from a time that every delivery
of a message shares: the ``event_time`` passed with the claim, or the time
inside the key (``key_time``, default: a time-ordered id's, :func:`id_time`).

A claim (:meth:`Partitions.claim`) looks the key up in every partition its
``partition_tolerance`` interval touches; keys near a boundary lock an edge
row (the ``_edge`` table) first, so two deliveries on both sides of a
boundary cannot both insert. The horizon (the ``_parts`` table) is held
shared by claims and moved, exclusively, by a drop: a claim for an event
time before it raises :class:`~dedupcore.errors.PartitionDroppedError`.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from dedupcore.api import Claim
from dedupcore.errors import PartitionDroppedError, SchemaError
from dedupcore.ids import time_of
from dedupcore.sql.claims import Batch, Habits, Row, decide, insert_absent, locked_row
from dedupcore.sql.dialects.base import PROCESSED
from dedupcore.sql.transactions import Retry, Transactions

__all__ = [
    "DEFAULT_TOLERANCE",
    "PARTITION_SPANS",
    "Partitions",
    "check_event_time",
    "check_event_times",
    "check_tolerance",
    "floor",
    "id_time",
]

log = logging.getLogger("dedupcore")

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


def check_tolerance(value: object, span: int | None) -> float:
    """A ``partition_tolerance``: seconds in ``[0, span)`` (a day without a span)."""
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


def floor(t: float, span: int) -> int:
    """The start of the partition holding ``t``."""
    return int(t // span) * span


def check_event_times(
    keys: list[Any], event_times: Sequence[float | datetime.datetime] | None
) -> list[float] | None:
    """A batch's event times (one per key), checked; None when none were given."""
    if event_times is None:
        return None
    if isinstance(event_times, (str, bytes)) or not isinstance(event_times, Sequence):
        raise TypeError(
            f"event_times must be a sequence, one per key, not {type(event_times).__name__}"
        )
    if len(event_times) != len(keys):
        raise ValueError(f"event_times has {len(event_times)} values for {len(keys)} keys")
    return [check_event_time(t) for t in event_times]


class Partitions:
    """The partitions of one store's table: the span, creating them, a claim in them.

    ``partition``: ``"day"`` or ``"hour"``; ``window()``: the longest exact
    window of the store's namespaces; ``clock()``: unix seconds, what
    partitions are created and dropped by.
    """

    def __init__(
        self,
        tx: Transactions,
        table: str,
        partition: str,
        *,
        tolerance: float,
        ahead: int,
        key_time: Callable[[bytes | str], float] | None,
        clock: Callable[[], float],
        window: Callable[[], float],
    ) -> None:
        self.tx = tx
        self.table = table
        self.partition = partition
        self.span = PARTITION_SPANS[partition]
        self.tolerance = tolerance
        self.ahead = ahead
        self.key_time = key_time
        self.clock = clock
        self._window = window
        #: The partition starts last read (or created).
        self.known: list[int] = []

    def key_times(self, keys: list[Any]) -> list[float]:
        """Each key's event time from ``key_time`` (ValueError when it cannot tell)."""
        key_time = self.key_time
        if key_time is None:
            raise ValueError(
                f"table {self.table!r} is partitioned by event time: pass event_time(s)= "
                "or give the store a key_time"
            )
        out: list[float] = []
        for key in keys:
            try:
                t = key_time(key)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"no event time for key {key!r}: the table is partitioned by event time "
                    f"and key_time could not read the key ({exc}); pass event_time(s)="
                ) from None
            out.append(check_event_time(t, "key_time(key)"))
        return out

    def oldest(self, now: float) -> int:
        """The oldest partition kept at ``now``: the exact window and the tolerance back."""
        return floor(now - self._window() - self.tolerance, self.span)

    def now(self, now: float | None) -> float:
        """``now`` checked, or the clock's time."""
        return self.clock() if now is None else check_event_time(now, "now")

    def check_span(self) -> None:
        """SchemaError when the table was made with another span."""
        d = self.tx.dialect
        rows = self.tx.run(
            lambda cur: (
                cur.execute(f"SELECT span FROM {d.q(self.table + '_parts')} WHERE id = 1"),
                cur.fetchall(),
            )[1],
            write=False,
        )
        if not rows or int(rows[0][0]) != self.span:
            raise SchemaError(
                f"table {self.table!r} is partitioned by {rows[0][0] if rows else '?'} s, "
                f"not by {self.partition} ({self.span} s)"
            )

    def starts(self) -> list[int]:
        """The starts of the table's partitions, read from the database."""
        d = self.tx.dialect
        self.known = self.tx.run(lambda cur: d.part_list(cur, self.table), write=False)
        return list(self.known)

    def horizon(self) -> int:
        """Partitions before this start are dropped or being dropped."""
        d = self.tx.dialect
        return self.tx.run(lambda cur: d.part_guard(cur, self.table, False), write=False)

    def ensure(self, now: float | None = None) -> list[int]:
        """Creates the partitions up to ``ahead`` after ``now``'s; returns all starts."""
        return self.ensure_upto(floor(self.now(now), self.span) + self.ahead * self.span)

    def ensure_upto(self, top: int) -> list[int]:
        """Creates the partitions from the horizon to ``top``; returns all starts."""
        d, span = self.tx.dialect, self.span

        def body(cur: Any) -> list[int]:
            have = d.part_list(cur, self.table)
            horizon = d.part_guard(cur, self.table, False)
            want = d.missing_parts(have, horizon, top, span)
            if want:
                try:
                    d.part_create(cur, self.table, want, span)
                except d.error_classes() as exc:
                    # Another store created (some of) them first: read the list again.
                    log.info("SQL authority (%s): creating partitions: %s", d.name, exc)
                    raise Retry from exc
            return sorted({*have, *want})

        self.known = self.tx.run(body)
        return list(self.known)

    def claim(self, b: Batch, times: list[float], habits: Habits) -> list[Claim]:
        """A claim batch (docs/sql-partitions.md, "The lookup"); ``times``: one per key."""
        span, tol, d, table, ns = self.span, self.tolerance, self.tx.dialect, self.table, b.ns
        first_t: dict[bytes, float] = {}
        for k, t in zip(b.raw, times, strict=True):
            first_t.setdefault(k, t)  # a key repeated in the batch: its first event time
        unique = b.unique
        home = {k: floor(t, span) for k, t in first_t.items()}
        lo_of = {k: floor(t - tol, span) for k, t in first_t.items()}
        hi_of = {k: floor(t + tol, span) for k, t in first_t.items()}
        edges = sorted({(k, e) for k in unique for e in range(lo_of[k] + span, hi_of[k] + 1, span)})
        self._place(set(home.values()), max(first_t.values()))

        if habits.read_first(ns):
            # As an unpartitioned claim: a batch that is all PROCESSED is answered by one
            # unlocked read (a PROCESSED row is final), without a write transaction.
            lo, hi = min(lo_of.values()), max(hi_of.values())
            done: dict[bytes, tuple[Any, ...]] = {}
            for row in self.tx.run(
                lambda cur: d.select_rows(cur, table, ns, unique, (lo, hi), lock=False),
                write=False,
            ):
                k, part = bytes(row[0]), int(row[1])
                if int(row[2]) == PROCESSED and lo_of[k] <= part <= hi_of[k]:
                    done.setdefault(k, row)
            if len(done) == len(unique):
                claims = b.duplicates({k: (r[3], r[5], r[6]) for k, r in done.items()})
                habits.count(ns, claims)
                return claims
        plain = [habits.plain(ns)]
        seen: list[int] = []

        def body(cur: Any) -> list[Claim]:
            horizon = d.part_guard(cur, table, False)
            old = [k for k in unique if home[k] < horizon]
            if old:
                raise PartitionDroppedError(
                    f"event time {first_t[old[0]]!r} of key {old[0]!r} is in a dropped "
                    f"partition (before {horizon}): older than the exact window"
                )
            current: dict[bytes, Row | None] = {}
            parts: dict[bytes, int] = {}
            found: dict[bytes, list[tuple[Any, ...]]] = {}
            # A key whose interval lies in its own partition is found (or created) there
            # by the INSERT below; only keys near a boundary are looked up first.
            near = sorted({k for k, _ in edges})
            if near:
                d.lock_edges(cur, table, ns, edges)
                lo, hi = min(lo_of[k] for k in near), max(hi_of[k] for k in near)
            for row in d.select_rows(cur, table, ns, near, (lo, hi)) if near else ():
                k, part = bytes(row[0]), int(row[1])
                if not lo_of[k] <= part <= hi_of[k]:
                    continue  # outside this key's tolerance interval
                if part < horizon and int(row[2]) != PROCESSED:
                    continue  # a partition being dropped: only its processed keys count
                found.setdefault(k, []).append(row)
            for k, rows in found.items():
                h = home[k]
                best = min(
                    rows,
                    key=lambda r: (int(r[2]) != PROCESSED, int(r[1]) != h, abs(int(r[1]) - h)),
                )
                current[k] = Row.of(*best[2:8])
                parts[k] = int(best[1])
            absent = [k for k in unique if k not in current]
            if absent:
                nonce = os.urandom(16)
                homes = [home[k] for k in absent]
                created = insert_absent(d, cur, table, b, absent, nonce, homes, plain, seen)
                if created is not None:
                    seen.append(len(unique) - len(created))
                if created is not None and len(created) == len(unique) == len(b.raw):
                    return b.all_new()
                for k in absent:
                    parts[k] = home[k]
                    if created is not None and k in created:
                        current[k] = None
                again = [k for k in absent if k not in current]
                if again:  # created concurrently in the same partition, or MariaDB's nonce
                    homes = [home[k] for k in again]
                    mark = nonce if created is None else None
                    for row in d.select_rows(cur, table, ns, again, (min(homes), max(homes))):
                        k, part = bytes(row[0]), int(row[1])
                        if k in home and part == home[k]:
                            current[k] = locked_row(row[2:8], mark)
                if len(current) != len(unique):
                    raise Retry  # cannot happen under the edge and row locks; be safe
            return decide(d, cur, table, b, current, parts)

        claims = self.tx.run(body)
        habits.follow_seen(ns, seen, len(unique))
        habits.count(ns, claims)
        return claims

    def _place(self, homes: set[int], latest: float) -> None:
        """Creates the missing partitions of ``homes`` (ValueError: too far ahead of the clock).

        Partitions before the horizon stay missing: the claim's transaction refuses them.
        """
        span = self.span
        missing = homes.difference(self.known)
        if missing:
            missing.difference_update(self.starts())  # made by another store?
        if not missing:
            return
        top = max(missing)
        if top > floor(self.clock(), span) + self.ahead * span:
            raise ValueError(
                f"event time {latest!r} is more than {self.ahead} "
                f"partitions ahead of the store's clock: it cannot be placed"
            )
        self.ensure_upto(max(top, self.known[-1] if self.known else top))
