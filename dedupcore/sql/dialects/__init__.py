"""The SQL dialects: one object per engine, asked by every module that sends SQL.

:class:`~dedupcore.sql.SqlStore` and the patterns (:mod:`dedupcore.patterns`:
``insert_once``, the transactional dedup table, the state machine) send SQL
to psycopg 3 (PostgreSQL), PyMySQL (MariaDB/MySQL) and sqlite3 connections.
What differs between them is a method or attribute of a :class:`Dialect`
(:mod:`~dedupcore.sql.dialects.base`); nothing else compares engine names.

- :func:`dialect_of`: the dialect of a connection (by its driver), a URL
  (by its scheme) or a name, the one way to get one;
- :func:`connect_url`: a connection factory for a ``postgresql://``,
  ``mysql://``/``mariadb://`` or ``sqlite:///`` URL, with bounded waits;
- :func:`is_unique_violation`: a duplicate-key error of any of the drivers,
  also wrapped by SQLAlchemy, and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dedupcore.sql.dialects.base import DEFAULT_TIMEOUT, Dialect, driver_error
from dedupcore.sql.dialects.mysql import MySQLDialect
from dedupcore.sql.dialects.postgresql import PostgresDialect
from dedupcore.sql.dialects.sqlite import SQLiteDialect

__all__ = [
    "DEFAULT_TIMEOUT",
    "DIALECTS",
    "Dialect",
    "MySQLDialect",
    "PostgresDialect",
    "SQLiteDialect",
    "connect_url",
    "dialect_of",
    "driver_error",
    "is_unique_violation",
]

#: The dialects by engine name.
DIALECTS: dict[str, type[Dialect]] = {
    d.name: d for d in (PostgresDialect, MySQLDialect, SQLiteDialect)
}
_EVERY = tuple(d() for d in DIALECTS.values())


def dialect_of(source: object) -> Dialect:
    """A new dialect object for ``source``.

    ``source`` is a DB-API connection (told by its driver: psycopg, PyMySQL,
    sqlite3), a SQL URL (``scheme:...``) or an engine name (``"postgresql"``,
    ``"mysql"``, ``"sqlite"``). ValueError for anything else.
    """
    if isinstance(source, str):
        if ":" in source:
            scheme = source.split(":", 1)[0].lower()
            for cls in DIALECTS.values():
                if scheme in cls.schemes:
                    return cls()
            raise ValueError(
                f"unknown SQL URL scheme {scheme!r}: use postgresql://, mysql://, mariadb:// "
                "or sqlite:///"
            )
        if source in DIALECTS:
            return DIALECTS[source]()
        raise ValueError(f"dialect must be one of {sorted(DIALECTS)}, got {source!r}")
    module = type(source).__module__.split(".")[0]
    for cls in DIALECTS.values():
        if cls.driver == module:
            return cls()
    raise ValueError(
        f"cannot tell the SQL dialect of a {type(source).__module__}.{type(source).__name__} "
        "connection; pass dialect='postgresql', 'mysql' or 'sqlite'"
    )


def connect_url(
    url: str, connect_args: dict[str, Any], timeout: float = DEFAULT_TIMEOUT
) -> tuple[str, Callable[[], Any]]:
    """``(dialect name, factory)`` for a SQL URL; ``factory()`` opens one new connection.

    Nothing is opened here. The waits (see ``SqlStore.from_url``) are
    defaults that the URL's query parameters and then ``connect_args`` win
    over.
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be str, not {type(url).__name__}")
    dialect = dialect_of(url if ":" in url else f"{url}:")
    return dialect.name, dialect.connector(url, connect_args, timeout)


def is_unique_violation(exc: BaseException) -> bool:
    """True only for a duplicate-key error of psycopg, PyMySQL or sqlite3 (or SQLAlchemy's wrap).

    NOT NULL, foreign key and check violations, and every other error, are False.
    """
    exc = driver_error(exc)
    return any(d.is_duplicate_key(exc) for d in _EVERY)
