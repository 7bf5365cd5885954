"""State machine with compare-and-set: an event moves a row's status at most once.

When the business object has a lifecycle (order: created -> paid -> shipped),
the status column itself makes a consumer idempotent: a redelivered "pay"
finds the order already paid, and an illegal transition is refused. The
update is a compare-and-set on status *and* version::

    UPDATE orders SET status = 'paid', version = version + 1
    WHERE id = 42 AND status = 'created' AND version = 3

Example::

    from dedupcore.patterns.state import StateMachine, TransitionOutcome

    orders = StateMachine(
        {"created": {"pay": "paid", "cancel": "cancelled"},
         "paid": {"ship": "shipped", "refund": "created"}},
        table="orders",
    )
    t = orders.apply(conn, 42, "pay")
    if t.outcome is TransitionOutcome.APPLIED:
        ...  # first delivery: side effects in the same transaction
    conn.commit()

Outcomes (:class:`Transition`):

- APPLIED -- the row moved; ``status``/``version`` are the new ones.
- REJECTED -- the event is not allowed in the row's status (an event
  delivered again after it was applied lands here: the idempotent case), or
  it is stale: ``expected_version`` differs from the row's version, or its
  timestamp ``at`` is older than the row's last update (``updated_column``).
  Retrying does not help; ack the message. ``reason`` says which.
- CONFLICT -- another transaction changed the row between this call's read
  and its update (the compare-and-set found nothing); ``status``/``version``
  are re-read. Apply again to decide against the new state.

**ABA.** With statuses alone, "close" computed against an open order would
still apply after close -> reopen brought the order back to "open". Pass the
version the event was computed against as ``expected_version``: the version
grows on every transition, so A -> B -> A is a different row version and the
stale event is REJECTED.

**Late events.** With ``updated_column``, ``apply(..., at=ts)`` writes the
event's timestamp there and rejects an event older than the row's last
update. ``at`` is a ``datetime`` (a naive one, or a naive value read from a
MariaDB ``DATETIME``, counts as UTC) or unix seconds; store it in a column of
the matching type. Without ``at`` the timestamp is neither checked nor written.

**Transactions.** :meth:`StateMachine.apply` runs in the caller's
transaction and never commits, so the transition commits together with the
caller's other writes (e.g. inside :func:`dedupcore.patterns.table.consume`).
On an autocommit connection each statement commits on its own; the
compare-and-set is still safe. Under PostgreSQL ``REPEATABLE READ`` or
``SERIALIZABLE`` a lost race raises a serialization failure instead of
CONFLICT. On SQLite a transaction that already read and then must wait for
the writer lock gets "database is locked": do not hold a read transaction
open across ``apply`` (the default sqlite3 mode, which begins at the first
write, is fine).

The table needs ``id_column``, ``status_column`` (text), ``version_column``
(an integer) and, when given, ``updated_column``; they are looked up in the
catalog once per (driver, table) and a missing table or column is a
:class:`~dedupcore.patterns.unique.SchemaError`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from dedupcore.patterns.unique import Conn, check_identifier, require_columns, table_info

__all__ = ["StateMachine", "Transition", "TransitionOutcome"]


class TransitionOutcome(enum.Enum):
    """What :meth:`StateMachine.apply` did."""

    APPLIED = "applied"  #: the row moved to the event's target status
    REJECTED = "rejected"  #: illegal, already applied, stale version or late event
    CONFLICT = "conflict"  #: the compare-and-set lost a race; status/version re-read


@dataclass(frozen=True, slots=True)
class Transition:
    """The answer of :meth:`StateMachine.apply`.

    ``status`` and ``version`` are the row's current ones (after the
    transition when APPLIED); ``previous`` the status the event was decided
    against. ``reason`` is ``""`` when APPLIED, else ``"illegal"`` (not
    allowed in the status), ``"stale_version"`` (``expected_version``
    differs), ``"late"`` (``at`` older than the last update) or
    ``"lost_race"`` (CONFLICT).
    """

    outcome: TransitionOutcome
    id: Any
    event: str
    status: str
    version: int
    previous: str
    reason: str = ""

    @property
    def applied(self) -> bool:
        return self.outcome is TransitionOutcome.APPLIED


def _epoch(value: object) -> float:
    """Seconds since the epoch of a timestamp as given or as the driver returns it."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.timestamp()
    if isinstance(value, str):  # SQLite stores datetimes as ISO text
        return _epoch(datetime.fromisoformat(value))
    if isinstance(value, (int, float, Decimal)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"a timestamp must be a datetime or unix seconds, not {type(value).__name__}")


