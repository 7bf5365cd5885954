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
every key in Python exactly as :class:`~dedupcore.DedupStore` does, and
applies takeovers, tombstone re-claims and lease renewals with batched
``UPDATE`` statements (PostgreSQL: ``UPDATE .. FROM unnest(..)``; MariaDB:
a join with a derived table; SQLite: ``executemany``) before ``COMMIT``.
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
down fails that call, not the open) and waits a bounded time for every
answer (``timeout``; see there), so a server that stops answering fails a
call instead of blocking it. A database error that refuses the request's
own data (out of range, too long, a CHECK) is a
:class:`~dedupcore.tiers.base.RequestRefusedError`, a ``ValueError``: the
arguments are all checked before they are sent, so it only happens when the
table does not have the shape :meth:`SqlStore.init_schema` gives it.

**Why the table is not partitioned (yet).** Declarative ``RANGE``
partitions by day on ``created`` would make retention a ``DROP`` of old
partitions. Both PostgreSQL and MariaDB require the partition key to
be part of every unique constraint of a partitioned table, so the primary
key would have to become ``(namespace, key, created)``: ``ON CONFLICT`` /
``ON DUPLICATE KEY`` would then only see a claim of the same key made on the
*same* day, and a redelivery on another day would insert a second row and
be answered NEW — exactly the false NEW the authority exists to prevent.
The ways around it each cost what the authority is there to save: a
``pg_advisory_xact_lock`` per key (one lock-table slot per key of a batch,
bounded by ``max_locks_per_transaction``) plus an index probe into every
day's partition per key, or a second, unpartitioned ``(namespace, key)``
table, which then is the one that needs row deletes. So for now every
engine gets one unpartitioned table keyed by ``(namespace, key)``, and
retention is :meth:`SqlStore.purge`: bounded batches of deletes driven by
the ``updated`` index (abandoned claims become tombstones first, as the
embedded store's sweep does), with a ``before_delete`` hook that copies each
batch's processed keys into the cold archive before the delete commits.
Day partitions with a race-free lookup remain open.

Use :meth:`SqlStore.from_url` (``postgresql://``, ``mysql://`` or
``mariadb://``, ``sqlite:///relative.db`` / ``sqlite:////absolute.db``) or
pass a DB-API connection factory; call :meth:`SqlStore.init_schema` once
to create the table. (``sqlite:///:memory:`` works, but every reconnect
then starts from an empty database.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

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
from dedupcore.decision import ERR_COMPLETED, ERR_NOT_CLAIMED, ERR_WRONG_TOKEN, stale_token_error
from dedupcore.errors import SchemaError, UnavailableError
from dedupcore.record import State
from dedupcore.tiers.base import (
    RequestRefusedError,
    check_limit,
    check_retention,
    check_timeout,
)

__all__ = ["DEFAULT_TIMEOUT", "SqlStore", "detect_dialect"]

#: Seconds :meth:`SqlStore.from_url` gives a connect and a statement (see there).
DEFAULT_TIMEOUT = 5.0

log = logging.getLogger("dedupcore")

T = TypeVar("T")

_TABLE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}\Z")
#: Rows per statement where the statement carries one set of parameters per row.
_CHUNK = 1000
_PROCESSING, _PROCESSED, _RELEASED = (
    int(State.PROCESSING),
    int(State.PROCESSED),
    int(State.RELEASED),
)

#: A namespace's batches are read first (see :meth:`SqlStore.claim_many`) while the
#: exponential average of their DUPLICATE share (weight of the newest batch
#: ``_SHARE_WEIGHT``) is above ``_READ_FIRST_ABOVE``; at most ``_MAX_SHARES`` namespaces.
_READ_FIRST_ABOVE = 0.5
_SHARE_WEIGHT = 0.5
#: Below this average share of keys that already had a row, a namespace's batch is
#: first tried as a plain multi-row INSERT (PostgreSQL: cheaper than ON CONFLICT).
_PLAIN_BELOW = 0.001
_MAX_SHARES = 10_000

#: ``before_delete(namespace, keys)`` of :meth:`SqlStore.purge`.
BeforeDelete = Callable[[str, list[bytes]], None]

# SET list of a batched UPDATE: (column, i) takes the i-th per-row value, (column, str) is SQL.
_SetList = list[tuple[str, "int | str"]]


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


# -- dialects --------------------------------------------------------------------


class _Dialect:
    """What differs between the engines: SQL text, session setup, error classes."""

    name = ""
    ph = "%s"  # the driver's placeholder
    max_key_bytes = 512

    def q(self, ident: str) -> str:
        return f'"{ident}"'

    @property
    def now(self) -> str:
        raise NotImplementedError

    def lease_until(self, lease: float) -> str:
        raise NotImplementedError

    def epoch(self, column: str) -> str:
        raise NotImplementedError

    def error_classes(self) -> tuple[type[BaseException], ...]:
        raise NotImplementedError

    def is_transient(self, exc: BaseException) -> bool:
        return False

    def is_missing_table(self, exc: BaseException) -> bool:
        return False

    def is_broken(self, conn: Any, exc: BaseException) -> bool:
        return False

    def is_refused(self, exc: BaseException) -> bool:
        """Whether the server refused the request's data (out of range, too long, a CHECK)."""
        return False

    def socket_of(self, conn: Any) -> int | None:
        """The connection's socket, for a driver with no timeout of its own on replies."""
        return None

    def durability(self, cur: Any) -> tuple[int, str]:
        """What a committed claim survives: a level (see ``durability_report``) and words."""
        raise NotImplementedError

    def prepare(self, conn: Any) -> None:
        """Session setup of a new connection (transactions, time zone, isolation)."""

    def begin(self, cur: Any, write: bool) -> None:
        """Starts the transaction (drivers that begin implicitly do nothing)."""

    def schema(self, table: str) -> list[str]:
        raise NotImplementedError

    def server_version(self, cur: Any) -> str:
        raise NotImplementedError

    # -- statements ---------------------------------------------------------------

    def insert_fresh(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        fps: list[bytes | None],
        owner: bytes | None,
        lease: float,
        nonce: bytes,
    ) -> set[bytes] | None:
        """Creates the rows that do not exist; the keys created, or None if unknown."""
        raise NotImplementedError

    def select_rows(
        self, cur: Any, table: str, ns: str, keys: list[bytes]
    ) -> list[tuple[Any, ...]]:
        """``(key, state, token, owner, fingerprint, result, live)`` of existing keys, locked."""
        t, k, p = self.q(table), self.q("key"), self.ph
        out: list[tuple[Any, ...]] = []
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            cur.execute(
                f"SELECT {k}, state, token, owner, fingerprint, result, "
                f"lease_until > {self.now} FROM {t} WHERE namespace = {p} "
                f"AND {k} IN ({', '.join([p] * len(chunk))}) ORDER BY {k}{self.for_update}",
                [ns, *chunk],
            )
            out += cur.fetchall()
        return out

    for_update = " FOR UPDATE"

    #: Whether a batch that is mostly DUPLICATE is read without locks first.
    read_first = False
    #: Whether a read-only call runs without a transaction (one round trip, no COMMIT).
    autocommit_reads = False
    #: Whether :meth:`insert_all` exists (a plain INSERT that fails on any existing key).
    plain_insert = False

    def insert_all(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        fps: list[bytes | None],
        owner: bytes | None,
        lease: float,
    ) -> None:
        """Creates every row; raises (see :meth:`is_unique_violation`) if any exists."""
        raise NotImplementedError

    def is_unique_violation(self, exc: BaseException) -> bool:
        return False

    def read_rows(self, cur: Any, table: str, ns: str, keys: list[bytes]) -> list[tuple[Any, ...]]:
        """``(key, state, token, owner, fingerprint, result)`` of existing keys, not locked."""
        t, k, p = self.q(table), self.q("key"), self.ph
        out: list[tuple[Any, ...]] = []
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            cur.execute(
                f"SELECT {k}, state, token, owner, fingerprint, result FROM {t} "
                f"WHERE namespace = {p} AND {k} IN ({', '.join([p] * len(chunk))})",
                [ns, *chunk],
            )
            out += cur.fetchall()
        return out

    def update_rows(
        self, cur: Any, table: str, ns: str, sets: _SetList, types: list[str], rows: list[list[Any]]
    ) -> None:
        """``UPDATE .. SET sets`` for each row ``[key, v0, v1, ..]`` (keys already locked)."""
        raise NotImplementedError

    def set_clause(self, sets: _SetList, value: Callable[[int], str]) -> str:
        return ", ".join(f"{col} = {value(e) if isinstance(e, int) else e}" for col, e in sets)

    def purge(
        self,
        cur: Any,
        table: str,
        ns: str | None,
        skip: list[str],
        window: float,
        limit: int,
        before_delete: BeforeDelete | None = None,
    ) -> tuple[int, int]:
        """Tombstones abandoned claims, then deletes finished rows; ``(tombstoned, deleted)``.

        The conditions are in the outer ``WHERE`` too, so a row claimed again
        while the statement waited for its lock is re-checked and left alone.
        With ``before_delete`` the rows are first selected and locked, the
        callback gets each namespace's PROCESSED keys, and then exactly those
        rows are deleted (see :meth:`SqlStore.purge`).
        """
        p, t = self.ph, self.q(table)
        scope: list[str] = []
        params: list[Any] = []
        if ns is not None:
            scope.append(f"namespace = {p}")
            params.append(ns)
        elif skip:
            scope.append(f"namespace NOT IN ({', '.join([p] * len(skip))})")
            params += skip
        old = f"updated < {self.ago(window)}"
        abandoned = " AND ".join(
            [*scope, old, f"state = {_PROCESSING}", f"lease_until < {self.now}"]
        )
        cur.execute(
            self.limited(
                f"UPDATE {t} SET state = {_RELEASED}, result = NULL, updated = {self.now}",
                table,
                abandoned,
                limit,
            ),
            params * self.where_repeats,
        )
        tombstoned = int(cur.rowcount)
        done = f"state IN ({_PROCESSED}, {_RELEASED})"
        finished = " AND ".join([*scope, old, done])
        if before_delete is None:
            cur.execute(
                self.limited(f"DELETE FROM {t}", table, finished, limit),
                params * self.where_repeats,
            )
            return tombstoned, int(cur.rowcount)
        k = self.q("key")
        cur.execute(
            f"SELECT namespace, {k}, state FROM {t} WHERE {finished} "
            f"ORDER BY updated LIMIT {int(limit)}{self.for_update}",
            params,
        )
        chosen: dict[str, tuple[list[bytes], list[bytes]]] = {}
        for name, key, state in cur.fetchall():
            rows, processed = chosen.setdefault(str(name), ([], []))
            rows.append(bytes(key))
            if int(state) == _PROCESSED:
                processed.append(bytes(key))
        for name, (_, processed) in sorted(chosen.items()):
            if processed:
                before_delete(name, processed)  # raises: the transaction is rolled back
        deleted = 0
        for name, (rows, _) in sorted(chosen.items()):
            deleted += self.delete_keys(cur, table, name, rows, f"{old} AND {done}")
        return tombstoned, deleted

    def delete_keys(self, cur: Any, table: str, ns: str, keys: list[bytes], where: str) -> int:
        """Deletes the rows of ``keys`` (already locked) that still match ``where``."""
        p, k = self.ph, self.q("key")
        deleted = 0
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            cur.execute(
                f"DELETE FROM {self.q(table)} WHERE namespace = {p} "
                f"AND {k} IN ({', '.join([p] * len(chunk))}) AND {where}",
                [ns, *chunk],
            )
            deleted += int(cur.rowcount)
        return deleted

    where_repeats = 2

    def limited(self, verb: str, table: str, where: str, limit: int) -> str:
        """``verb`` on at most ``limit`` rows matching ``where`` (re-checked per row)."""
        k = self.q("key")
        return (
            f"{verb} WHERE (namespace, {k}) IN (SELECT namespace, {k} FROM {self.q(table)} "
            f"WHERE {where} LIMIT {int(limit)}) AND {where}"
        )

    def ago(self, seconds: float) -> str:
        raise NotImplementedError


class _Postgres(_Dialect):
    name = "postgresql"
    max_key_bytes = 2048  # a btree index entry holds at most ~2.7 kB
    read_first = True
    autocommit_reads = True
    plain_insert = True

    @property
    def now(self) -> str:
        return "now()"

    def lease_until(self, lease: float) -> str:
        # The clock at the write, not the transaction's start (it may have waited for locks).
        return f"clock_timestamp() + make_interval(secs => {lease:.6f})"

    def ago(self, seconds: float) -> str:
        return f"now() - make_interval(secs => {seconds:.6f})"

    def epoch(self, column: str) -> str:
        return f"extract(epoch from {column})"

    def error_classes(self) -> tuple[type[BaseException], ...]:
        import psycopg

        return (psycopg.Error,)

    def is_missing_table(self, exc: BaseException) -> bool:
        import psycopg.errors

        return isinstance(exc, psycopg.errors.UndefinedTable)

    def is_transient(self, exc: BaseException) -> bool:
        import psycopg.errors

        # 40001 serialization failure, 40P01 deadlock: the transaction was rolled back.
        return isinstance(exc, psycopg.errors.TransactionRollback)

    def is_broken(self, conn: Any, exc: BaseException) -> bool:
        return bool(getattr(conn, "broken", False) or getattr(conn, "closed", False))

    def is_refused(self, exc: BaseException) -> bool:
        import psycopg

        # SQLSTATE 22 (data exception: out of range, too long) and 23 (integrity).
        return isinstance(exc, (psycopg.DataError, psycopg.IntegrityError))

    def socket_of(self, conn: Any) -> int | None:
        # psycopg waits for a reply without a timeout of its own (see _Watchdog).
        fd: int = conn.fileno()
        return fd

    def durability(self, cur: Any) -> tuple[int, str]:
        cur.execute("SELECT current_setting('fsync'), current_setting('synchronous_commit')")
        fsync, commit = cur.fetchone()
        if fsync != "on":
            return (
                0,
                "fsync off: an OS crash or a power loss can lose or corrupt committed claims",
            )
        if commit == "off":
            return (
                1,
                "synchronous_commit off: a server crash can lose the last committed claims "
                "(up to three wal_writer_delay periods)",
            )
        return 3, f"fsync on, synchronous_commit {commit}: survives a crash and a power loss"

    def prepare(self, conn: Any) -> None:
        import psycopg

        conn.autocommit = False
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED

    def server_version(self, cur: Any) -> str:
        cur.execute("SHOW server_version")
        return f"PostgreSQL {cur.fetchone()[0]}"

    def schema(self, table: str) -> list[str]:
        t = self.q(table)
        return [
            f"""CREATE TABLE IF NOT EXISTS {t} (
                namespace text COLLATE "C" NOT NULL,
                "key" bytea NOT NULL,
                state smallint NOT NULL CHECK (state IN (1, 2, 3)),
                token bigint NOT NULL CHECK (token > 0),
                owner bytea,
                fingerprint bytea,
                result bytea,
                lease_until timestamptz,
                created timestamptz NOT NULL,
                updated timestamptz NOT NULL,
                PRIMARY KEY (namespace, "key")
            )""",
            f"CREATE INDEX IF NOT EXISTS {self.q(table + '_updated')} ON {t} (updated)",
        ]

    def insert_fresh(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        fps: list[bytes | None],
        owner: bytes | None,
        lease: float,
        nonce: bytes,
    ) -> set[bytes] | None:
        self._insert(
            cur,
            table,
            ns,
            keys,
            fps,
            owner,
            lease,
            'ON CONFLICT (namespace, "key") DO NOTHING RETURNING "key"',
        )
        return {bytes(r[0]) for r in cur.fetchall()}

    def insert_all(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        fps: list[bytes | None],
        owner: bytes | None,
        lease: float,
    ) -> None:
        # No speculative insertion: about 40 % less server time than ON CONFLICT.
        self._insert(cur, table, ns, keys, fps, owner, lease, "")

    def is_unique_violation(self, exc: BaseException) -> bool:
        import psycopg.errors

        return isinstance(exc, psycopg.errors.UniqueViolation)

    def _insert(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        fps: list[bytes | None],
        owner: bytes | None,
        lease: float,
        tail: str,
    ) -> None:
        # The arrays go in binary (bytea in text needs escaping per element); a batch
        # without fingerprints sends no array of NULLs.
        with_fps = any(f is not None for f in fps)
        cur.execute(
            f'INSERT INTO {self.q(table)} (namespace, "key", state, token, owner, fingerprint, '
            "lease_until, created, updated) "
            f"SELECT %s::text, u.k, {_PROCESSING}, 1, %s::bytea, "
            f"{'u.f' if with_fps else 'NULL::bytea'}, {self.lease_until(lease)}, now(), now() "
            f"FROM unnest(%b::bytea[]{', %b::bytea[]' if with_fps else ''}) AS "
            f"{'u(k, f)' if with_fps else 'u(k)'} ORDER BY u.k {tail}",
            [ns, owner, keys, fps] if with_fps else [ns, owner, keys],
        )

    def read_rows(self, cur: Any, table: str, ns: str, keys: list[bytes]) -> list[tuple[Any, ...]]:
        cur.execute(
            f'SELECT "key", state, token, owner, fingerprint, result FROM {self.q(table)} '
            'WHERE namespace = %s AND "key" = ANY(%b::bytea[])',
            [ns, keys],
        )
        rows: list[tuple[Any, ...]] = cur.fetchall()
        return rows

    def select_rows(
        self, cur: Any, table: str, ns: str, keys: list[bytes]
    ) -> list[tuple[Any, ...]]:
        cur.execute(
            f'SELECT "key", state, token, owner, fingerprint, result, lease_until > now() '
            f'FROM {self.q(table)} WHERE namespace = %s AND "key" = ANY(%b::bytea[]) '
            'ORDER BY "key" FOR UPDATE',
            [ns, keys],
        )
        rows: list[tuple[Any, ...]] = cur.fetchall()
        return rows

    def update_rows(
        self, cur: Any, table: str, ns: str, sets: _SetList, types: list[str], rows: list[list[Any]]
    ) -> None:
        cols = ["k", *(f"v{i}" for i in range(len(types)))]
        arrays = ", ".join(f"%{'b' if ty == 'bytea' else 's'}::{ty}[]" for ty in ["bytea", *types])
        set_sql = self.set_clause(sets, lambda i: f"u.v{i}")
        cur.execute(
            f"UPDATE {self.q(table)} AS d SET {set_sql} FROM unnest({arrays}) "
            f'AS u({", ".join(cols)}) WHERE d.namespace = %s AND d."key" = u.k',
            [*([r[j] for r in rows] for j in range(len(cols))), ns],
        )

    def delete_keys(self, cur: Any, table: str, ns: str, keys: list[bytes], where: str) -> int:
        cur.execute(
            f'DELETE FROM {self.q(table)} WHERE namespace = %s AND "key" = ANY(%b::bytea[]) '
            f"AND {where}",
            [ns, keys],
        )
        return int(cur.rowcount)


class _MySQL(_Dialect):
    name = "mysql"
    max_key_bytes = 512  # the VARBINARY(512) column

    def q(self, ident: str) -> str:
        return f"`{ident}`"

    @property
    def now(self) -> str:
        return "CURRENT_TIMESTAMP(6)"

    def lease_until(self, lease: float) -> str:
        return f"CURRENT_TIMESTAMP(6) + INTERVAL {max(1, round(lease * 1e6))} MICROSECOND"

    def ago(self, seconds: float) -> str:
        return f"CURRENT_TIMESTAMP(6) - INTERVAL {max(1, round(seconds * 1e6))} MICROSECOND"

    def epoch(self, column: str) -> str:
        return f"UNIX_TIMESTAMP({column})"

    def error_classes(self) -> tuple[type[BaseException], ...]:
        import pymysql

        return (pymysql.err.Error,)

    def is_missing_table(self, exc: BaseException) -> bool:
        args: tuple[Any, ...] = exc.args
        return bool(args) and args[0] == 1146  # ER_NO_SUCH_TABLE

    def is_transient(self, exc: BaseException) -> bool:
        # 1213 deadlock, 1205 lock wait timeout (we roll the whole transaction back).
        args: tuple[Any, ...] = exc.args
        return bool(args) and args[0] in (1205, 1213)

    def is_broken(self, conn: Any, exc: BaseException) -> bool:
        import pymysql

        args: tuple[Any, ...] = exc.args
        code = args[0] if args else None
        # 2006 gone away, 2013 lost during query, 1927 killed, 4031 idle timeout, 2003 refused.
        return (
            isinstance(exc, pymysql.err.InterfaceError)
            or code in (2003, 2006, 2013, 1927, 4031)
            or not getattr(conn, "open", True)
        )

    def is_refused(self, exc: BaseException) -> bool:
        import pymysql

        return isinstance(exc, (pymysql.err.DataError, pymysql.err.IntegrityError))

    def durability(self, cur: Any) -> tuple[int, str]:
        cur.execute("SELECT @@innodb_flush_log_at_trx_commit")
        mode = int(cur.fetchone()[0])
        if mode == 1:
            return 3, "innodb_flush_log_at_trx_commit 1: survives a crash and a power loss"
        if mode == 2:
            return (
                2,
                "innodb_flush_log_at_trx_commit 2: survives a server crash; an OS crash or a "
                "power loss can lose about the last second of committed claims",
            )
        return (
            1,
            f"innodb_flush_log_at_trx_commit {mode}: a server crash can lose about the last "
            "second of committed claims",
        )

    def prepare(self, conn: Any) -> None:
        conn.autocommit(False)
        with conn.cursor() as cur:
            cur.execute("SET SESSION time_zone = '+00:00'")
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        conn.commit()

    def server_version(self, cur: Any) -> str:
        cur.execute("SELECT VERSION()")
        return f"MySQL/MariaDB {cur.fetchone()[0]}"

    def schema(self, table: str) -> list[str]:
        return [
            f"""CREATE TABLE IF NOT EXISTS {self.q(table)} (
                namespace VARCHAR(128) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
                `key` VARBINARY(512) NOT NULL,
                state TINYINT NOT NULL,
                token BIGINT NOT NULL,
                owner VARBINARY(255) NULL,
                fingerprint VARBINARY(255) NULL,
                result LONGBLOB NULL,
                lease_until DATETIME(6) NULL,
                created DATETIME(6) NOT NULL,
                updated DATETIME(6) NOT NULL,
                PRIMARY KEY (namespace, `key`),
                KEY {self.q(table + "_updated")} (updated),
                CONSTRAINT {self.q(table + "_state")} CHECK (state IN (1, 2, 3)),
                CONSTRAINT {self.q(table + "_token")} CHECK (token > 0)
            ) ENGINE=InnoDB ROW_FORMAT=DYNAMIC"""
        ]

    def insert_fresh(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        fps: list[bytes | None],
        owner: bytes | None,
        lease: float,
        nonce: bytes,
    ) -> set[bytes] | None:
        row = (
            f"(%s, %s, {_PROCESSING}, 1, %s, %s, %s, {self.lease_until(lease)}, "
            "CURRENT_TIMESTAMP(6), CURRENT_TIMESTAMP(6))"
        )
        for i in range(0, len(keys), _CHUNK):
            params: list[Any] = []
            for k, fp in zip(keys[i : i + _CHUNK], fps[i : i + _CHUNK], strict=True):
                params += (ns, k, owner, fp, nonce)
            cur.execute(
                f"INSERT INTO {self.q(table)} (namespace, `key`, state, token, owner, "
                "fingerprint, result, lease_until, created, updated) VALUES "
                + ", ".join([row] * (len(params) // 5))
                + " ON DUPLICATE KEY UPDATE `key` = `key`",
                params,
            )
        return None  # the SELECT .. FOR UPDATE tells them by the nonce

    def update_rows(
        self, cur: Any, table: str, ns: str, sets: _SetList, types: list[str], rows: list[list[Any]]
    ) -> None:
        names = ["k", *(f"v{i}" for i in range(len(types)))]
        first = "SELECT " + ", ".join(f"%s AS {n}" for n in names)
        other = "SELECT " + ", ".join(["%s"] * len(names))
        set_sql = self.set_clause(sets, lambda i: f"u.v{i}")
        t = self.q(table)
        for i in range(0, len(rows), _CHUNK):
            chunk = rows[i : i + _CHUNK]
            derived = " UNION ALL ".join([first] + [other] * (len(chunk) - 1))
            cur.execute(
                f"UPDATE {t} JOIN ({derived}) AS u ON {t}.namespace = %s AND {t}.`key` = u.k "
                f"SET {set_sql}",
                [*(v for r in chunk for v in r), ns],
            )

    where_repeats = 1

    def limited(self, verb: str, table: str, where: str, limit: int) -> str:
        return f"{verb} WHERE {where} LIMIT {int(limit)}"


class _SQLite(_Dialect):
    name = "sqlite"
    ph = "?"
    max_key_bytes = 65536
    for_update = ""  # BEGIN IMMEDIATE holds the database's write lock

    @property
    def now(self) -> str:
        return "((julianday('now') - 2440587.5) * 86400.0)"

    def lease_until(self, lease: float) -> str:
        return f"({self.now} + {lease:.6f})"

    def ago(self, seconds: float) -> str:
        return f"({self.now} - {seconds:.6f})"

    def epoch(self, column: str) -> str:
        return column

    def error_classes(self) -> tuple[type[BaseException], ...]:
        import sqlite3

        return (sqlite3.Error,)

    def is_missing_table(self, exc: BaseException) -> bool:
        return "no such table" in str(exc)

    def is_broken(self, conn: Any, exc: BaseException) -> bool:
        import sqlite3

        # "Cannot operate on a closed database."
        return isinstance(exc, sqlite3.ProgrammingError) and "closed" in str(exc)

    def is_refused(self, exc: BaseException) -> bool:
        import sqlite3

        return isinstance(exc, (sqlite3.DataError, sqlite3.IntegrityError))

    def durability(self, cur: Any) -> tuple[int, str]:
        cur.execute("PRAGMA synchronous")
        level = int(cur.fetchone()[0])
        cur.execute("PRAGMA journal_mode")
        journal = str(cur.fetchone()[0]).lower()
        if level >= 2:
            return 3, f"synchronous {level} ({journal}): survives a crash and a power loss"
        if level == 1 and journal == "wal":
            return (
                2,
                "synchronous NORMAL (wal): survives a process crash; a power loss can lose "
                "the last committed claims",
            )
        return (
            0,
            f"synchronous {level} ({journal}): an OS crash or a power loss can lose or "
            "corrupt committed claims",
        )

    def prepare(self, conn: Any) -> None:
        conn.isolation_level = None  # explicit BEGIN IMMEDIATE / COMMIT
        cur = conn.cursor()
        try:
            cur.execute("PRAGMA busy_timeout")
            if not cur.fetchone()[0]:
                cur.execute("PRAGMA busy_timeout = 30000")
        finally:
            cur.close()

    def begin(self, cur: Any, write: bool) -> None:
        if write:
            cur.execute("BEGIN IMMEDIATE")

    def server_version(self, cur: Any) -> str:
        cur.execute("SELECT sqlite_version()")
        return f"SQLite {cur.fetchone()[0]}"

    def schema(self, table: str) -> list[str]:
        t = self.q(table)
        return [
            f"""CREATE TABLE IF NOT EXISTS {t} (
                namespace TEXT NOT NULL,
                "key" BLOB NOT NULL,
                state INTEGER NOT NULL CHECK (state IN (1, 2, 3)),
                token INTEGER NOT NULL CHECK (token > 0),
                owner BLOB,
                fingerprint BLOB,
                result BLOB,
                lease_until REAL,
                created REAL NOT NULL,
                updated REAL NOT NULL,
                PRIMARY KEY (namespace, "key")
            ) WITHOUT ROWID""",
            f"CREATE INDEX IF NOT EXISTS {self.q(table + '_updated')} ON {t} (updated)",
        ]

    def insert_fresh(
        self,
        cur: Any,
        table: str,
        ns: str,
        keys: list[bytes],
        fps: list[bytes | None],
        owner: bytes | None,
        lease: float,
        nonce: bytes,
    ) -> set[bytes] | None:
        row = f"(?, ?, {_PROCESSING}, 1, ?, ?, {self.lease_until(lease)}, {self.now}, {self.now})"
        created: set[bytes] = set()
        for i in range(0, len(keys), _CHUNK):
            params: list[Any] = []
            for k, fp in zip(keys[i : i + _CHUNK], fps[i : i + _CHUNK], strict=True):
                params += (ns, k, owner, fp)
            cur.execute(
                f'INSERT INTO {self.q(table)} (namespace, "key", state, token, owner, '
                "fingerprint, lease_until, created, updated) VALUES "
                + ", ".join([row] * (len(params) // 4))
                + ' ON CONFLICT (namespace, "key") DO NOTHING RETURNING "key"',
                params,
            )
            created.update(bytes(r[0]) for r in cur.fetchall())
        return created

    def update_rows(
        self, cur: Any, table: str, ns: str, sets: _SetList, types: list[str], rows: list[list[Any]]
    ) -> None:
        order = [e for _, e in sets if isinstance(e, int)]
        assert order == sorted(order), "per-row values must appear in order"
        cur.executemany(
            f"UPDATE {self.q(table)} SET {self.set_clause(sets, lambda i: '?')} "
            'WHERE namespace = ? AND "key" = ?',
            [[*r[1:], ns, r[0]] for r in rows],
        )


_DIALECTS: dict[str, type[_Dialect]] = {
    "postgresql": _Postgres,
    "mysql": _MySQL,
    "sqlite": _SQLite,
}


def detect_dialect(conn: Any) -> str:
    """``"postgresql"``, ``"mysql"`` or ``"sqlite"`` from a DB-API connection's driver."""
    module = type(conn).__module__.split(".")[0]
    found = {"psycopg": "postgresql", "pymysql": "mysql", "sqlite3": "sqlite"}.get(module)
    if found is None:
        raise ValueError(
            f"cannot tell the SQL dialect of a {type(conn).__module__}.{type(conn).__name__} "
            "connection; pass dialect='postgresql', 'mysql' or 'sqlite'"
        )
    return found


# -- URLs ----------------------------------------------------------------------------


def _factory(
    url: str, connect_args: dict[str, Any], timeout: float = DEFAULT_TIMEOUT
) -> tuple[str, Callable[[], Any]]:
    if not isinstance(url, str):
        raise TypeError(f"url must be str, not {type(url).__name__}")
    scheme = url.split(":", 1)[0].lower()
    if scheme in ("postgresql", "postgres"):
        args = {**_pg_defaults(url, timeout), **connect_args}

        def connect_pg() -> Any:
            import psycopg

            return psycopg.connect(url, **args)

        return "postgresql", connect_pg
    if scheme in ("mysql", "mariadb"):
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        waits: dict[str, Any] = {
            "connect_timeout": timeout,
            "read_timeout": 2 * timeout,
            "write_timeout": 2 * timeout,
        }
        for name in waits:
            if name in query:
                try:
                    waits[name] = check_timeout(float(query[name]), name)
                except ValueError as exc:
                    raise ValueError(f"{name} in the URL: {exc}") from None
        args = {
            "host": parts.hostname or "localhost",
            "port": parts.port or 3306,
            "user": unquote(parts.username) if parts.username else "root",
            "password": unquote(parts.password) if parts.password else "",
            "database": unquote(parts.path.lstrip("/")) or None,
            "charset": "utf8mb4",
            **waits,
            **({"unix_socket": query["unix_socket"]} if "unix_socket" in query else {}),
            **connect_args,
        }

        def connect_mysql() -> Any:
            import pymysql

            return pymysql.connect(**args)

        return "mysql", connect_mysql
    if scheme == "sqlite":
        if not url.startswith("sqlite:///"):
            raise ValueError(
                f"sqlite URLs are sqlite:///relative/path.db or sqlite:////absolute/path.db, "
                f"got {url!r}"
            )
        path = url[len("sqlite:///") :]
        if not path:
            raise ValueError("sqlite URL has no path")
        args = {"timeout": 30.0, "check_same_thread": False, **connect_args}

        def connect_sqlite() -> Any:
            import sqlite3

            return sqlite3.connect(path, **args)

        return "sqlite", connect_sqlite
    raise ValueError(
        f"unknown SQL URL scheme {scheme!r}: use postgresql://, mysql://, mariadb:// or sqlite:///"
    )


def _pg_defaults(url: str, timeout: float) -> dict[str, Any]:
    """Connect timeout, TCP keepalive and statement_timeout, where the URL sets none."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        given = conninfo_to_dict(url)
    except Exception as exc:  # psycopg.ProgrammingError: not a connection string
        raise ValueError(f"bad PostgreSQL URL: {exc}") from None
    out: dict[str, Any] = {
        "connect_timeout": max(2, round(timeout)),  # libpq waits whole seconds, 2 at least
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
    }
    out = {k: v for k, v in out.items() if k not in given}
    options = str(given.get("options") or "")
    if "statement_timeout" not in options:
        out["options"] = f"{options} -c statement_timeout={round(timeout * 1000)}".strip()
    return out


class _Watchdog:
    """Cuts the connection of a transaction that has waited longer than ``limit`` seconds.

    psycopg waits for a reply without a timeout of its own, and the server's
    statement_timeout cannot fire in a server that does not run (stopped,
    or on a host that froze while its kernel still acknowledges packets, so
    TCP keepalive does not notice either). A thread that shuts the socket
    down wakes the waiting call, which then fails as a lost connection
    (:class:`UnavailableError`); the next call connects again. The thread
    runs while transactions do and ends after a while without any.
    """

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.cuts = 0
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._since = 0.0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(self, fd: int | None) -> Iterator[None]:
        """Watches the socket ``fd`` for the block's duration (nothing when None)."""
        if fd is None or fd < 0:
            yield
            return
        with self._lock:
            self._fd, self._since = fd, time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dedupcore-sql-watchdog", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._fd = None

    def _run(self) -> None:
        step = min(0.25, self.limit / 4)
        idle = 0.0
        while True:
            time.sleep(step)
            with self._lock:
                if self._fd is None:
                    idle += step
                    if idle >= 30.0:
                        self._thread = None
                        return
                    continue
                idle = 0.0
                if time.monotonic() - self._since < self.limit:
                    continue
                # Under the lock: the transaction cannot finish (and its connection
                # cannot be closed, freeing the descriptor) in the meantime.
                self.cuts += 1
                with contextlib.suppress(OSError):
                    cut = socket.socket(fileno=os.dup(self._fd))
                    try:
                        cut.shutdown(socket.SHUT_RDWR)
                    finally:
                        cut.close()  # the duplicate only; the driver owns the socket
                self._fd = None


# -- the store -------------------------------------------------------------------------


class SqlStore(ClaimAPI):
    """A dedup store whose authority is a SQL table (see the module docstring).

    ``connect`` is a DB-API connection factory (psycopg 3, PyMySQL or
    sqlite3); the store owns the connections it makes, one at a time, and
    serializes its calls on it. ``dialect`` is guessed from the connection's
    driver when not given (which takes a connection at once); with a
    ``dialect`` nothing is sent before the first call, so a store opens
    while its database is down and its first call fails closed. Or use
    :meth:`from_url`. ``hang_timeout``: seconds a transaction may wait on a
    PostgreSQL server before its connection is cut (see ``_Watchdog``);
    None (the constructor's default) for no limit.

    Every argument is checked before it is sent: keys, namespace, owner,
    fingerprints, tokens, leases (at most
    :data:`~dedupcore.config.MAX_LEASE_SECONDS`), retention windows and
    size settings. A database error that refuses the request's data anyway
    (out of range, too long, a CHECK) is a
    :class:`~dedupcore.tiers.base.RequestRefusedError` (a ``ValueError``),
    never an :class:`UnavailableError`.
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
        hang_timeout: float | None = None,
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
        self._watchdog = None if hang_timeout is None else _Watchdog(check_timeout(hang_timeout))
        self._told_durability = False
        self._connect = connect
        self._conn: Any = None
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._dup_share: dict[str, float] = {}  # namespace -> average DUPLICATE share
        self._seen_share: dict[str, float] = {}  # namespace -> average share of existing rows
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
        fail with :class:`UnavailableError`, not the open. Each connection
        gets ``timeout`` seconds (default 5) by default:

        - PostgreSQL: ``connect_timeout`` (whole seconds, at least 2),
          ``statement_timeout`` (through ``options``), TCP keepalive (30 s
          idle, 10 s apart, 3 probes), and a transaction that waits twice
          ``timeout`` without an answer has its connection cut (a stopped
          server never runs its statement_timeout). URL query parameters
          (``?connect_timeout=2&options=-c%20statement_timeout%3D1000``)
          win over these defaults.
        - MariaDB/MySQL: ``connect_timeout``, and ``read_timeout`` and
          ``write_timeout`` of twice ``timeout`` (also as URL query
          parameters); PyMySQL turns TCP keepalive on itself.
        - SQLite, a local file, waits up to 30 s for another writer's lock.

        ``connect_args`` go to the driver's ``connect`` and win over all of
        these; other options go to the constructor.
        """
        wait = check_timeout(timeout)
        dialect, factory = _factory(url, dict(connect_args or {}), wait)
        if dialect == "postgresql":
            options.setdefault("hang_timeout", 2 * wait)
        return cls(factory, dialect=dialect, **options)

    @property
    def dialect(self) -> str:
        """``"postgresql"``, ``"mysql"`` or ``"sqlite"``."""
        assert self._dialect is not None
        return self._dialect.name

    def _check_limits(self, d: _Dialect) -> None:
        if self.max_key_bytes > d.max_key_bytes:
            raise ValueError(
                f"max_key_bytes={self.max_key_bytes} does not fit the {d.name} key column "
                f"(at most {d.max_key_bytes} bytes)"
            )

    # -- connections and transactions ------------------------------------------------

    def _connection(self) -> Any:
        if self._conn is not None:
            return self._conn
        try:
            conn = self._connect()
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
        """The watchdog over ``conn`` while it waits for the database (see ``_Watchdog``)."""
        if self._watchdog is None:
            return contextlib.nullcontext()
        assert self._dialect is not None
        return self._watchdog.guard(self._dialect.socket_of(conn))

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

    def _tx(self, body: Callable[[Any], T], *, write: bool = True) -> T:
        """Runs ``body(cursor)`` in one transaction: commit, or roll back and raise.

        Deadlocks and serialization failures are retried; every other driver
        error is an :class:`UnavailableError` (and a broken connection is dropped).
        """
        d = self._dialect
        assert d is not None
        errors = d.error_classes()
        with self._lock:
            attempt = 0
            while True:
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
                time.sleep(min(0.2, 0.005 * 2**attempt) * (0.5 + random.random()))

    def init_schema(self) -> None:
        """Creates the dedup table and its index if they do not exist (idempotent)."""
        d = self._dialect
        assert d is not None

        def create(cur: Any) -> None:
            for statement in d.schema(self.table):
                cur.execute(statement)

        if d.name == "sqlite":
            # WAL: readers do not block the writer (a no-op for :memory: databases).
            self._tx(lambda cur: cur.execute("PRAGMA journal_mode = WAL"), write=False)
        self._tx(create)

    def close(self) -> None:
        """Closes the connection (a later call opens a new one)."""
        with self._lock:
            self._drop()

    def __enter__(self) -> SqlStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the claim API --------------------------------------------------------------

    def claim_many(
        self,
        keys: Iterable[bytes | str],
        *,
        namespace: str,
        lease: float | None = None,
        owner: bytes | str | None = None,
        fingerprints: Sequence[bytes | None] | None = None,
    ) -> list[Claim]:
        """Claims a batch of keys of one namespace in one transaction.

        A key repeated in the batch is NEW once; its later copies are
        IN_PROGRESS (or NEW with the same token for an ``owner``). A bad key
        or a fingerprint conflict raises before anything is claimed.
        """
        key_list = list(keys)
        ns = _keys.check_namespace(namespace).decode()
        raw = [_keys.check_key(k, self.max_key_bytes) for k in key_list]
        lease_s = self.lease if lease is None else check_lease(lease)
        owner_b = check_owner(owner)
        fps = check_fingerprints(fingerprints, len(raw))
        if not raw:
            return []
        first_fp: dict[bytes, bytes | None] = {}
        for k, fp in zip(raw, fps, strict=True):
            first_fp.setdefault(k, fp)
        unique = sorted(first_fp)
        d = self._dialect
        assert d is not None

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
        if seen:
            old = self._seen_share.get(ns, 0.0)
            self._seen_share[ns] = old + _SHARE_WEIGHT * (seen[-1] / len(unique) - old)
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
    ) -> list[Claim]:
        """The outcomes (as DedupStore decides them), then the batch's UPDATEs."""
        d = self._dialect
        assert d is not None
        pending: dict[bytes, _Row] = {}
        # key -> [key, token, fingerprint, owner]: expired leases taken over (the first
        # claim's created stays) and released tombstones claimed again (a fresh record)
        reclaim: dict[bytes, list[Any]] = {}
        restart: dict[bytes, list[Any]] = {}
        renew: dict[bytes, list[Any]] = {}
        claims: list[Claim] = []
        for key, k, fp in zip(key_list, raw, fps, strict=True):
            r = pending[k] if k in pending else current[k]
            if r is None:  # created by this transaction
                pending[k] = _Row(_PROCESSING, 1, owner_b, fp, True)
                claims.append(Claim(key, ns, Outcome.NEW, 1))
                continue
            if r.state != _RELEASED:
                if fp is not None and r.fingerprint is not None and fp != r.fingerprint:
                    raise fingerprint_conflict(
                        key, ns
                    )  # the transaction is rolled back: nothing changes
                if r.state == _PROCESSED:
                    result = unpack_result(r.result)
                    claims.append(Claim(key, ns, Outcome.DUPLICATE, r.token, result))
                    continue
                if owner_b is not None and r.owner == owner_b:
                    if k not in pending:
                        renew[k] = [k]
                        pending[k] = _Row(_PROCESSING, r.token, r.owner, r.fingerprint, True)
                    claims.append(Claim(key, ns, Outcome.NEW, r.token))
                    continue
                if r.live:
                    claims.append(Claim(key, ns, Outcome.IN_PROGRESS, r.token))
                    continue
                takeover = True
                new_fp = fp if fp is not None else r.fingerprint
            else:
                takeover = False
                new_fp = fp
            token = r.token + 1
            (reclaim if takeover else restart)[k] = [k, token, new_fp, owner_b]
            pending[k] = _Row(_PROCESSING, token, owner_b, new_fp, True)
            claims.append(Claim(key, ns, Outcome.NEW, token, takeover=takeover))
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
                    cur, self.table, ns, sets, ["bigint", "bytea", "bytea"], list(rows.values())
                )
        if renew:
            d.update_rows(
                cur,
                self.table,
                ns,
                [("lease_until", lease_sql), ("updated", d.now)],
                [],
                list(renew.values()),
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

        def body(cur: Any) -> None:
            current: dict[bytes, tuple[int, int]] = {
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
                writes[k] = [k, packed] if completing else [k]
            if not writes:
                return
            if completing:
                sets: _SetList = [("state", str(_PROCESSED)), ("result", 0), ("updated", d.now)]
                types = ["bytea"]
            else:
                sets = [("state", str(_RELEASED)), ("result", "NULL"), ("updated", d.now)]
                types = []
            d.update_rows(cur, self.table, ns, sets, types, list(writes.values()))

        self._tx(body)

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

    def release_many(self, items: Iterable[tuple[bytes | str, int]], *, namespace: str) -> None:
        """Releases many claims (a tombstone keeps the token growing)."""
        self._change_many(items, namespace, _RELEASED)

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
                f"WHERE namespace = {p} AND {k} = {p}",
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
        windows are measured on the database server's clock.
        """
        deleted = 0
        for _ in range(100):
            gone = self.purge(limit=limit)
            deleted += gone
            if gone < limit:
                break
        return deleted

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
