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
:class:`~dedupcore.tiers.base.RequestRefusedError`, a ``ValueError``: the
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
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import dedupcore.keys as _keys
from dedupcore.api import (
    Claim,
    ClaimAPI,
    KeyRecord,
    Outcome,
    change_items,
    check_fingerprints,
    check_owner,
    fingerprint_conflict,
    pack_result,
    unpack_result,
)
from dedupcore.config import Retention, check_lease
from dedupcore.decision import (
    DUPLICATE,
    ERR_COMPLETED,
    ERR_NOT_CLAIMED,
    ERR_WRONG_TOKEN,
    IN_PROGRESS,
    NEW,
    NEW_TAKEOVER,
    Rec,
    decide_claim,
    stale_token_error,
)
from dedupcore.errors import PartitionDroppedError, SchemaError, UnavailableError
from dedupcore.record import State
from dedupcore.retry import Deadline, current_deadline, deadline_scope, one_call
from dedupcore.sql.dialects import _DIALECTS, DEFAULT_TIMEOUT, detect_dialect
from dedupcore.sql.dialects import connect_url as _factory
from dedupcore.sql.dialects.base import (
    _PROCESSED,
    _PROCESSING,
    _RELEASED,
    BeforeDelete,
    _Dialect,
    _SetList,
)
from dedupcore.sql.partitions import (
    DEFAULT_TOLERANCE,
    PARTITION_SPANS,
    _check_tolerance,
    _floor,
    check_event_time,
    id_time,
)
from dedupcore.sql.watchdog import _connect_within, _Watchdog
from dedupcore.tiers.base import (
    RequestRefusedError,
    check_limit,
    check_retention,
    check_timeout,
)

log = logging.getLogger("dedupcore")

T = TypeVar("T")

_TABLE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}\Z")
#: A namespace's batches are read first (see :meth:`SqlStore.claim_many`) while the
#: exponential average of their DUPLICATE share (weight of the newest batch
#: ``_SHARE_WEIGHT``) is above ``_READ_FIRST_ABOVE``; at most ``_MAX_SHARES`` namespaces.
_READ_FIRST_ABOVE = 0.5
_SHARE_WEIGHT = 0.5
#: Below this average share of keys that already had a row, a namespace's batch is
#: first tried as a plain multi-row INSERT (PostgreSQL: cheaper than ON CONFLICT).
_PLAIN_BELOW = 0.001
_MAX_SHARES = 10_000

#: The decision's answer codes (dedupcore/decision.py) as outcomes.
_OUTCOMES = {
    NEW: Outcome.NEW,
    NEW_TAKEOVER: Outcome.NEW,
    DUPLICATE: Outcome.DUPLICATE,
    IN_PROGRESS: Outcome.IN_PROGRESS,
}


def _rowcount(cur: Any, sql: str) -> int:
    cur.execute(sql)
    return int(cur.rowcount)


class _Retry(Exception):
    """The transaction must be run again (a row vanished between two statements)."""


class _Fallback(_Retry):
    """A plain INSERT found an existing key: run the transaction again, at once, the safe way."""


@dataclass(slots=True)
class _Row:
    state: int
    token: int
    owner: bytes | None
    fingerprint: bytes | None
    live: bool
    result: bytes | None = None

    @classmethod
    def of(cls, s: Any, tok: Any, o: Any, f: Any, res: Any, live: Any) -> _Row:
        """A row from ``(state, token, owner, fingerprint, result, live)`` as selected."""
        return cls(
            int(s),
            int(tok),
            None if o is None else bytes(o),
            None if f is None else bytes(f),
            bool(live),
            None if res is None else bytes(res),
        )


