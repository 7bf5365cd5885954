"""What differs between the SQL engines, for every module that writes SQL.

:mod:`dedupcore.tiers.sql` (the SQL authority) and :mod:`dedupcore.patterns`
(``insert_once``, the transactional dedup table, the state machine) send SQL
to psycopg 3 (PostgreSQL), PyMySQL (MariaDB/MySQL) and sqlite3 connections.
The pieces they share are here, written once:

- :func:`detect_dialect`: ``"postgresql"``, ``"mysql"`` or ``"sqlite"`` from
  a connection's driver;
- :func:`placeholder` and :func:`quote`: the driver's parameter marker and
  identifier quoting;
- :func:`on_conflict_do_nothing`: the insert-if-absent clause of PostgreSQL
  and SQLite (MariaDB has none that fires on one unique key only; each
  caller says what it does there);
- :func:`is_unique_violation` (and :func:`driver_error`): a duplicate-key
  error of any of the drivers, also wrapped by SQLAlchemy, and nothing else;
- :func:`connect_url`: a connection factory for a ``postgresql://``,
  ``mysql://``/``mariadb://`` or ``sqlite:///`` URL, with bounded waits.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from dedupcore.sql.dialects.base import (
    DEFAULT_TIMEOUT,
    DIALECTS,
    _Dialect,
    detect_dialect,
    driver_error,
    is_unique_violation,
    on_conflict_do_nothing,
    placeholder,
    quote,
)
from dedupcore.sql.dialects.mysql import _MySQL
from dedupcore.sql.dialects.postgresql import _Postgres
from dedupcore.sql.dialects.sqlite import _SQLite
from dedupcore.tiers.base import check_timeout

__all__ = [
    "DEFAULT_TIMEOUT",
    "DIALECTS",
    "connect_url",
    "detect_dialect",
    "driver_error",
    "is_unique_violation",
    "on_conflict_do_nothing",
    "placeholder",
    "quote",
]

_DIALECTS: dict[str, type[_Dialect]] = {
    "postgresql": _Postgres,
    "mysql": _MySQL,
    "sqlite": _SQLite,
}


# -- connections by URL ----------------------------------------------------------------


def connect_url(
    url: str, connect_args: dict[str, Any], timeout: float = DEFAULT_TIMEOUT
) -> tuple[str, Callable[[], Any]]:
    """``(dialect, factory)`` for a SQL URL; ``factory()`` opens one new connection.

    Nothing is opened here. The waits (see ``SqlStore.from_url``) are
    defaults that the URL's query parameters and then ``connect_args`` win
    over.
    """
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
        # Caps of each wait; a store's call gives each one at most its time left.
        waits: dict[str, Any] = {
            "connect_timeout": timeout,
            "read_timeout": timeout,
            "write_timeout": timeout,
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