class StateMachine:
    """Transitions ``state -> event -> new state`` applied to rows by compare-and-set.

    See the module docstring. Statuses and events are strings; every status
    reachable as a target is a state even without outgoing events.
    """

    def __init__(
        self,
        transitions: Mapping[str, Mapping[str, str]],
        table: str,
        *,
        id_column: str = "id",
        status_column: str = "status",
        version_column: str = "version",
        updated_column: str | None = None,
    ) -> None:
        if not isinstance(transitions, Mapping):
            raise TypeError(
                "transitions must be a mapping state -> {event: new state}, not "
                f"{type(transitions).__name__}"
            )
        if not transitions:
            raise ValueError("transitions must not be empty")
        table_: dict[str, dict[str, str]] = {}
        for state, events in transitions.items():
            if not isinstance(state, str) or not state:
                raise TypeError(f"states must be non-empty str, got {state!r}")
            if not isinstance(events, Mapping):
                raise TypeError(
                    f"transitions[{state!r}] must be a mapping event -> new state, "
                    f"not {type(events).__name__}"
                )
            for event, target in events.items():
                for what, v in (("event", event), ("target state", target)):
                    if not isinstance(v, str) or not v:
                        raise TypeError(
                            f"{what} of state {state!r} must be non-empty str, got {v!r}"
                        )
            table_[state] = dict(events)
        self.transitions = table_
        self.states = frozenset(table_) | {t for ev in table_.values() for t in ev.values()}
        self.events = frozenset(e for ev in table_.values() for e in ev)
        self.table = check_identifier(table, "table")
        self.id_column = check_identifier(id_column, "id_column")
        self.status_column = check_identifier(status_column, "status_column")
        self.version_column = check_identifier(version_column, "version_column")
        self.updated_column = (
            None if updated_column is None else check_identifier(updated_column, "updated_column")
        )
        columns = [self.id_column, self.status_column, self.version_column]
        if self.updated_column is not None:
            columns.append(self.updated_column)
        if len(set(columns)) != len(columns):
            raise ValueError(f"the columns must be distinct, got {columns}")
        self._columns = columns

    def target(self, status: str, event: str) -> str | None:
        """The status ``event`` moves ``status`` to, or None when it is not allowed."""
        return self.transitions.get(status, {}).get(event)

    def _read_row(self, c: Conn, id: Any, *, lock: bool) -> tuple[Any, ...] | None:
        q, p = c.q, c.ph
        cols = ", ".join(q(col) for col in self._columns[1:])
        sql = f"SELECT {cols} FROM {q(self.table)} WHERE {q(self.id_column)} = {p}"
        if lock:
            sql += c.dialect.read_latest  # the latest committed row, not the snapshot's
        _, rows = c.execute(sql, [id])
        return rows[0] if rows else None

    def _status(self, row: tuple[Any, ...], id: Any) -> tuple[str, int]:
        status, version = row[0], row[1]
        if status not in self.states:
            raise ValueError(
                f"row {self.id_column}={id!r} of {self.table!r} has status {status!r}, which is "
                f"not a state of this machine (states: {', '.join(sorted(self.states))})"
            )
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(
                f"column {self.version_column!r} of {self.table!r} must hold integers, "
                f"got {version!r}"
            )
        return str(status), int(version)

    def apply(
        self,
        conn: Any,
        id: Any,
        event: str,
        *,
        at: datetime | float | None = None,
        expected_version: int | None = None,
    ) -> Transition:
        """Applies ``event`` to the row ``id`` by compare-and-set; never commits.

        ``expected_version`` (the version the event was computed against)
        rejects stale events, A -> B -> A included; ``at`` rejects events older
        than the row's last update (needs ``updated_column``). ValueError for
        an unknown event or a status that is not a state; LookupError when no
        row has that id.
        """
        if not isinstance(event, str):
            raise TypeError(f"event must be str, not {type(event).__name__}")
        if event not in self.events:
            raise ValueError(f"unknown event {event!r} (events: {', '.join(sorted(self.events))})")
        if expected_version is not None and (
            isinstance(expected_version, bool) or not isinstance(expected_version, int)
        ):
            raise TypeError(
                f"expected_version must be an int, not {type(expected_version).__name__}"
            )
        at_s: float | None = None
        if at is not None:
            if self.updated_column is None:
                raise ValueError("at= needs a StateMachine with updated_column")
            if isinstance(at, bool) or not isinstance(at, (datetime, int, float)):
                raise TypeError(f"at must be a datetime or unix seconds, not {type(at).__name__}")
            at_s = _epoch(at)
        if id is None:
            raise ValueError("id must not be None")
        c = Conn(conn)
        info = table_info(c, self.table)
        require_columns(c, self.table, info, self._columns)
        row = self._read_row(c, id, lock=False)
        if row is None:
            raise LookupError(f"no row with {self.id_column} = {id!r} in {self.table!r}")
        status, version = self._status(row, id)

        def rejected(reason: str) -> Transition:
            return Transition(
                TransitionOutcome.REJECTED, id, event, status, version, status, reason
            )

        if expected_version is not None and expected_version != version:
            return rejected("stale_version")
        target = self.target(status, event)
        if target is None:
            return rejected("illegal")
        if at_s is not None and row[2] is not None and at_s < _epoch(row[2]):
            return rejected("late")
        q, p = c.q, c.ph
        v = q(self.version_column)
        sets = f"{q(self.status_column)} = {p}, {v} = {v} + 1"
        params: list[Any] = [target]
        if at is not None:
            sets += f", {q(self.updated_column or '')} = {p}"
            params.append(at)
        count, _ = c.execute(
            f"UPDATE {q(self.table)} SET {sets} WHERE {q(self.id_column)} = {p} "
            f"AND {q(self.status_column)} = {p} AND {q(self.version_column)} = {p}",
            [*params, id, status, version],
        )
        if count == 1:
            return Transition(TransitionOutcome.APPLIED, id, event, target, version + 1, status)
        now = self._read_row(c, id, lock=True)
        if now is None:
            raise LookupError(
                f"row {self.id_column} = {id!r} of {self.table!r} was deleted during apply"
            )
        cur_status, cur_version = self._status(now, id)
        return Transition(
            TransitionOutcome.CONFLICT, id, event, cur_status, cur_version, status, "lost_race"
        )
