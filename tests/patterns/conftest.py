"""Fixtures of the SQL pattern tests: the machine's PostgreSQL and MariaDB, and SQLite files.

Every test makes tables of its own (random names, dropped afterwards), since
other runs use the same databases at the same time. A server that does not
answer skips its tests (fails them under CI=true), as in tests/authorities.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import require_server, run_statement, sql_connect, sqlalchemy_url

ENGINES = ("postgresql", "mysql", "sqlite")
#: Engines with plain DB-API connections, then SQLAlchemy Connections over the same drivers.
ALL_KINDS = (*ENGINES, "sa-postgresql", "sa-mysql", "sa-sqlite")

_sa_engines: dict[str, Any] = {}


@dataclass
class DB:
    """One database under test: connections of one kind, admin statements, fresh tables."""

    kind: str  # "postgresql", "mysql", "sqlite", or "sa-" + one of them
    sqlite_path: str
    tables: list[str] = field(default_factory=list)
    conns: list[Any] = field(default_factory=list)

    @property
    def engine(self) -> str:
        return self.kind.removeprefix("sa-")

    @property
    def sa(self) -> bool:
        return self.kind.startswith("sa-")

    @property
    def ph(self) -> str:
        return "?" if self.engine == "sqlite" else "%s"

    def raw_connect(self, *, autocommit: bool = False) -> Any:
        """A DB-API connection (not tracked)."""
        if self.engine != "sqlite":
            return sql_connect(self.engine, autocommit=autocommit)
        return sqlite3.connect(
            self.sqlite_path,
            timeout=30.0,
            isolation_level=None if autocommit else "",
            check_same_thread=False,
        )

    def connect(self) -> Any:
        """A connection of the kind under test, transactional, closed after the test."""
        conn = sa_engine(self.engine, self.sqlite_path).connect() if self.sa else self.raw_connect()
        self.conns.append(conn)
        return conn

    def admin(self, sql: str, params: Any = ()) -> list[Any]:
        """Runs one statement on its own autocommit connection."""
        conn = self.raw_connect(autocommit=True)
        try:
            return run_statement(conn, sql, params)
        finally:
            conn.close()

    def table(self, prefix: str = "t") -> str:
        """A fresh table name, dropped after the test."""
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        self.tables.append(name)
        return name

    def create(self, prefix: str, columns: str) -> str:
        name = self.table(prefix)
        engine = " ENGINE=InnoDB" if self.engine == "mysql" else ""
        self.admin(f"CREATE TABLE {name} ({columns}){engine}")
        return name

    def count(self, table: str, where: str = "", params: Any = ()) -> int:
        rows = self.admin(f"SELECT COUNT(*) FROM {table} {where}", params)
        return int(rows[0][0])

    def execute(self, conn: Any, sql: str, params: Any = ()) -> list[Any]:
        """A statement on a connection under test (DB-API or SQLAlchemy)."""
        if self.sa:
            result = (
                conn.exec_driver_sql(sql, tuple(params)) if params else conn.exec_driver_sql(sql)
            )
            return [tuple(r) for r in result.fetchall()] if result.returns_rows else []
        return run_statement(conn, sql, params)

    def dbapi(self, conn: Any) -> Any:
        return conn.connection.dbapi_connection if self.sa else conn

    def wait_blocked(self, conn: Any, thread: threading.Thread) -> None:
        """Returns once ``conn`` (used by ``thread``) waits for a lock held by another transaction.

        PostgreSQL and MariaDB are asked; SQLite cannot be, so it only checks
        that the thread is still waiting after a moment.
        """
        raw = self.dbapi(conn)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert thread.is_alive(), "the contender finished instead of waiting for the lock"
            if self.engine == "postgresql":
                rows = self.admin(
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                    (raw.info.backend_pid,),
                )
                if rows and rows[0][0] == "Lock":
                    return
            elif self.engine == "mysql":
                rows = self.admin(
                    "SELECT trx_state FROM information_schema.INNODB_TRX "
                    "WHERE trx_mysql_thread_id = %s",
                    (raw.thread_id(),),
                )
                if rows and rows[0][0] == "LOCK WAIT":
                    return
                # A wait InnoDB does not list as LOCK WAIT (a metadata lock, or
                # the moment before the row lock is queued): the connection's
                # statement has been running for seconds, which nothing in these
                # tests does unless it waits for the other transaction.
                seen = self.admin(
                    "SELECT STATE, TIME, INFO FROM information_schema.PROCESSLIST WHERE ID = %s",
                    (raw.thread_id(),),
                )
                if seen and seen[0][2] is not None and seen[0][1] >= 2:
                    return
            else:
                time.sleep(0.3)
                assert thread.is_alive(), "the contender did not wait for the writer lock"
                return
            time.sleep(0.02)
        if self.engine == "mysql":  # what the server says the connection does
            seen = self.admin(
                "SELECT STATE, TIME, INFO FROM information_schema.PROCESSLIST WHERE ID = %s",
                (raw.thread_id(),),
            )
            raise AssertionError(f"the contender never waited for the lock: {seen!r}")
        raise AssertionError("the contender never waited for the lock")

    def cleanup(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.close()
        if self.engine != "sqlite":
            for table in self.tables:
                self.admin(f"DROP TABLE IF EXISTS {table}")


def sa_engine(engine: str, sqlite_path: str) -> Any:
    import sqlalchemy

    if engine == "sqlite":
        return sqlalchemy.create_engine(
            f"sqlite:///{sqlite_path}",
            connect_args={"timeout": 30.0, "check_same_thread": False},
            poolclass=sqlalchemy.pool.NullPool,
        )
    if engine not in _sa_engines:
        _sa_engines[engine] = sqlalchemy.create_engine(
            sqlalchemy_url(engine), poolclass=sqlalchemy.pool.NullPool
        )
    return _sa_engines[engine]


def _make(kind: str, tmp_path: Path) -> DB:
    engine = kind.removeprefix("sa-")
    if engine == "postgresql":
        require_server("postgresql")
    elif engine == "mysql":
        require_server("mariadb")
    return DB(kind, str(tmp_path / "patterns.db"))


def _fixture(kind: str, tmp_path: Path) -> Iterator[DB]:
    db = _make(kind, tmp_path)
    try:
        yield db
    finally:
        db.cleanup()


@pytest.fixture(params=ENGINES)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DB]:
    """PostgreSQL, MariaDB or SQLite through its DB-API driver."""
    yield from _fixture(request.param, tmp_path)


@pytest.fixture(params=ALL_KINDS)
def anydb(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DB]:
    """Each engine through its DB-API driver and through a SQLAlchemy Connection."""
    yield from _fixture(request.param, tmp_path)


@pytest.fixture
def in_thread() -> Iterator[Callable[..., tuple[threading.Thread, dict[str, Any]]]]:
    """``in_thread(fn, *args)`` starts fn in a thread; the dict gets "value" or "error"."""
    threads: list[threading.Thread] = []

    def start(fn: Callable[..., Any], *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["value"] = fn(*args)
            except BaseException as exc:  # reported to the test
                out["error"] = exc

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
        return t, out

    yield start
    for t in threads:
        t.join(30)
