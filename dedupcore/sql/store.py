"""A relational database as the dedup authority: PostgreSQL, MariaDB/MySQL or SQLite.

One table (``dedup`` unless told otherwise) holds the record of the embedded
store (:class:`~dedupcore.api.KeyRecord`) per ``(namespace, key)``::

    namespace    text / VARCHAR(128) ascii_bin / TEXT      primary key, part 1
    key          bytea / VARBINARY(512) / BLOB              primary key, part 2
    state        1 PROCESSING, 2 PROCESSED, 3 RELEASED (a tombstone)
    token        fencing token (BIGINT), grows on every new owner
    owner        the claim's owner, NULL when none was given
    fingerprint  the fingerprint of the request that created the claim
    result       msgpack result of a PROCESSED record (see "MariaDB" below)
    lease_until  end of the lease, on the database server's clock
    created      first claim, server clock (kept by a takeover; a claim after a release
                 starts a fresh record)
    updated      last change, server clock (indexed: :meth:`SqlStore.purge`)

Times are ``timestamptz`` on PostgreSQL, ``DATETIME(6)`` in UTC on MariaDB
(each session sets ``time_zone = '+00:00'``) and unix seconds (``REAL``,
from ``julianday('now')``) on SQLite. Lease deadlines are computed and
compared by the database server (``clock_timestamp()``/``now()``,
``CURRENT_TIMESTAMP(6)``), not by the clients: with many hosts sharing the
authority, the server's clock is the one clock they all see (as the Redis
tier uses ``TIME``), so hosts with skewed clocks agree on whose lease is over.

**One transaction per batch.** ``claim_many`` creates every key of the batch
that has no row with one multi-row ``INSERT .. ON CONFLICT DO NOTHING
RETURNING key`` (PostgreSQL: over ``unnest`` of two arrays, any batch size
in one statement; SQLite: multi-row ``VALUES``) or ``INSERT .. ON DUPLICATE
KEY UPDATE `key` = `key``` (MariaDB/MySQL: multi-row ``VALUES``, 1000 rows
per statement; never ``INSERT IGNORE``, which would turn every error into a
warning), then reads the batch's other rows with ``SELECT .. ORDER BY key
FOR UPDATE`` (SQLite: the whole transaction is ``BEGIN IMMEDIATE``), decides
every key with :func:`dedupcore.decision.decide_claim` (the reference the
embedded store's engine is checked against), and applies takeovers,
tombstone re-claims and lease renewals with batched ``UPDATE`` statements
(PostgreSQL: ``UPDATE .. FROM unnest(..)``; MariaDB: a join with a derived
table; SQLite: ``executemany``) before ``COMMIT``.
Completions and releases are one ``SELECT .. FOR UPDATE`` and one batched
``UPDATE``. A fingerprint conflict or a stale token raises inside the
transaction, which is rolled back: nothing of the batch is written.

**PostgreSQL adapts per namespace.** A namespace whose recent batches (an
exponential average) found no existing row sends a plain multi-row
``INSERT`` (no ``ON CONFLICT``: no speculative insertion); an existing key
makes it fail with a unique violation, and the transaction, whose first
statement it was, is rolled back and run again as above. A namespace whose
recent batches were mostly DUPLICATE (average share above 1/2) reads the batch
first with one ``SELECT`` without locks and outside any transaction: a
PROCESSED row is final (only :meth:`SqlStore.purge` changes it, by deleting
it, and a processed key answered DUPLICATE just before retention drops it is
what retention means anyway), so a batch of PROCESSED keys is answered from
that read alone, with no write transaction and no WAL flush; a fingerprint
conflict with a PROCESSED row raises before anything is written. Otherwise
the absent keys are inserted if absent and the other non-PROCESSED keys (and
keys created concurrently since the read) are locked and decided as above; a
row read as existing that has vanished by then (purged) runs the transaction
again, inserting every non-PROCESSED key. The first batch of a namespace is
always insert-first. Arrays of keys are sent in binary.

Keys are inserted and locked in sorted order, so on PostgreSQL concurrent
batches over overlapping keys queue behind each other instead of
deadlocking. InnoDB's duplicate-key checks also take gap locks, which can
still deadlock; every deadlock or serialization failure the server reports
(PostgreSQL ``40001``/``40P01``, MariaDB ``1213``/``1205``) has rolled the
whole transaction back, and it is retried (``retries`` times, with backoff).

**MariaDB has no "RETURNING the rows actually inserted"** (its ``INSERT ..
RETURNING`` also returns the rows the ``ON DUPLICATE KEY`` clause touched).
So each claim transaction writes a random 16-byte nonce into the ``result``
column of the rows it creates; the ``SELECT .. FOR UPDATE`` then tells the
rows this batch created (its nonce) from rows another claim created. A
PROCESSING row's ``result`` is therefore not meaningful and is never read;
``complete`` overwrites it and re-claims clear it.

**Fail closed.** A driver error (connection refused, lost or killed, server
restarting) raises :class:`~dedupcore.errors.UnavailableError`, never NEW.
A connection that failed is closed and dropped; the next call opens a new
one through the connection factory. A claim or completion whose ``COMMIT``
was cut off may or may not have been applied: the caller gets
``UnavailableError`` and may retry (an owner gets its own claim back, a
completion with the same token is a no-op). A store from
:meth:`SqlStore.from_url` connects on its first call (a database that is
down fails that call, not the open) and gives each call one deadline
(``timeout``, 5 s; see there and docs/timeouts.md), so a server that stops
answering fails a call within ``timeout``, connects and retries included,
instead of blocking it. A database error that refuses the request's
own data (out of range, too long, a CHECK) is a
:class:`~dedupcore.errors.RequestRefusedError`, a ``ValueError``: the
arguments are all checked before they are sent, so it only happens when the
table does not have the shape :meth:`SqlStore.init_schema` gives it.

**Partitions by event time.** Declarative ``RANGE`` partitions make
retention a ``DROP`` of old partitions. Both PostgreSQL and MariaDB require
the partition key in every unique constraint, so a partitioned table's
primary key is ``(namespace, key, part)``. Were ``part`` the arrival day, a
redelivery on a later day would insert a second row and be answered NEW. So
``SqlStore(partition="day" | "hour")`` takes ``part`` from a time that every
delivery of a message shares: the ``event_time`` passed with the claim, or
the time inside the key (``key_time``, default: a time-ordered id's,
:func:`id_time`). A claim looks the key up in every partition its
``partition_tolerance`` interval touches (keys near a boundary lock an edge
row first, so two deliveries on both sides of a boundary cannot both insert),
and :meth:`SqlStore.drop_partitions` moves a horizon that claims hold shared,
passes the old partitions' PROCESSED keys to ``before_delete`` and drops
them whole. docs/sql-partitions.md has the layout, the exact lookup rule and
what it guarantees. An unpartitioned table (the default, and SQLite's only
kind) is keyed by ``(namespace, key)``, and retention is
:meth:`SqlStore.purge`: bounded batches of deletes driven by the ``updated``
index (abandoned claims become tombstones first, as the embedded store's
sweep does), with a ``before_delete`` hook that copies each batch's
processed keys into the cold archive before the delete commits.

Use :meth:`SqlStore.from_url` (``postgresql://``, ``mysql://`` or
``mariadb://``, ``sqlite:///relative.db`` / ``sqlite:////absolute.db``) or
pass a DB-API connection factory; call :meth:`SqlStore.init_schema` once
to create the table. (``sqlite:///:memory:`` works, but every reconnect
then starts from an empty database.)

Where each part lives: the SQL of each engine in :mod:`dedupcore.sql.dialects`;
the connection, the deadline and the retries in
:mod:`dedupcore.sql.transactions` (the watchdog in :mod:`dedupcore.sql.watchdog`);
the claim transaction in :mod:`dedupcore.sql.claims`; partitions in
:mod:`dedupcore.sql.partitions`; purging and dropping in
:mod:`dedupcore.sql.retention`. This module checks the arguments and puts
them together.
"""

