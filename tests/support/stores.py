"""The store matrix: every kind of store a suite runs its tests against, opened for a test
(or a module) and cleaned away after it.

=============  ==============================================================================
kind           what it is
=============  ==============================================================================
embedded       a :class:`~dedupcore.DedupStore` in a directory of its own
daemon         a :class:`~dedupcore.Client` of ``dedupcore serve`` (a subprocess: the shared
               daemon the suite gives, else one of its own per store)
redis          a RedisStore under a key prefix of its own, on the suite's Redis database
postgresql     a SqlStore on a table of its own on the shared PostgreSQL
mariadb        the same on the shared MariaDB
sqlite         the same in a SQLite file of its own
tiered         a stack: front filter, Redis cache, cold archive over a PostgreSQL table
sharded        keys routed by jump hash over a Redis store and a SQLite table
writebehind    a WriteBehindStore: an embedded local table in front of a Redis authority
instrumented   the embedded store counted by :mod:`dedupcore.metrics` (a registry of its own)
=============  ==============================================================================

Each suite picks its rows (tests/conformance: all but the last two; tests/integrations:
embedded, daemon, postgresql, redis; tests/idempotency: embedded, daemon, redis) and
keeps tests apart by namespace (:func:`unique_ns`, the ``ns`` fixture). The SQL
helpers (:class:`SqlTable`, :func:`counting_store`) serve the tests that look at the
tables themselves.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import PATIENCE, wait_until
from tests.support.servers import (
    connect_redis,
    forget_redis_keys,
    redis_url,
    require_server,
    run_statement,
    sql_connect,
    sql_url,
    uid,
)

#: The kinds :meth:`Stores.open` knows.
KINDS = (
    "embedded",
    "daemon",
    "redis",
    "postgresql",
    "mariadb",
    "sqlite",
    "tiered",
    "sharded",
    "writebehind",
    "instrumented",
)
#: The conformance suite's ``api`` ids (its test ids) and the kind each one is.
CONFORMANCE = {
    "store": "embedded",
    "client": "daemon",
    "redis_store": "redis",
    "sql_postgresql": "postgresql",
    "sql_mysql": "mariadb",
    "sql_sqlite": "sqlite",
    "tiered": "tiered",
    "sharded": "sharded",
}
#: The ``api`` ids of the stores that live outside this process's data directory.
SERVER_APIS = ["redis_store", "sql_postgresql", "sql_mysql", "sql_sqlite", "tiered", "sharded"]
#: The SQL engine (SqlStore's dialect name) of each SQL kind.
SQL_ENGINES = {"postgresql": "postgresql", "mariadb": "mysql", "sqlite": "sqlite"}


def unique_ns(prefix: str = "t") -> str:
    """A namespace no other test uses."""
    return f"{prefix}/{uuid.uuid4().hex}"


@pytest.fixture
def ns() -> str:
    """A namespace of this test alone."""
    return unique_ns()


class Stores:
    """Opens stores of every kind under ``home`` and closes (and cleans) them all on
    :meth:`close`, last opened first.

    ``redis_suite`` is the suite's key of :data:`~tests.support.servers.REDIS_DB`;
    ``daemon`` gives the daemon a "daemon" store is a client of (default: a new one per
    store, in a lab of its own).
    """

    def __init__(
        self, home: Path, redis_suite: str, daemon: Callable[[], Any] | None = None
    ) -> None:
        self.home = home
        self.redis_suite = redis_suite
        self._daemon = daemon
        self._lab: Any = None
        self._cleanups: list[Callable[[], None]] = []
        self._shared: dict[str, Any] = {}

    def open(self, kind: str, **options: Any) -> Any:
        """A new store of ``kind`` (one of :data:`KINDS`); ``options`` go to its constructor."""
        if kind in SQL_ENGINES:
            return self.sql(SQL_ENGINES[kind], **options)
        if kind not in KINDS:
            raise ValueError(f"unknown store kind {kind!r} (known: {', '.join(KINDS)})")
        make: Callable[..., Any] = getattr(self, kind)
        return make(**options)

    def shared(self, kind: str) -> Any:
        """The store of ``kind`` this object opened first through here (one per module)."""
        if kind not in self._shared:
            self._shared[kind] = self.open(kind)
        return self._shared[kind]

    def _later(self, cleanup: Callable[[], None]) -> None:
        self._cleanups.append(cleanup)

    # -- the kinds ---------------------------------------------------------------------------

    def embedded(self, **options: Any) -> Any:
        from dedupcore.store import DedupStore

        store = DedupStore.open(self.home / uid("store"), **options)
        self._later(store.close)
        return store

    def daemon(self, **options: Any) -> Any:
        if self._daemon is not None:
            served = self._daemon()
        else:
            if self._lab is None:
                from tests.support.daemon import Lab

                self._lab = Lab()
                self._later(self._lab.close)
            served = self._lab.daemon()
        client = served.client(**options)
        self._later(client.close)
        return client

    def redis(self, **options: Any) -> Any:
        require_server("redis")
        from dedupcore.redis import RedisStore

        prefix = uid("dc")
        store = RedisStore.from_url(redis_url(self.redis_suite), prefix=prefix, **options)
        self._later(lambda: self._forget(prefix, store))
        return store

    def _forget(self, prefix: str, store: Any) -> None:
        """Deletes the keys under ``prefix`` from the suite's database, then closes ``store``."""
        try:
            forget_redis_keys(self.redis_suite, prefix)
        finally:
            store.close()

    def sql(self, engine: str, **options: Any) -> Any:
        """A SqlStore on a fresh table of ``engine`` ("postgresql", "mysql" or "sqlite")."""
        store, table = self._sql(engine, **options)
        self._later(lambda: _close_and_drop(store, table))
        return store

    def _sql(self, engine: str, **options: Any) -> tuple[Any, SqlTable]:
        if engine == "sqlite":
            url = f"sqlite:///{self.home / uid('sqlite')}.db"
        else:
            require_server("postgresql" if engine == "postgresql" else "mariadb")
            url = sql_url(engine)
        table = SqlTable(engine, url, options.pop("table", uid("dc_t")))
        store = table.store(**options)
        store.init_schema()
        return store, table

    def tiered(self, **options: Any) -> Any:
        require_server("redis")
        from dedupcore.stack import TieredStore
        from dedupcore.tiers.cache import RedisCache

        authority, table = self._sql("postgresql")
        prefix = uid("dc_cache")
        cache = RedisCache(connect_redis(self.redis_suite), prefix=prefix)
        stack = TieredStore(authority, cache=cache, archive=self.home / uid("cold"), **options)

        def cleanup() -> None:
            try:
                self._forget(prefix, stack)  # closes the stack, its authority and cache
            finally:
                table.drop()

        self._later(cleanup)
        return stack

    def sharded(self, **options: Any) -> Any:
        """Redis and SQLite shards (closed by their own cleanups, not through the router)."""
        from dedupcore.stack import ShardedStore

        return ShardedStore([self.redis(), self.sql("sqlite")], **options)

    def writebehind(self, **options: Any) -> Any:
        from dedupcore.writebehind import WriteBehindStore

        authority = self.redis()
        store = WriteBehindStore(authority, local=self.home / uid("local"), **options)
        self._later(store.close)  # first: it pushes what it holds to the authority
        return store

    def instrumented(self, **options: Any) -> Any:
        from prometheus_client import CollectorRegistry

        from dedupcore.metrics import Metrics, instrument

        return instrument(self.embedded(**options), Metrics(registry=CollectorRegistry()))

    # -- the end -------------------------------------------------------------------------------

    def close(self) -> None:
        """Runs every cleanup, whatever the test did to its stores (closed one already,
        stopped a server): one that fails does not keep the others from running."""
        while self._cleanups:
            with contextlib.suppress(Exception):
                self._cleanups.pop()()

    def __enter__(self) -> Stores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_and_drop(store: Any, table: SqlTable) -> None:
    try:
        store.close()
    finally:
        table.drop()