# -- the store -------------------------------------------------------------------------


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
    ``_Watchdog``), whatever the call's deadline; None for no such limit.

    Every argument is checked before it is sent: keys, namespace, owner,
    fingerprints, tokens, leases (at most
    :data:`~dedupcore.config.MAX_LEASE_SECONDS`), retention windows and
    size settings. A database error that refuses the request's data anyway
    (out of range, too long, a CHECK) is a
    :class:`~dedupcore.tiers.base.RequestRefusedError` (a ``ValueError``),
    never an :class:`UnavailableError`.

    ``partition`` (``"day"`` or ``"hour"``; PostgreSQL and MariaDB) keeps the
    table in partitions by each key's event time (docs/sql-partitions.md):
    ``event_time(s)=`` of the claim, else ``key_time(key)`` (unix seconds;
    default :func:`id_time`). ``partition_tolerance``: seconds two event
    times of one message may differ and still meet across a boundary
    (``0 <= tolerance < span``); ``partitions_ahead``: partitions created
    after the clock's; ``clock``: the time (unix seconds) partitions are
    created and dropped by.
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
        if dialect is not None and dialect not in _DIALECTS:
            raise ValueError(f"dialect must be one of {sorted(_DIALECTS)}, got {dialect!r}")
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
        self._watchdog = None if limit is None and self.timeout is None else _Watchdog(limit)
        self._told_durability = False
        self._connect = connect
        self._conn: Any = None
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._dup_share: dict[str, float] = {}  # namespace -> average DUPLICATE share
        self._seen_share: dict[str, float] = {}  # namespace -> average share of existing rows
        self._span: int | None = None
        if partition is not None:
            if partition not in PARTITION_SPANS:
                raise ValueError(
                    f"partition must be one of {sorted(PARTITION_SPANS)} or None, got {partition!r}"
                )
            self._span = PARTITION_SPANS[partition]
        self.partition = partition
        self.tolerance = _check_tolerance(partition_tolerance, self._span)
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
        self._clock = clock
        self._parts: list[int] = []  # partition starts last read (or created)
        self._dialect: _Dialect | None = _DIALECTS[dialect]() if dialect else None
        if self._dialect is not None:
            self._check_limits(self._dialect)
        else:
            with self._lock:
                self._connection()  # learn the dialect (UnavailableError when down)
        assert self._dialect is not None

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
        dialect, factory = _factory(url, dict(connect_args or {}), wait)
        options.setdefault("timeout", wait)
        return cls(factory, dialect=dialect, **options)

    @property
    def dialect(self) -> str:
        """``"postgresql"``, ``"mysql"`` or ``"sqlite"``."""
        assert self._dialect is not None
        return self._dialect.name

    def _check_limits(self, d: _Dialect) -> None:
        if self._span is not None and not d.partitions:
            raise ValueError(f"partition={self.partition!r}: {d.name} tables are not partitioned")
        if self.max_key_bytes > d.max_key_bytes:
            raise ValueError(
                f"max_key_bytes={self.max_key_bytes} does not fit the {d.name} key column "
                f"(at most {d.max_key_bytes} bytes)"
            )

    # -- connections and transactions ------------------------------------------------

    def _connection(self) -> Any:
        if self._conn is not None:
            return self._conn
        deadline = current_deadline()
        try:
            if deadline is None or (self._dialect is not None and self._dialect.name == "sqlite"):
                conn = self._connect()  # (a local file: nothing to wait for but its lock)
            else:
                conn = _connect_within(self._connect, deadline.budget())
        except Exception as exc:
            self._counts["unavailable"] += 1
            raise UnavailableError(f"cannot connect to the SQL authority: {exc}") from exc
        if self._dialect is None:
            try:
                name = detect_dialect(conn)
            except ValueError:
                self._close(conn)
                raise
            self._dialect = _DIALECTS[name]()
            self._check_limits(self._dialect)
        try:
            self._dialect.prepare(conn)
        except self._dialect.error_classes() as exc:
            self._close(conn)
            self._counts["unavailable"] += 1
            raise UnavailableError(f"cannot set up the SQL connection: {exc}") from exc
        self._counts["connects"] += 1
        self._conn = conn
        if not self._told_durability:
            self._told_durability = True
            self._tell_durability(conn)
        return conn

    def _guard(self, conn: Any) -> contextlib.AbstractContextManager[None]:
        """The watchdog over ``conn`` while it waits for the database (see ``_Watchdog``).

        Inside a call with a deadline, the driver's own waits are given the
        time left first (``_Dialect.arm``).
        """
        if self._watchdog is None:
            return contextlib.nullcontext()
        d = self._dialect
        assert d is not None
        deadline = current_deadline()
        if deadline is not None:
            d.arm(conn, deadline.budget())
        return self._watchdog.guard(d.socket_of(conn), None if deadline is None else deadline.at)

    def _tell_durability(self, conn: Any) -> None:
        """Logs once what committed claims survive: a warning when a crash can lose them."""
        d = self._dialect
        assert d is not None
        try:
            with self._guard(conn):
                cur = conn.cursor()
                try:
                    level, said = d.durability(cur)
                finally:
                    cur.close()
                conn.rollback()
        except d.error_classes() as exc:
            # Not fatal: a connection that is broken fails the call that needed it.
            log.info("SQL authority (%s): durability unknown: %s", d.name, exc)
            with contextlib.suppress(Exception):
                conn.rollback()
            return
        if level < 2:
            log.warning("SQL authority (%s) can lose committed claims: %s", d.name, said)
        else:
            log.info("SQL authority (%s) durability: %s", d.name, said)

    def durability(self) -> str:
        """What a committed claim survives, from the database server's settings."""
        return self._durability_report()[1]

    def _durability_report(self) -> tuple[int, str]:
        """See :func:`~dedupcore.tiers.base.durability_report`."""
        d = self._dialect
        assert d is not None
        return self._tx(d.durability, write=False)

    @staticmethod
    def _close(conn: Any) -> None:
        with contextlib.suppress(Exception):  # a broken connection may fail to close
            conn.close()

    def _drop(self) -> None:
        if self._conn is not None:
            self._close(self._conn)
            self._conn = None

    def _rollback(self, conn: Any) -> None:
        """Rolls back; a connection that cannot is dropped."""
        try:
            conn.rollback()
        except Exception:
            self._drop()

    @contextlib.contextmanager
    def _locked(self, deadline: Deadline | None) -> Iterator[None]:
        """The store's lock (one call at a time on its connection), waited for until the
        call's deadline at most."""
        if deadline is None:
            self._lock.acquire()
        elif not self._lock.acquire(timeout=deadline.left()):
            raise UnavailableError(
                "SQL authority: another call of this store held its connection past this "
                f"call's timeout of {deadline.timeout:g} s"
            )
        try:
            yield
        finally:
            self._lock.release()

    def _tx(self, body: Callable[[Any], T], *, write: bool = True) -> T:
        """Runs ``body(cursor)`` in one transaction: commit, or roll back and raise.

        Deadlocks and serialization failures are retried; every other driver
        error is an :class:`UnavailableError` (and a broken connection is dropped).
        """
        d = self._dialect
        assert d is not None
        errors = d.error_classes()
        with deadline_scope(self.timeout) as deadline, self._locked(deadline):
            attempt = 0
            while True:
                if deadline is not None and deadline.expired():
                    self._counts["unavailable"] += 1
                    raise UnavailableError(
                        f"SQL authority ({d.name}): no answer within the call's timeout "
                        f"of {deadline.timeout:g} s"
                    )
                conn = self._connection()
                autocommit = not write and d.autocommit_reads
                try:
                    if autocommit:
                        conn.autocommit = True  # a lone read: no BEGIN, no COMMIT
                    with self._guard(conn):
                        cur = conn.cursor()
                        try:
                            d.begin(cur, write)
                            out = body(cur)
                        finally:
                            cur.close()
                        conn.commit()
                    return out
                except _Fallback:
                    self._rollback(conn)
                    continue  # not a retry: the same transaction without the shortcut
                except _Retry:
                    self._rollback(conn)
                except errors as exc:
                    broken = d.is_broken(conn, exc)
                    if broken:
                        log.warning("SQL authority (%s): connection lost: %s", d.name, exc)
                        self._drop()
                    else:
                        self._rollback(conn)
                    if not broken and d.is_refused(exc):
                        self._counts["refused"] += 1
                        raise RequestRefusedError(
                            f"SQL authority ({d.name}) refused the request: {exc}"
                        ) from exc
                    if not broken and d.is_missing_table(exc):
                        raise SchemaError(
                            f"the dedup table {self.table!r} does not exist on {d.name}: "
                            "create it with `dedupcore sql init --url ...` or init_schema()"
                        ) from exc
                    if broken or attempt >= self.retries or not d.is_transient(exc):
                        self._counts["unavailable"] += 1
                        what = "connection lost" if broken else "error"
                        raise UnavailableError(
                            f"SQL authority ({d.name}) {what}; nothing was decided "
                            f"(a COMMIT cut off may have applied): {exc}"
                        ) from exc
                except Exception:
                    self._rollback(conn)  # ConflictError, StaleTokenError, bugs
                    raise
                except BaseException:
                    self._drop()  # interrupted mid-statement: the session state is unknown
                    raise
                finally:
                    if autocommit and self._conn is conn:
                        try:
                            conn.autocommit = False
                        except Exception:
                            self._drop()
                attempt += 1
                self._counts["retries"] += 1
                if attempt > self.retries:
                    self._counts["unavailable"] += 1
                    raise UnavailableError(
                        f"SQL authority ({d.name}): gave up after {self.retries} retries"
                    )
                backoff = min(0.2, 0.005 * 2**attempt) * (0.5 + random.random())
                if deadline is not None:
                    cut = deadline.retry_wait(backoff)
                    if cut is None:  # too little of the call's time left to try again
                        self._counts["unavailable"] += 1
                        raise UnavailableError(
                            f"SQL authority ({d.name}): gave up after {attempt} tries within "
                            f"the call's timeout of {deadline.timeout:g} s"
                        )
                    backoff = cut
                time.sleep(backoff)

    def init_schema(self) -> None:
        """Creates the dedup table and its index if they do not exist (idempotent).

        A partitioned store (``partition=``) also creates its partitions (see
        :meth:`ensure_partitions`). A table that exists with the other kind
        (partitioned or not) is a :class:`SchemaError`.
        """
        d = self._dialect
        assert d is not None
        span = self._span

        def create(cur: Any) -> None:
            if span is None:
                statements = d.schema(self.table)
            else:
                first = self._first_part(self._clock())
                statements = d.part_schema(self.table, first, span)
            for statement in statements:
                cur.execute(statement)

        if d.name == "sqlite":
            # WAL: readers do not block the writer (a no-op for :memory: databases).
            self._tx(lambda cur: cur.execute("PRAGMA journal_mode = WAL"), write=False)
        self._tx(create)
        if d.partitions:
            parted = self._tx(functools.partial(d.is_partitioned, table=self.table), write=False)
            if parted != (span is not None):
                raise SchemaError(
                    f"table {self.table!r} exists {'with' if parted else 'without'} partitions; "
                    f"this store has partition={self.partition!r} (use another table)"
                )
        if span is not None:
            self._check_span()
            self.ensure_partitions()

    def close(self) -> None:
        """Closes the connection (a later call opens a new one)."""
        with self._lock:
            self._drop()

    def __enter__(self) -> SqlStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the claim API --------------------------------------------------------------

    @one_call
    def claim_many(
        self,
        keys: Iterable[bytes | str],
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprints: Sequence[bytes | None] | None = None,
        event_times: Sequence[float | datetime.datetime] | None = None,
    ) -> list[Claim]:
        """Claims a batch of keys of one namespace in one transaction.

        A key repeated in the batch is NEW once; its later copies are
        IN_PROGRESS (or NEW with the same token for an ``owner``). A bad key
        or a fingerprint conflict raises before anything is claimed.

        ``event_times`` (one per key: unix seconds or aware datetimes) place
        the keys of a partitioned table (``partition=``); without them each
        key's time is ``key_time(key)``. An unpartitioned table checks and
        ignores them. See docs/sql-partitions.md.
        """
        key_list = list(keys)
        ns = _keys.check_namespace(namespace).decode()
        raw = [_keys.check_key(k, self.max_key_bytes) for k in key_list]
        lease_s = self.lease if lease is None else check_lease(lease)
        owner_b = check_owner(owner)
        fps = check_fingerprints(fingerprints, len(raw))
        times = self._event_times(key_list, event_times)
        if not raw:
            return []
        first_fp: dict[bytes, bytes | None] = {}
        for k, fp in zip(raw, fps, strict=True):
            first_fp.setdefault(k, fp)
        unique = sorted(first_fp)
        d = self._dialect
        assert d is not None
        if times is not None:
            parted = self._claim_parted(key_list, raw, fps, first_fp, ns, owner_b, lease_s, times)
            self._count(ns, parted)
            return parted

        read_first = d.read_first and self._dup_share.get(ns, 0.0) > _READ_FIRST_ABOVE
        final: dict[bytes, _Row | None] = {}
        existing: set[bytes] = set()
        if read_first:
            # One unlocked read, outside any write transaction. A PROCESSED row is final:
            # only purge changes it, by deleting it, and a processed key that retention
            # drops in the meantime is answered DUPLICATE as if the purge came later.
            done: dict[bytes, tuple[Any, ...]] = {}
            for row in self._tx(lambda cur: d.read_rows(cur, self.table, ns, unique), write=False):
                if row[1] == _PROCESSED:
                    done[bytes(row[0])] = row
                else:
                    existing.add(bytes(row[0]))  # not final: inserted-if-absent and locked below
            claims: list[Claim] = []
            for key, k, fp in zip(key_list, raw, fps, strict=True):
                hit = done.get(k)
                if hit is None:
                    continue
                if fp is not None and hit[4] is not None and fp != hit[4]:
                    raise fingerprint_conflict(key, ns)  # before anything is written
                claims.append(Claim(key, ns, Outcome.DUPLICATE, int(hit[2]), unpack_result(hit[5])))
            if len(claims) == len(raw):  # every key PROCESSED: no write transaction at all
                self._count(ns, claims)
                return claims
            for k, (_, _, tok, o, f, res) in done.items():
                final[k] = _Row(
                    _PROCESSED,
                    int(tok),
                    None if o is None else bytes(o),
                    None if f is None else bytes(f),
                    False,
                    None if res is None else bytes(res),
                )
        rest = [k for k in unique if k not in final] if final else unique
        absent = [k for k in rest if k not in existing] if existing else rest
        # A row read as existing that has vanished by the SELECT .. FOR UPDATE (purged):
        # the transaction runs again and then inserts every non-final key.
        insert_all = [False]
        # A namespace whose recent batches found no existing row tries a plain INSERT of
        # the whole batch first; any existing key fails it, and the transaction (whose
        # first statement it was) is rolled back and run again with INSERT .. ON CONFLICT.
        plain = [d.plain_insert and not read_first and self._seen_share.get(ns, 0.0) < _PLAIN_BELOW]
        seen: list[int] = []

        def body(cur: Any) -> list[Claim]:
            nonce = os.urandom(16)
            write = rest if insert_all[0] else absent
            fresh_fps = [first_fp[k] for k in write]
            created: set[bytes] | None
            if plain[0]:
                plain[0] = False
                try:
                    d.insert_all(cur, self.table, ns, write, fresh_fps, owner_b, lease_s)
                except d.error_classes() as exc:
                    if not d.is_unique_violation(exc):
                        raise
                    seen.append(1)
                    raise _Fallback from exc
                created = set(write)
            elif write:
                created = d.insert_fresh(
                    cur, self.table, ns, write, fresh_fps, owner_b, lease_s, nonce
                )
            else:
                created = set()
            if created is not None and not read_first:
                seen.append(len(unique) - len(created))
                if len(created) == len(unique) == len(raw):  # all fresh, none repeated
                    return [Claim(key, ns, Outcome.NEW, 1) for key in key_list]
            current: dict[bytes, _Row | None] = dict(final)
            current.update((k, None) for k in created or ())
            lock = rest if created is None else [k for k in rest if k not in created]
            if lock:
                for k, s, tok, o, f, res, live in d.select_rows(cur, self.table, ns, lock):
                    k = bytes(k)
                    res = None if res is None else bytes(res)
                    if created is None and s == _PROCESSING and res == nonce:
                        current[k] = None  # this transaction created it (see the docstring)
                    else:
                        current[k] = _Row(
                            int(s),
                            int(tok),
                            None if o is None else bytes(o),
                            None if f is None else bytes(f),
                            bool(live),
                            res,
                        )
            if len(current) != len(unique):
                insert_all[0] = True
                raise _Retry  # a row was purged between the read or INSERT and the SELECT
            return self._decide(cur, key_list, raw, fps, ns, owner_b, lease_s, current)

        claims = self._tx(body)
        self._count(ns, claims)
        self._follow_seen(ns, seen, len(unique))
        return claims

    def _follow_seen(self, ns: str, seen: list[int], unique: int) -> None:
        """Follows the namespace's share of keys that had a row (the last attempt's)."""
        if seen:
            old = self._seen_share.get(ns, 0.0)
            self._seen_share[ns] = old + _SHARE_WEIGHT * (seen[-1] / unique - old)

    def claim(
        self,
        key: bytes | str,
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprint: bytes | None = None,
        event_time: float | datetime.datetime | None = None,
    ) -> Claim:
        """:meth:`ClaimAPI.claim <dedupcore.api.ClaimAPI.claim>` with the key's ``event_time``."""
        return self.claim_many(
            [key],
            namespace=namespace,
            lease=lease,
            owner=owner,
            fingerprints=None if fingerprint is None else [fingerprint],
            event_times=None if event_time is None else [event_time],
        )[0]

    # -- partitions by event time (docs/sql-partitions.md) ---------------------------

    def _event_times(
        self, key_list: list[Any], event_times: Sequence[float | datetime.datetime] | None
    ) -> list[float] | None:
        """The batch's event times (a partitioned table), checked; None when unpartitioned."""
        if event_times is not None:
            if isinstance(event_times, (str, bytes)) or not isinstance(event_times, Sequence):
                raise TypeError(
                    f"event_times must be a sequence, one per key, not {type(event_times).__name__}"
                )
            if len(event_times) != len(key_list):
                raise ValueError(
                    f"event_times has {len(event_times)} values for {len(key_list)} keys"
                )
            times = [check_event_time(t) for t in event_times]
            return times if self._span is not None else None
        if self._span is None:
            return None
        key_time = self.key_time
        if key_time is None:
            raise ValueError(
                f"table {self.table!r} is partitioned by event time: pass event_time(s)= "
                "or give the store a key_time"
            )
        out: list[float] = []
        for key in key_list:
            try:
                t = key_time(key)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"no event time for key {key!r}: the table is partitioned by event time "
                    f"and key_time could not read the key ({exc}); pass event_time(s)="
                ) from None
            out.append(check_event_time(t, "key_time(key)"))
        return out

    def _require_span(self) -> int:
        if self._span is None:
            raise ValueError(f"table {self.table!r} is not partitioned (partition=None)")
        return self._span

    def _longest_window(self) -> float:
        return max(
            [self.retention.exact_window, *(p.exact_window for p in self.namespaces.values())]
        )

    def _first_part(self, now: float) -> int:
        """The oldest partition :meth:`init_schema` creates: the exact window back from now."""
        return _floor(now - self._longest_window() - self.tolerance, self._require_span())

    def _check_span(self) -> None:
        d = self._dialect
        assert d is not None
        rows = self._tx(
            lambda cur: (
                cur.execute(f"SELECT span FROM {d.q(self.table + '_parts')} WHERE id = 1"),
                cur.fetchall(),
            )[1],
            write=False,
        )
        if not rows or int(rows[0][0]) != self._span:
            raise SchemaError(
                f"table {self.table!r} is partitioned by {rows[0][0] if rows else '?'} s, "
                f"not by {self.partition} ({self._span} s)"
            )

    def partitions(self) -> list[int]:
        """The starts (unix seconds) of the table's partitions, read from the database."""
        self._require_span()
        d = self._dialect
        assert d is not None
        self._parts = self._tx(lambda cur: d.part_list(cur, self.table), write=False)
        return list(self._parts)

    def horizon(self) -> int:
        """Partitions before this start (unix seconds) are dropped or being dropped."""
        self._require_span()
        d = self._dialect
        assert d is not None
        return self._tx(lambda cur: d.part_guard(cur, self.table, False), write=False)

    def ensure_partitions(self, now: float | None = None) -> list[int]:
        """Creates the partitions up to ``partitions_ahead`` after ``now``'s; returns all starts.

        ``now`` (unix seconds) defaults to the store's ``clock``. Called by
        :meth:`init_schema` and :meth:`purge`; a claim whose partition is
        missing creates it (up to the same limit) first.
        """
        span = self._require_span()
        t = self._clock() if now is None else check_event_time(now, "now")
        return self._ensure_upto(_floor(t, span) + self.partitions_ahead * span)

    def _ensure_upto(self, top: int) -> list[int]:
        span = self._require_span()
        d = self._dialect
        assert d is not None

        def body(cur: Any) -> list[int]:
            have = d.part_list(cur, self.table)
            horizon = d.part_guard(cur, self.table, False)
            if d.name == "mysql":  # RANGE partitions are added after the last one only
                start = have[-1] + span if have else horizon
                want = list(range(start, top + 1, span))
            else:
                present = set(have)
                want = [s for s in range(horizon, top + 1, span) if s not in present]
            if want:
                try:
                    d.part_create(cur, self.table, want, span)
                except d.error_classes() as exc:
                    # Another store created (some of) them first: read the list again.
                    log.info("SQL authority (%s): creating partitions: %s", d.name, exc)
                    raise _Retry from exc
            return sorted({*have, *want})

        self._parts = self._tx(body)
        return list(self._parts)

    def _claim_parted(
        self,
        key_list: list[Any],
        raw: list[bytes],
        fps: list[bytes | None],
        first_fp: dict[bytes, bytes | None],
        ns: str,
        owner_b: bytes | None,
        lease_s: float,
        times: list[float],
    ) -> list[Claim]:
        """A claim on a partitioned table (docs/sql-partitions.md, "The lookup")."""
        span, tol = self._require_span(), self.tolerance
        d = self._dialect
        assert d is not None
        first_t: dict[bytes, float] = {}
        for k, t in zip(raw, times, strict=True):
            first_t.setdefault(k, t)  # a key repeated in the batch: its first event time
        unique = sorted(first_t)
        home = {k: _floor(t, span) for k, t in first_t.items()}
        lo_of = {k: _floor(t - tol, span) for k, t in first_t.items()}
        hi_of = {k: _floor(t + tol, span) for k, t in first_t.items()}
        edges = sorted({(k, b) for k in unique for b in range(lo_of[k] + span, hi_of[k] + 1, span)})
        missing = set(home.values()).difference(self._parts)
        if missing:
            missing.difference_update(self.partitions())  # made by another store?
        if missing:
            top = max(missing)
            if top > _floor(self._clock(), span) + self.partitions_ahead * span:
                raise ValueError(
                    f"event time {max(first_t.values())!r} is more than {self.partitions_ahead} "
                    f"partitions ahead of the store's clock: it cannot be placed"
                )
            # Partitions before the horizon stay missing: the transaction refuses them.
            self._ensure_upto(max(top, self._parts[-1] if self._parts else top))

        if d.read_first and self._dup_share.get(ns, 0.0) > _READ_FIRST_ABOVE:
            # As claim_many: a batch that is all PROCESSED is answered by one unlocked
            # read (a PROCESSED row is final), without a write transaction.
            lo, hi = min(lo_of.values()), max(hi_of.values())
            done: dict[bytes, tuple[Any, ...]] = {}
            for row in self._tx(
                lambda cur: d.select_rows(cur, self.table, ns, unique, (lo, hi), lock=False),
                write=False,
            ):
                k, part = bytes(row[0]), int(row[1])
                if int(row[2]) == _PROCESSED and lo_of[k] <= part <= hi_of[k]:
                    done.setdefault(k, row)
            if len(done) == len(unique):
                claims: list[Claim] = []
                for key, k, fp in zip(key_list, raw, fps, strict=True):
                    hit = done[k]
                    if fp is not None and hit[5] is not None and fp != bytes(hit[5]):
                        raise fingerprint_conflict(key, ns)  # before anything is written
                    result = unpack_result(None if hit[6] is None else bytes(hit[6]))
                    claims.append(Claim(key, ns, Outcome.DUPLICATE, int(hit[3]), result))
                return claims
        plain = [d.plain_insert and self._seen_share.get(ns, 0.0) < _PLAIN_BELOW]
        seen: list[int] = []

        def body(cur: Any) -> list[Claim]:
            horizon = d.part_guard(cur, self.table, False)
            old = [k for k in unique if home[k] < horizon]
            if old:
                raise PartitionDroppedError(
                    f"event time {first_t[old[0]]!r} of key {old[0]!r} is in a dropped "
                    f"partition (before {horizon}): older than the exact window"
                )
            current: dict[bytes, _Row | None] = {}
            parts: dict[bytes, int] = {}
            found: dict[bytes, list[tuple[Any, ...]]] = {}
            # A key whose interval lies in its own partition is found (or created) there
            # by the INSERT below; only keys near a boundary are looked up first.
            near = sorted({k for k, _ in edges})
            if near:
                d.lock_edges(cur, self.table, ns, edges)
                lo, hi = min(lo_of[k] for k in near), max(hi_of[k] for k in near)
            for row in d.select_rows(cur, self.table, ns, near, (lo, hi)) if near else ():
                k, part = bytes(row[0]), int(row[1])
                if not lo_of[k] <= part <= hi_of[k]:
                    continue  # outside this key's tolerance interval
                if part < horizon and int(row[2]) != _PROCESSED:
                    continue  # a partition being dropped: only its processed keys count
                found.setdefault(k, []).append(row)
            for k, rows in found.items():
                h = home[k]
                best = min(
                    rows,
                    key=lambda r: (int(r[2]) != _PROCESSED, int(r[1]) != h, abs(int(r[1]) - h)),
                )
                current[k] = _Row.of(*best[2:8])
                parts[k] = int(best[1])
            absent = [k for k in unique if k not in current]
            if absent:
                nonce = os.urandom(16)
                fresh_fps, homes = [first_fp[k] for k in absent], [home[k] for k in absent]
                created: set[bytes] | None
                if plain[0]:  # as claim_many does: see there
                    plain[0] = False
                    try:
                        d.insert_all(
                            cur, self.table, ns, absent, fresh_fps, owner_b, lease_s, homes
                        )
                    except d.error_classes() as exc:
                        if not d.is_unique_violation(exc):
                            raise
                        seen.append(1)
                        raise _Fallback from exc
                    created = set(absent)
                else:
                    created = d.insert_fresh(
                        cur, self.table, ns, absent, fresh_fps, owner_b, lease_s, nonce, homes
                    )
                if created is not None:
                    seen.append(len(unique) - len(created))
                if created is not None and len(created) == len(unique) == len(raw):
                    return [Claim(key, ns, Outcome.NEW, 1) for key in key_list]  # all fresh
                for k in absent:
                    parts[k] = home[k]
                    if created is not None and k in created:
                        current[k] = None
                again = [k for k in absent if k not in current]
                if again:  # created concurrently in the same partition, or MariaDB's nonce
                    homes = [home[k] for k in again]
                    for row in d.select_rows(cur, self.table, ns, again, (min(homes), max(homes))):
                        k, part = bytes(row[0]), int(row[1])
                        if k not in home or part != home[k]:
                            continue
                        res = None if row[6] is None else bytes(row[6])
                        if created is None and int(row[2]) == _PROCESSING and res == nonce:
                            current[k] = None  # this transaction created it
                        else:
                            current[k] = _Row.of(*row[2:8])
                if len(current) != len(unique):
                    raise _Retry  # cannot happen under the edge and row locks; be safe
            return self._decide(cur, key_list, raw, fps, ns, owner_b, lease_s, current, parts)

        claims = self._tx(body)
        self._follow_seen(ns, seen, len(unique))
        return claims

    def _count(self, ns: str, claims: list[Claim]) -> None:
        """Counts the outcomes and follows the namespace's share of DUPLICATE answers."""
        outcomes = Counter(c.outcome for c in claims)
        for outcome, n in outcomes.items():
            self._counts[outcome.value] += n
        self._counts["takeovers"] += sum(c.takeover for c in claims)
        dup = outcomes[Outcome.DUPLICATE]
        shares = self._dup_share
        if len(shares) >= _MAX_SHARES and ns not in shares:
            shares.clear()  # too many namespaces: forget them (each starts insert-first again)
            self._seen_share.clear()
        old = shares.get(ns, 0.0)
        shares[ns] = old + _SHARE_WEIGHT * (dup / len(claims) - old)

    def _decide(
        self,
        cur: Any,
        key_list: list[Any],
        raw: list[bytes],
        fps: list[bytes | None],
        ns: str,
        owner_b: bytes | None,
        lease_s: float,
        current: dict[bytes, _Row | None],
        parts: dict[bytes, int] | None = None,
    ) -> list[Claim]:
        """The outcomes (:func:`dedupcore.decision.decide_claim`), then the batch's UPDATEs.

        ``parts``: each key's partition (a partitioned table), written as the
        second value of each UPDATE row.
        """

        def at(k: bytes) -> list[Any]:
            return [k] if parts is None else [k, parts[k]]

        d = self._dialect
        assert d is not None
        # The rows as decision records; lease deadlines are the server's, so only
        # "still running" (deadline 1 > now 0) or "ran out" (0) is passed on.
        recs: dict[bytes, Rec | None] = {
            k: None
            if r is None
            else Rec(
                State(r.state),
                0,
                r.token,
                0.0,
                0.0,
                lease_s,
                1.0 if r.live else 0.0,
                r.owner,
                r.fingerprint,
                r.result,
            )
            for k, r in current.items()
        }
        plan = decide_claim(
            recs.__getitem__,
            raw,
            ns_id=0,
            lease=lease_s,
            owner=owner_b,
            fingerprints=fps,
            cold=None,
            now_w=0.0,
            now_m=0.0,
        )
        if plan.conflict is not None:
            # The transaction is rolled back: nothing changes.
            raise fingerprint_conflict(key_list[plan.conflict], ns)
        claims = [
            Claim(
                key,
                ns,
                _OUTCOMES[code],
                token,
                unpack_result(result) if code == DUPLICATE else None,
                takeover=code == NEW_TAKEOVER,
            )
            for key, (code, token, result) in zip(key_list, plan.answers, strict=True)
        ]
        # key -> [key, token, fingerprint, owner]: expired leases taken over (the first
        # claim's created stays) and released tombstones claimed again (a fresh record);
        # the rows this transaction created are written already.
        reclaim: dict[bytes, list[Any]] = {}
        restart: dict[bytes, list[Any]] = {}
        for k, rec in plan.logged.items():
            was = current[k]
            if was is not None:
                rows = restart if was.state == _RELEASED else reclaim
                rows[k] = [*at(k), rec.token, rec.fingerprint, rec.owner]
        renew = {k: at(k) for k in plan.renewed if current[k] is not None}
        lease_sql = d.lease_until(lease_s)
        claimed: _SetList = [
            ("state", str(_PROCESSING)),
            ("token", 0),
            ("fingerprint", 1),
            ("owner", 2),
            ("result", "NULL"),
            ("lease_until", lease_sql),
            ("updated", d.now),
        ]
        for rows, sets in ((reclaim, claimed), (restart, [*claimed, ("created", d.now)])):
            if rows:
                d.update_rows(
                    cur,
                    self.table,
                    ns,
                    sets,
                    ["bigint", "bytea", "bytea"],
                    list(rows.values()),
                    parts is not None,
                )
        if renew:
            d.update_rows(
                cur,
                self.table,
                ns,
                [("lease_until", lease_sql), ("updated", d.now)],
                [],
                list(renew.values()),
                parts is not None,
            )
        return claims

    def _change_many(self, items: Iterable[Any], namespace: str, state: int) -> None:
        ns = _keys.check_namespace(namespace).decode()
        completing = state == _PROCESSED
        parsed = [
            (
                key,
                _keys.check_key(key, self.max_key_bytes),
                token,
                pack_result(result, self.max_result_bytes),
            )
            for key, token, result in change_items(items, with_results=completing)
        ]
        if not parsed:
            return
        unique = sorted({p[1] for p in parsed})
        d = self._dialect
        assert d is not None

        parted = self._span is not None
        wanted: dict[bytes, int] = {}
        for _, k, token, _ in parsed:
            wanted.setdefault(k, token)

        def body(cur: Any) -> None:
            current: dict[bytes, tuple[int, int]] = {}
            part_of: dict[bytes, int] = {}
            if parted:
                # Every live partition: the row whose token is the one given, else the
                # claim in progress, else the newest (docs/sql-partitions.md).
                horizon = d.part_guard(cur, self.table, False)
                for k, part, s, tok, *_ in d.select_rows(
                    cur, self.table, ns, unique, (horizon, None)
                ):
                    k, rank = bytes(k), (int(tok) == wanted[bytes(k)], int(s) == _PROCESSING)
                    have = current.get(k)
                    if have is None or rank >= (have[1] == wanted[k], have[0] == _PROCESSING):
                        current[k], part_of[k] = (int(s), int(tok)), int(part)
            else:
                current = {
                    bytes(k): (int(s), int(tok))
                    for k, s, tok, *_ in d.select_rows(cur, self.table, ns, unique)
                }
            writes: dict[bytes, list[Any]] = {}
            for key, k, token, packed in parsed:
                s, tok = current.get(k, (_RELEASED, 0))
                if s == _RELEASED:
                    raise stale_token_error(ERR_NOT_CLAIMED, key, token, tok, ns)
                if tok != token:
                    raise stale_token_error(ERR_WRONG_TOKEN, key, token, tok, ns)
                if s == _PROCESSED:
                    if completing:
                        continue  # a retried completion: already done
                    raise stale_token_error(ERR_COMPLETED, key, token, tok, ns)
                current[k] = (state, tok)
                at = [k, part_of[k]] if parted else [k]
                writes[k] = [*at, packed] if completing else at
            if not writes:
                return
            if completing:
                sets: _SetList = [("state", str(_PROCESSED)), ("result", 0), ("updated", d.now)]
                types = ["bytea"]
            else:
                sets = [("state", str(_RELEASED)), ("result", "NULL"), ("updated", d.now)]
                types = []
            d.update_rows(cur, self.table, ns, sets, types, list(writes.values()), parted)

        self._tx(body)

    @one_call
    def complete_many(
        self,
        items: Iterable[tuple[bytes | str, int] | tuple[bytes | str, int, Any]],
        *,
        namespace: str,
    ) -> None:
        """Completes many claims in one transaction; a retried completion is a no-op.

        Every item is checked first; a stale token rolls the whole batch back.
        """
        self._change_many(items, namespace, _PROCESSED)

    @one_call
    def release_many(self, items: Iterable[tuple[bytes | str, int]], *, namespace: str) -> None:
        """Releases many claims (a tombstone keeps the token growing)."""
        self._change_many(items, namespace, _RELEASED)

    @one_call
    def get(self, key: bytes | str, *, namespace: str) -> KeyRecord | None:
        """The key's record without claiming it (None if the table holds nothing)."""
        ns = _keys.check_namespace(namespace).decode()
        raw = _keys.check_key(key, self.max_key_bytes)
        d = self._dialect
        assert d is not None
        p, k = d.ph, d.q("key")

        def body(cur: Any) -> tuple[Any, ...] | None:
            cur.execute(
                f"SELECT state, token, owner, fingerprint, result, {d.epoch('created')}, "
                f"{d.epoch('updated')} FROM {d.q(self.table)} "
                f"WHERE namespace = {p} AND {k} = {p}"
                # a partitioned table: the processed row if any, else the newest
                + (
                    ""
                    if self._span is None
                    else f" ORDER BY state = {_PROCESSED} DESC, part DESC LIMIT 1"
                ),
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
            unpack_result(bytes(res)) if int(s) == _PROCESSED and res is not None else None,
            float(created),
            float(updated),
        )

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
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= 1_000_000:
            raise ValueError(f"limit must be an int in 1..1000000, got {limit!r}")
        if before_delete is not None and not callable(before_delete):
            raise TypeError("before_delete must be callable(namespace, keys)")
        if self._span is not None:
            return self.drop_partitions(limit=limit, before_delete=before_delete)
        d = self._dialect
        assert d is not None
        deleted = 0
        policies: list[tuple[str | None, float]] = [
            (ns, p.exact_window) for ns, p in sorted(self.namespaces.items())
        ]
        policies.append((None, self.retention.exact_window))
        skip = sorted(self.namespaces)
        for ns, window in policies:
            tombstoned, gone = self._tx(
                functools.partial(
                    d.purge,
                    table=self.table,
                    ns=ns,
                    skip=skip,
                    window=window,
                    limit=limit,
                    before_delete=before_delete,
                )
            )
            deleted += gone
            with self._lock:
                self._counts["purged"] += gone
                self._counts["tombstoned"] += tombstoned
        return deleted

    def sweep(self, now: float | None = None, *, limit: int = 10_000) -> int:
        """Applies retention as a stack's sweep does for a SQL authority; rows deleted.

        :meth:`purge` is called until a call deletes fewer than ``limit``
        rows (at most 100 calls: a larger backlog is left to the next
        sweep). ``now`` is accepted for the sweep signature and not used:
        windows are measured on the database server's clock. A partitioned
        table drops its old partitions instead (:meth:`drop_partitions` at
        ``now``, default the store's clock).
        """
        if self._span is not None:
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
        :class:`PartitionDroppedError`, and only its PROCESSED rows still
        answer lookups. Then ``before_delete(namespace, keys)`` gets its
        PROCESSED keys (``limit`` per call, in key order; tombstones and
        abandoned claims are not passed) and the partition is dropped whole.
        A failure in between leaves the partition to the next call, which
        copies it again (the copy must be idempotent) and drops it. The
        partitions ahead are created first (:meth:`ensure_partitions`).
        """
        span = self._require_span()
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= 1_000_000:
            raise ValueError(f"limit must be an int in 1..1000000, got {limit!r}")
        if before_delete is not None and not callable(before_delete):
            raise TypeError("before_delete must be callable(namespace, keys)")
        t = self._clock() if now is None else check_event_time(now, "now")
        d = self._dialect
        assert d is not None
        meta = d.q(self.table + "_parts")
        target = _floor(t - self._longest_window() - self.tolerance, span)

        def move(cur: Any) -> int:
            horizon = d.part_guard(cur, self.table, True)
            if target > horizon:
                cur.execute(f"UPDATE {meta} SET horizon = {int(target)} WHERE id = 1")
                return target
            return horizon

        horizon = self._tx(move)
        # The partitions ahead first: MariaDB cannot drop a table's last partition.
        self.ensure_partitions(t)
        dropped = 0
        for start in [s for s in self.partitions() if s < horizon]:
            dropped += self._copy_partition(start, limit, before_delete)
            self._tx(functools.partial(d.part_drop, table=self.table, start=start))
            with self._lock:
                self._counts["partitions_dropped"] += 1
        self._drop_edges(horizon, limit)
        with self._lock:
            self._counts["purged"] += dropped
        return dropped

    def _copy_partition(self, start: int, limit: int, before_delete: BeforeDelete | None) -> int:
        """Passes the partition's PROCESSED keys to ``before_delete``; returns its rows."""
        d = self._dialect
        assert d is not None
        src, k, p = d.part_from(self.table, start), d.q("key"), d.ph
        rows = self._tx(
            lambda cur: (cur.execute(f"SELECT COUNT(*) FROM {src}"), cur.fetchone())[1],
            write=False,
        )
        if before_delete is None:
            return int(rows[0])
        after: tuple[str, bytes] | None = None
        while True:
            where = f"state = {_PROCESSED}"
            params: list[Any] = []
            if after is not None:
                where += f" AND (namespace, {k}) > ({p}, {p})"
                params = list(after)

            def page(cur: Any, where: str = where, params: list[Any] = params) -> list[Any]:
                cur.execute(
                    f"SELECT namespace, {k} FROM {src} WHERE {where} "
                    f"ORDER BY namespace, {k} LIMIT {int(limit)}",
                    params,
                )
                got: list[Any] = cur.fetchall()
                return got

            got = self._tx(page, write=False)
            by_ns: dict[str, list[bytes]] = {}
            for name, key in got:
                by_ns.setdefault(str(name), []).append(bytes(key))
            for name, keys in by_ns.items():
                before_delete(name, keys)  # raises: the partition stays for the next call
            if len(got) < limit:
                return int(rows[0])
            after = (str(got[-1][0]), bytes(got[-1][1]))

    def _drop_edges(self, horizon: int, limit: int) -> None:
        """Deletes the edge rows of boundaries before the horizon (they hold no data)."""
        d = self._dialect
        assert d is not None
        edge, k = d.q(self.table + "_edge"), d.q("key")
        where = f"boundary < {int(horizon)}"
        for _ in range(100):
            sql = (
                f"DELETE FROM {edge} WHERE {where} LIMIT {int(limit)}"
                if d.name == "mysql"
                else f"DELETE FROM {edge} WHERE (namespace, {k}, boundary) IN (SELECT "
                f"namespace, {k}, boundary FROM {edge} WHERE {where} LIMIT {int(limit)})"
            )
            gone = self._tx(functools.partial(_rowcount, sql=sql))
            if gone < limit:
                return

    def server_version(self) -> str:
        """The database server's name and version."""
        d = self._dialect
        assert d is not None
        return self._tx(d.server_version, write=False)

    def stats(self) -> dict[str, Any]:
        """Engine, table and this store's counters (outcomes, retries, reconnects)."""
        with self._lock:
            counts = dict(self._counts)
        if self._watchdog is not None:
            counts["cut_connections"] = self._watchdog.cuts
        return {"engine": self.dialect, "table": self.table, **counts}