from __future__ import annotations

import datetime
import functools
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import dedupcore.sql.retention as _retention
from dedupcore.api.answers import Claim, KeyRecord
from dedupcore.api.batches import ChangeBatch, ClaimBatch, ExtendBatch, Limits, unpack_result
from dedupcore.api.contract import ClaimAPI
from dedupcore.config import Retention, check_lease
from dedupcore.errors import SchemaError
from dedupcore.record import State
from dedupcore.retry import one_call
from dedupcore.sql.claims import Batch, Habits, change, claim_flat, extend
from dedupcore.sql.dialects import DEFAULT_TIMEOUT, DIALECTS, Dialect, connect_url, dialect_of
from dedupcore.sql.dialects.base import PROCESSED, RELEASED
from dedupcore.sql.partitions import (
    DEFAULT_TOLERANCE,
    PARTITION_SPANS,
    Partitions,
    check_event_times,
    check_tolerance,
    id_time,
)
from dedupcore.sql.retention import BeforeDelete, check_purge
from dedupcore.sql.transactions import Transactions
from dedupcore.sql.watchdog import Watchdog
from dedupcore.tiers.base import check_limit, check_retention, check_timeout

__all__ = ["SqlStore"]

T = TypeVar("T")

_TABLE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}\Z")


class SqlStore(ClaimAPI):
    """A dedup store whose authority is a SQL table (see the module docstring).

    ``connect`` is a DB-API connection factory (psycopg 3, PyMySQL or
    sqlite3); the store owns the connections it makes, one at a time, and
    serializes its calls on it. ``dialect`` is guessed from the connection's
    driver when not given (which takes a connection at once); with a
    ``dialect`` nothing is sent before the first call, so a store opens
    while its database is down and its first call fails closed. Or use
    :meth:`from_url`. ``timeout``: the deadline of each call in seconds
    (None, the constructor's default: none; :meth:`from_url` gives 5): a
    call returns or raises :class:`UnavailableError` within ``timeout``,
    connects, deadlock retries and their backoff included
    (docs/timeouts.md). ``hang_timeout``: seconds one transaction may wait
    on a PostgreSQL or MariaDB server before its connection is cut (see
    :class:`~dedupcore.sql.watchdog.Watchdog`), whatever the call's
    deadline; None for no such limit. ``retries``: how often a transaction
    that hit a deadlock runs again (:mod:`dedupcore.sql.transactions`).

    Every argument is checked before it is sent: keys, namespace, owner,
    fingerprints, tokens, leases (at most
    :data:`~dedupcore.config.MAX_LEASE_SECONDS`), retention windows and
    size settings. A database error that refuses the request's data anyway
    (out of range, too long, a CHECK) is a
    :class:`~dedupcore.errors.RequestRefusedError` (a ``ValueError``),
    never an :class:`UnavailableError`.

    ``partition`` (``"day"`` or ``"hour"``; PostgreSQL and MariaDB) keeps the
    table in partitions by each key's event time (docs/sql-partitions.md):
    ``event_time(s)=`` of the claim, else ``key_time(key)`` (unix seconds;
    default :func:`~dedupcore.sql.partitions.id_time`). ``partition_tolerance``:
    seconds two event times of one message may differ and still meet across
    a boundary (``0 <= tolerance < span``); ``partitions_ahead``: partitions
    created after the clock's; ``clock``: the time (unix seconds) partitions
    are created and dropped by.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        *,
        dialect: str | None = None,
        table: str = "dedup",
        retention: Retention | None = None,
        namespaces: dict[str, Retention] | None = None,
        lease: float = 30.0,
        max_key_bytes: int = 512,
        max_result_bytes: int = 65536,
        retries: int = 8,
        timeout: float | None = None,
        hang_timeout: float | None = None,
        partition: str | None = None,
        partition_tolerance: float = DEFAULT_TOLERANCE,
        partitions_ahead: int = 3,
        key_time: Callable[[bytes | str], float] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not callable(connect):
            raise TypeError("connect must be a callable returning a DB-API connection")
        if not isinstance(table, str) or not _TABLE_RE.match(table):
            raise ValueError(
                f"table must be an SQL identifier [A-Za-z_][A-Za-z0-9_]*, got {table!r}"
            )
        if dialect is not None and dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {sorted(DIALECTS)}, got {dialect!r}")
        for name, value in (
            ("max_key_bytes", max_key_bytes),
            ("max_result_bytes", max_result_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_limit("max_key_bytes", max_key_bytes, 65536)
        check_limit("max_result_bytes", max_result_bytes, 16 << 20)
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
            raise ValueError(f"retries must be an int in 0..100, got {retries!r}")
        self.table = table
        self.retention, self.namespaces = check_retention(retention, namespaces)
        self.lease = check_lease(lease)
        self.max_key_bytes = max_key_bytes
        self.max_result_bytes = max_result_bytes
        self.retries = retries
        #: Seconds one call may take (docs/timeouts.md); None: no deadline.
        self.timeout = None if timeout is None else check_timeout(timeout)
        limit = None if hang_timeout is None else check_timeout(hang_timeout, "hang_timeout")
        if partition is not None and partition not in PARTITION_SPANS:
            raise ValueError(
                f"partition must be one of {sorted(PARTITION_SPANS)} or None, got {partition!r}"
            )
        span = None if partition is None else PARTITION_SPANS[partition]
        self.partition = partition
        self.tolerance = check_tolerance(partition_tolerance, span)
        if (
            isinstance(partitions_ahead, bool)
            or not isinstance(partitions_ahead, int)
            or not 1 <= partitions_ahead <= 1000
        ):
            raise ValueError(
                f"partitions_ahead must be an int in 1..1000, got {partitions_ahead!r}"
            )
        self.partitions_ahead = partitions_ahead
        if key_time is not None and not callable(key_time):
            raise TypeError("key_time must be callable(key) -> unix seconds, or None")
        if partition is not None and key_time is None:
            key_time = id_time
        self.key_time = key_time
        if not callable(clock):
            raise TypeError("clock must be callable() -> unix seconds")
        self._session = Transactions(
            connect,
            None if dialect is None else dialect_of(dialect),
            table=table,
            timeout=self.timeout,
            hang_timeout=limit,
            retries=retries,
            on_dialect=self._check_limits,
        )
        self._parts: Partitions | None = None
        if partition is not None:
            self._parts = Partitions(
                self._session,
                table,
                partition,
                tolerance=self.tolerance,
                ahead=partitions_ahead,
                key_time=key_time,
                clock=clock,
                window=self._longest_window,
            )
        if dialect is not None:
            self._check_limits(self._dialect)
        else:
            with self._session.lock:
                self._session.connection()  # learn the dialect (UnavailableError when down)
        self._habits = Habits(self._dialect, self._session.counts)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        connect_args: dict[str, Any] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        **options: Any,
    ) -> SqlStore:
        """A store on ``postgresql://``, ``mysql://``/``mariadb://`` or ``sqlite:///path``.

        Nothing is sent here: a database that is down makes the first call
        fail with :class:`UnavailableError`, not the open.

        ``timeout`` (seconds, default 5) is the deadline of each call: the
        call returns, or raises :class:`UnavailableError`, within
        ``timeout`` (plus the few milliseconds a failure takes to raise),
        connects and retries included. It starts when the call does, and
        each step gets the time left, never a fresh full ``timeout``
        (docs/timeouts.md):

        - a connect is given up at the deadline (the drivers' own connect
          timeouts are whole seconds); the connection arriving later is closed;
        - PostgreSQL: a transaction still waiting at the deadline has its
          connection cut (a stopped server never runs its statement_timeout,
          and psycopg has no wait limit of its own); ``statement_timeout`` is
          ``timeout`` too, and TCP keepalive is on (30 s idle, 10 s apart, 3
          probes);
        - MariaDB/MySQL: each read and write waits at most the time left
          (PyMySQL's ``read_timeout``/``write_timeout``, whose own values
          are the caps), and a transaction still waiting at the deadline has
          its connection cut; PyMySQL turns TCP keepalive on itself;
        - SQLite waits for another writer's lock (its busy wait) at most the
          time left;
        - a deadlock retry starts only while a tenth of ``timeout`` is left,
          and its backoff sleep is cut to the time left.

        The URL's query parameters (``?connect_timeout=2``,
        ``options=-c%20statement_timeout%3D1000``, ``read_timeout=``, ...)
        win over these defaults, and ``connect_args`` (the driver's
        ``connect`` arguments) over both; the deadline of each call stays.
        Other options go to the constructor.
        """
        wait = check_timeout(timeout)
        dialect, factory = connect_url(url, dict(connect_args or {}), wait)
        options.setdefault("timeout", wait)
        return cls(factory, dialect=dialect, **options)

    @property
    def dialect(self) -> str:
        """``"postgresql"``, ``"mysql"`` or ``"sqlite"``."""
        return self._dialect.name

    # The session's parts, by the names the store has always had for them.

    @property
    def _dialect(self) -> Dialect:
        return self._session.dialect

    @property
    def _conn(self) -> Any:
        return self._session.conn

    @property
    def _watchdog(self) -> Watchdog | None:
        return self._session.watchdog

    def _drop(self) -> None:
        """Closes the connection at once (the next call makes a new one)."""
        self._session.drop()

    def _tx(self, body: Callable[[Any], T], *, write: bool = True) -> T:
        """``body(cursor)`` in one transaction (:meth:`Transactions.run`)."""
        return self._session.run(body, write=write)

    def _check_limits(self, d: Dialect) -> None:
        if self.partition is not None and not d.partitions:
            raise ValueError(f"partition={self.partition!r}: {d.name} tables are not partitioned")
        if self.max_key_bytes > d.max_key_bytes:
            raise ValueError(
                f"max_key_bytes={self.max_key_bytes} does not fit the {d.name} key column "
                f"(at most {d.max_key_bytes} bytes)"
            )

    def _longest_window(self) -> float:
        return max(
            [self.retention.exact_window, *(p.exact_window for p in self.namespaces.values())]
        )

    def _partitioned(self) -> Partitions:
        if self._parts is None:
            raise ValueError(f"table {self.table!r} is not partitioned (partition=None)")
        return self._parts

    def durability(self) -> str:
        """What a committed claim survives, from the database server's settings."""
        return self.durability_report()[1]

    def durability_report(self) -> tuple[int, str]:
        """See :func:`~dedupcore.tiers.base.durability_report`."""
        return self._tx(self._dialect.durability, write=False)

    def init_schema(self) -> None:
        """Creates the dedup table and its index if they do not exist (idempotent).

        A partitioned store (``partition=``) also creates its partitions (see
        :meth:`ensure_partitions`). A table that exists with the other kind
        (partitioned or not) is a :class:`SchemaError`.
        """
        d, parts = self._dialect, self._parts

        def create(cur: Any) -> None:
            if parts is None:
                statements = d.schema(self.table)
            else:
                statements = d.part_schema(self.table, parts.oldest(parts.clock()), parts.span)
            for statement in statements:
                cur.execute(statement)

        for setup in d.database_setup:
            self._tx(functools.partial(_execute, sql=setup), write=False)
        self._tx(create)
        if d.partitions:
            parted = self._tx(functools.partial(d.is_partitioned, table=self.table), write=False)
            if parted != (parts is not None):
                raise SchemaError(
                    f"table {self.table!r} exists {'with' if parted else 'without'} partitions; "
                    f"this store has partition={self.partition!r} (use another table)"
                )
        if parts is not None:
            parts.check_span()
            parts.ensure()

    def close(self) -> None:
        """Closes the connection (a later call opens a new one)."""
        self._session.close()

    # -- the claim API --------------------------------------------------------------

    @property
    def limits(self) -> Limits:  # type: ignore[override]
        """The keys' and results' limits it was opened with."""
        return Limits(max_key_bytes=self.max_key_bytes, max_result_bytes=self.max_result_bytes)

    def claim_many(
        self,
        keys: Iterable[bytes | str],
        *,
        event_times: Sequence[float | datetime.datetime] | None = None,
        **options: Any,
    ) -> list[Claim]:
        """Claims a batch of keys of one namespace in one transaction.

        A key repeated in the batch is NEW once; its later copies are
        IN_PROGRESS (or NEW with the same token for an ``owner``). A bad key
        or a fingerprint conflict raises before anything is claimed.

        ``event_times`` (one per key: unix seconds or aware datetimes) place
        the keys of a partitioned table (``partition=``); without them each
        key's time is ``key_time(key)``. An unpartitioned table checks and
        ignores them. See docs/sql-partitions.md. ``wait`` (see
        :meth:`ClaimAPI.claim_many`) is not taken with them.
        """
        if event_times is None:
            return super().claim_many(keys, **options)
        if options.get("wait") is not None:
            raise TypeError("wait= is not taken with event_times=: claim with one of them")
        return self._claim_events(keys, event_times, options)

    @one_call
    def _claim_events(
        self,
        keys: Iterable[bytes | str],
        event_times: Sequence[float | datetime.datetime],
        options: dict[str, Any],
    ) -> list[Claim]:
        options.pop("wait", None)
        batch = ClaimBatch(keys, limits=self.limits, **options)
        return self._claim_at(batch, check_event_times(batch.keys, event_times))

    @one_call
    def _claim_batch(self, batch: ClaimBatch) -> list[Claim]:
        return self._claim_at(batch, None)

    def _claim_at(self, batch: ClaimBatch, times: list[Any] | None) -> list[Claim]:
        """Claims a checked batch at its keys' event times (None: ``key_time``)."""
        key_list = batch.keys
        parts = self._parts
        if parts is not None and times is None:
            times = parts.key_times(key_list)
        if not key_list:
            return []
        lease_s = self.lease if batch.lease is None else batch.lease
        rows = Batch(
            key_list, batch.raw, batch.fingerprint_list(), batch.namespace, batch.owner, lease_s
        )
        if parts is None:
            return claim_flat(self._session, self.table, rows, self._habits)
        assert times is not None
        return parts.claim(rows, times, self._habits)

    def claim(
        self,
        key: bytes | str,
        *,
        event_time: float | datetime.datetime | None = None,
        fingerprint: bytes | None = None,
        **options: Any,
    ) -> Claim:
        """:meth:`ClaimAPI.claim <dedupcore.api.ClaimAPI.claim>` with the key's ``event_time``."""
        return self.claim_many(
            [key],
            fingerprints=None if fingerprint is None else [fingerprint],
            event_times=None if event_time is None else [event_time],
            **options,
        )[0]

    @one_call
    def _change_batch(self, batch: ChangeBatch) -> None:
        """Completes or releases a batch in one transaction (a retried completion is a
        no-op; a stale token rolls the whole batch back; a release leaves a tombstone
        that keeps the token growing)."""
        if not batch.keys:
            return
        ns = batch.namespace
        state = PROCESSED if batch.completing else RELEASED
        results = batch.results or [None] * len(batch)
        parsed = list(zip(batch.keys, batch.raw, batch.tokens, results, strict=True))
        d, parted = self._dialect, self._parts is not None
        self._tx(lambda cur: change(d, cur, self.table, ns, parsed, state, parted))

    @one_call
    def _extend_batch(self, batch: ExtendBatch) -> None:
        """Renews a batch's leases in one transaction on the server's clock (a stale
        token rolls the whole batch back)."""
        if not batch.keys:
            return
        ns = batch.namespace
        lease_s = self.lease if batch.lease is None else batch.lease
        items = list(zip(batch.keys, batch.raw, batch.tokens, strict=True))
        d, parted = self._dialect, self._parts is not None
        self._tx(lambda cur: extend(d, cur, self.table, ns, items, lease_s, parted))

    @one_call
    def _get_record(self, ns_b: bytes, raw: bytes) -> KeyRecord | None:
        """The key's record (None if the table holds nothing)."""
        ns = ns_b.decode()
        d = self._dialect
        p, k = d.ph, d.q("key")
        # A partitioned table: the processed row if any, else the newest.
        order = (
            "" if self._parts is None else f" ORDER BY state = {PROCESSED} DESC, part DESC LIMIT 1"
        )

        def body(cur: Any) -> tuple[Any, ...] | None:
            cur.execute(
                f"SELECT state, token, owner, fingerprint, result, {d.epoch('created')}, "
                f"{d.epoch('updated')} FROM {d.q(self.table)} "
                f"WHERE namespace = {p} AND {k} = {p}{order}",
                [ns, raw],
            )
            row: tuple[Any, ...] | None = cur.fetchone()
            return row

        row = self._tx(body, write=False)
        if row is None:
            return None
        s, tok, o, f, res, created, updated = row
        return KeyRecord(
            State(int(s)),
            int(tok),
            None if o is None else bytes(o),
            None if f is None else bytes(f),
            unpack_result(bytes(res)) if int(s) == PROCESSED and res is not None else None,
            float(created),
            float(updated),
        )

    # -- partitions by event time (docs/sql-partitions.md) ---------------------------

    def partitions(self) -> list[int]:
        """The starts (unix seconds) of the table's partitions, read from the database."""
        return self._partitioned().starts()

    def horizon(self) -> int:
        """Partitions before this start (unix seconds) are dropped or being dropped."""
        return self._partitioned().horizon()

    def ensure_partitions(self, now: float | None = None) -> list[int]:
        """Creates the partitions up to ``partitions_ahead`` after ``now``'s; returns all starts.

        ``now`` (unix seconds) defaults to the store's ``clock``. Called by
        :meth:`init_schema` and :meth:`purge`; a claim whose partition is
        missing creates it (up to the same limit) first.
        """
        return self._partitioned().ensure(now)

    # -- retention and figures ------------------------------------------------------

    def purge(self, *, limit: int = 10_000, before_delete: BeforeDelete | None = None) -> int:
        """Applies retention: deletes up to ``limit`` rows per namespace policy; returns how many.

        A PROCESSED record or a tombstone goes when its last change is older
        than its namespace's ``exact_window`` (``namespaces``, else
        ``retention``). A claim abandoned that long (lease over) first becomes
        a tombstone, so its token keeps growing for one more window (a stale
        owner still gets StaleTokenError). Each policy is one short
        transaction; call again while it returns ``limit`` or more.

        ``before_delete(namespace, keys)`` is the demotion hook (copy, then
        delete): inside each policy's transaction the rows to delete are
        selected (oldest first) and locked, the callback is called once per
        namespace with the PROCESSED keys among them, and only then are
        exactly those rows deleted (each only if still finished and old) and
        the transaction committed. If the callback raises, the transaction is
        rolled back: nothing is deleted, and the error propagates. Tombstones
        (released claims) are deleted without being passed: their work was
        never done, so a cold archive must not answer them DUPLICATE. The
        callback runs while the store's connection is busy (it must not call
        this store) and may see the same keys again if a deadlock makes the
        transaction run again, so its copy must be idempotent.

        A partitioned table drops its old partitions instead
        (:meth:`drop_partitions`).
        """
        check_purge(limit, before_delete)
        if self._parts is not None:
            return self.drop_partitions(limit=limit, before_delete=before_delete)
        policies: list[tuple[str | None, float]] = [
            (ns, p.exact_window) for ns, p in sorted(self.namespaces.items())
        ]
        policies.append((None, self.retention.exact_window))
        return _retention.purge(self._session, self.table, policies, limit, before_delete)

    def sweep(self, now: float | None = None, *, limit: int = 10_000) -> int:
        """Applies retention as a stack's sweep does for a SQL authority; rows deleted.

        :meth:`purge` is called until a call deletes fewer than ``limit``
        rows (at most 100 calls: a larger backlog is left to the next
        sweep). ``now`` is accepted for the sweep signature and not used:
        windows are measured on the database server's clock. A partitioned
        table drops its old partitions instead (:meth:`drop_partitions` at
        ``now``, default the store's clock).
        """
        if self._parts is not None:
            return self.drop_partitions(now, limit=limit)
        deleted = 0
        for _ in range(100):
            gone = self.purge(limit=limit)
            deleted += gone
            if gone < limit:
                break
        return deleted

    def drop_partitions(
        self,
        now: float | None = None,
        *,
        limit: int = 10_000,
        before_delete: BeforeDelete | None = None,
    ) -> int:
        """Drops the partitions past the exact window; returns the rows they held.

        A partition ``[start, start + span)`` goes once ``start + span`` is at
        least the longest ``exact_window`` plus ``partition_tolerance`` before
        ``now`` (unix seconds; default the store's clock). First the horizon
        moves past it, in a transaction that waits for the claims and
        completions in flight (they hold the horizon shared); from then on no
        claim writes into it, a claim for an event time in it raises
        :class:`~dedupcore.errors.PartitionDroppedError`, and only its
        PROCESSED rows still answer lookups. Then ``before_delete(namespace,
        keys)`` gets its PROCESSED keys (``limit`` per call, in key order;
        tombstones and abandoned claims are not passed) and the partition is
        dropped whole. A failure in between leaves the partition to the next
        call, which copies it again (the copy must be idempotent) and drops
        it. The partitions ahead are created first (:meth:`ensure_partitions`).
        """
        parts = self._partitioned()
        check_purge(limit, before_delete)
        return _retention.drop_partitions(parts, now, limit, before_delete)

    def server_version(self) -> str:
        """The database server's name and version."""
        return self._tx(self._dialect.server_version, write=False)

    def stats(self) -> dict[str, Any]:
        """Engine, table and this store's counters (outcomes, retries, reconnects)."""
        with self._session.lock:
            counts = dict(self._session.counts)
        if self._watchdog is not None:
            counts["cut_connections"] = self._watchdog.cuts
        return {"engine": self.dialect, "table": self.table, **counts}


def _execute(cur: Any, sql: str) -> None:
    cur.execute(sql)