#: What an owner in another process (tests/conformance/wait_child.py) does with the key
#: it holds, and what a ``claim(wait=)`` waiting on it then gets: (the owner's command,
#: the waiter's outcome, its result).
OWNER_ENDINGS = [
    pytest.param('complete {"rows": 3}', "duplicate", {"rows": 3}, id="completed"),
    pytest.param("release", "new", None, id="released"),
]


@contextlib.contextmanager
def lmdb_writer_held(store: Any) -> Iterator[None]:
    """Holds the embedded store's LMDB writer (an open write transaction, as a long
    checkpoint holds it) until the block ends; a write of the store waits meanwhile."""
    began, done = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def hold() -> None:
        try:
            txn = store._lmdb.env.begin(write=True)
        except BaseException as exc:
            failed.append(exc)
            began.set()
            raise
        began.set()
        done.wait(PATIENCE)
        txn.abort()

    holder = threading.Thread(target=hold, name="lmdb-writer")
    holder.start()
    try:
        assert began.wait(PATIENCE) and not failed, failed
        yield
    finally:
        done.set()
        holder.join(PATIENCE)


def namespace_writes(store: Any, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event set when the embedded store begins recording a new namespace in LMDB
    (the write that waits while :func:`lmdb_writer_held` holds the writer)."""
    recording = threading.Event()
    plain = store._lmdb.add_namespace

    def add_namespace(name: bytes, ns_id: int) -> None:
        recording.set()
        plain(name, ns_id)

    monkeypatch.setattr(store._lmdb, "add_namespace", add_namespace)
    return recording


def end_owner(owner: Any, command: str) -> None:
    """Tells a wait_child.py owner (a LineProcess) what to do with its key; returns once
    the store acknowledged it and the owner exited."""
    owner.send(command)
    assert owner.expect("DONE") == ""
    assert owner.wait() == 0


def assert_ending(claim: Any, token: int, outcome: str, result: Any) -> None:
    """A waiter's claim got what the owner's ending (one of OWNER_ENDINGS) gives: the
    owner's token and result once completed, a claim of its own once released."""
    assert (claim.outcome.value, claim.result, claim.takeover) == (outcome, result, False)
    assert (claim.token == token) is (outcome == "duplicate")


def take_over(api: Any, key: str, ns: str, **options: Any) -> Any:
    """Claims ``key`` until its lease has run out and the claim is NEW (a takeover).

    The lease is decided on the authority's clock (the Redis or SQL server's
    for those), so the test polls rather than sleeping a fixed time.
    """
    from dedupcore.api import Outcome

    got: list[Any] = []

    def claimed() -> bool:
        c = api.claim(key, namespace=ns, **options)
        if c.outcome is Outcome.IN_PROGRESS:
            return False
        got.append(c)
        return True

    wait_until(claimed, f"lease of {key!r} taken over", PATIENCE)
    return got[0]


# -- SQL tables --------------------------------------------------------------------------------


@dataclass
class SqlTable:
    """One table under test on one SQL engine: its URL, raw connections, statements, a way
    to kill a connection from the server's side, and its removal."""

    name: str  # the engine: "postgresql", "mysql" or "sqlite"
    url: str
    table: str

    @classmethod
    def of(cls, url: str, table: str) -> SqlTable:
        """The table ``table`` at a SQL URL (the engine is the URL's scheme)."""
        scheme = url.split(":", 1)[0].split("+", 1)[0]
        return cls("mysql" if scheme == "mysql" else scheme, url, table)

    def connect(self) -> Any:
        """A raw driver connection in autocommit (not through SqlStore)."""
        if self.name != "sqlite":
            return sql_connect(self.name, autocommit=True, url=self.url)
        return sqlite3.connect(self.url[len("sqlite:///") :], isolation_level=None)

    def store(self, **options: Any) -> Any:
        from dedupcore.sql import SqlStore

        return SqlStore.from_url(self.url, **{"table": self.table, **options})

    def execute(self, sql: str, params: Any = ()) -> list[Any]:
        """One statement on a connection of its own (autocommit): its rows."""
        conn = self.connect()
        try:
            return run_statement(conn, sql, params)
        finally:
            conn.close()

    def kill(self, conn: Any) -> None:
        """Ends a connection from the server side (SQLite: closes it)."""
        if self.name == "postgresql":
            pid = conn.info.backend_pid
            # The timeout form waits until the backend has exited.
            assert self.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)) == [(True,)]
        elif self.name == "mysql":
            cid = conn.thread_id()
            self.execute(f"KILL CONNECTION {int(cid)}")
            for _ in range(100):
                alive = self.execute(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s", (cid,)
                )
                if alive[0][0] == 0:
                    break
                time.sleep(0.05)
        else:
            conn.close()

    def recording(self, wrap: Callable[[Any], Any] = lambda conn: conn) -> tuple[Any, list[Any]]:
        """A connect function for ``SqlStore(connect, ...)`` that keeps every connection it
        opens (``wrap``-ped) in the returned list, in order."""
        from dedupcore.sql.dialects import connect_url

        _, factory = connect_url(self.url, {})
        conns: list[Any] = []

        def connect() -> Any:
            conns.append(wrap(factory()))
            return conns[-1]

        return connect, conns

    def tracked_store(self) -> tuple[Any, list[Any]]:
        """A SqlStore on this table and the connections it opens, in order (a test kills
        one from the server's side with :meth:`kill`)."""
        from dedupcore.sql import SqlStore

        connect, conns = self.recording()
        return SqlStore(connect, table=self.table), conns

    def drop(self) -> None:
        """Drops the table and a partitioned table's companions (SQLite: nothing to do)."""
        if self.name == "sqlite":
            return
        q = '"' if self.name == "postgresql" else "`"
        tail = " CASCADE" if self.name == "postgresql" else ""
        for suffix in ("", "_parts", "_edge"):
            self.execute(f"DROP TABLE IF EXISTS {q}{self.table}{suffix}{q}{tail}")


def sql_table(name: str, tmp_path: Path, prefix: str = "dedup_t") -> SqlTable:
    """A fresh table name on ``name`` ("postgresql", "mysql" or "sqlite" in ``tmp_path``);
    skips (fails under CI) when the server does not answer."""
    table = f"{prefix}_{uuid.uuid4().hex[:12]}"
    if name == "sqlite":
        return SqlTable(name, f"sqlite:///{tmp_path / 'dedup.db'}", table)
    require_server("postgresql" if name == "postgresql" else "mariadb")
    return SqlTable(name, sql_url(name), table)


class _Cursor:
    def __init__(self, cur: Any, log: list[str]) -> None:
        self._cur = cur
        self._log = log

    def execute(self, sql: str, params: Any = None) -> Any:
        self._log.append(" ".join(sql.split())[:60])
        return self._cur.execute(sql, params) if params is not None else self._cur.execute(sql)

    def executemany(self, sql: str, params: Any) -> Any:
        self._log.append(" ".join(sql.split())[:60])
        return self._cur.executemany(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)

    def __enter__(self) -> _Cursor:
        return self

    def __exit__(self, *exc: object) -> None:
        self._cur.close()


class Counting:
    """A connection proxy that records every statement its cursors run (``statements``)."""

    def __init__(self, conn: Any) -> None:
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "statements", [])

    def cursor(self) -> _Cursor:
        return _Cursor(self._conn.cursor(), self.statements)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._conn, name, value)


def counting_store(table: SqlTable) -> tuple[Any, list[Counting]]:
    """A SqlStore on ``table`` whose connections record their statements (the list)."""
    from dedupcore.sql import SqlStore

    connect, conns = table.recording(Counting)
    store = SqlStore(connect, dialect=table.name, table=table.table)
    store.server_version()  # the store connects on its first call; tests count from here
    return store, conns
