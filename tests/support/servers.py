"""The servers the integration tests talk to: where they are, whether they answer.

Each server's address comes from a command-line option, else from an environment
variable, else from the local default that ``scripts/services.sh`` starts:

- Redis: ``--redis-url``, DEDUPCORE_TEST_REDIS, redis://127.0.0.1:6379 (no database:
  each suite adds its own, :data:`REDIS_DB`);
- PostgreSQL: ``--postgres-url``, DEDUPCORE_TEST_POSTGRES,
  postgresql://postgres@127.0.0.1:5432/test;
- MariaDB: ``--mariadb-url``, DEDUPCORE_TEST_MARIADB, mysql://root@127.0.0.1:3306/test;
- RabbitMQ: ``--amqp-url``, DEDUPCORE_TEST_AMQP, amqp://guest:guest@127.0.0.1:5672/%2F;
- NATS: ``--nats-url``, DEDUPCORE_TEST_NATS, nats://127.0.0.1:4222;
- Kafka: ``--kafka-bootstrap``, DEDUPCORE_TEST_KAFKA (or DEDUPCORE_KAFKA_BOOTSTRAP, which
  ``./dev test`` sets), 127.0.0.1:9092.

An option given on the command line is put into the environment too, so child
processes (``dedupcore serve``, workers) see the same servers. Tests read the
addresses from :data:`SERVERS` when they run (a module's constants are made at
collection, after the options are read).

A server that does not answer skips its tests with the reason; under CI=true it
fails them, since the CI job starts every server first. Each suite keeps to its
own Redis database (:data:`REDIS_DB`), and names its tables, prefixes, queues and
streams with :func:`uid`: other runs use the same servers at the same time.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

IN_CI = os.environ.get("CI") == "true"


@dataclass
class Servers:
    """The address of each server (a URL; Kafka's is ``host:port``)."""

    redis: str = "redis://127.0.0.1:6379"
    postgresql: str = "postgresql://postgres@127.0.0.1:5432/test"
    mariadb: str = "mysql://root@127.0.0.1:3306/test"
    rabbitmq: str = "amqp://guest:guest@127.0.0.1:5672/%2F"
    nats: str = "nats://127.0.0.1:4222"
    kafka: str = "127.0.0.1:9092"


#: server -> (command-line option, environment variables, first found wins; default port).
SETTINGS: dict[str, tuple[str, tuple[str, ...], int]] = {
    "redis": ("--redis-url", ("DEDUPCORE_TEST_REDIS",), 6379),
    "postgresql": ("--postgres-url", ("DEDUPCORE_TEST_POSTGRES",), 5432),
    "mariadb": ("--mariadb-url", ("DEDUPCORE_TEST_MARIADB",), 3306),
    "rabbitmq": ("--amqp-url", ("DEDUPCORE_TEST_AMQP",), 5672),
    "nats": ("--nats-url", ("DEDUPCORE_TEST_NATS",), 4222),
    "kafka": ("--kafka-bootstrap", ("DEDUPCORE_TEST_KAFKA", "DEDUPCORE_KAFKA_BOOTSTRAP"), 9092),
}


def _set(servers: Servers, name: str, value: str) -> None:
    # Redis's URL is without a database: each suite adds its own number.
    setattr(servers, name, value.rstrip("/") if name == "redis" else value)


def _from_environment() -> Servers:
    found = Servers()
    for name, (_, variables, _) in SETTINGS.items():
        for variable in variables:
            if os.environ.get(variable):
                _set(found, name, os.environ[variable])
                break
    return found


#: Where the servers are (the environment's, then the command line's, once it is read).
SERVERS = _from_environment()

#: The Redis database each suite or module keeps to; ``tests/docs`` takes 1 to 8 in turn.
#: Suites that share a number keep apart by key prefix and never flush it.
REDIS_DB: dict[str, int] = {
    "idempotency": 9,  # tests/idempotency: flushed before and after each test
    "tiered_config": 10,  # tests/authorities/test_tiered_config.py
    "durability_report": 11,  # tests/daemon/test_durability_report.py
    "authorities": 12,  # the redis_client fixture; test_redis_store, test_writebehind_redis
    "integrations": 13,  # tests/integrations (prefixes); test_stack's second Redis shard
    "conformance": 14,  # tests/conformance (prefixes); test_metrics_stores (prefixes)
    "stack": 15,  # tests/authorities/test_stack.py; test_stats_authorities (namespaces)
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dedupcore servers", "where the integration tests find their servers")
    for name, (option, variables, _) in SETTINGS.items():
        group.addoption(
            option,
            dest=f"dedupcore_{name}",
            default=None,
            help=f"the {name} server (default: ${variables[0]}, else {getattr(Servers(), name)})",
        )


def pytest_configure(config: pytest.Config) -> None:
    for name, (_, variables, _) in SETTINGS.items():
        given = config.getoption(f"dedupcore_{name}")
        if given:
            _set(SERVERS, name, given)
            os.environ[variables[0]] = given  # child processes read the same


def pytest_report_header(config: pytest.Config) -> str:
    return "servers: " + ", ".join(f"{f.name} {getattr(SERVERS, f.name)}" for f in fields(Servers))


# -- addresses ---------------------------------------------------------------------------


def address(name: str) -> tuple[str, int]:
    """(host, port) of server ``name`` ("redis", "postgresql", "mariadb", ...)."""
    url = getattr(SERVERS, name)
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    return parts.hostname or "127.0.0.1", parts.port or SETTINGS[name][2]


def redis_url(suite: str) -> str:
    """The URL of the Redis database of ``suite`` (a key of :data:`REDIS_DB`)."""
    return f"{SERVERS.redis}/{REDIS_DB[suite]}"


def connect_redis(suite: str, **options: Any) -> Any:
    """A redis-py client on the database of ``suite``."""
    import redis

    return redis.Redis.from_url(redis_url(suite), **options)


def forget_redis_keys(where: str | Any, prefix: str) -> None:
    """Deletes every key whose name starts with ``prefix``: from the database of the
    suite named ``where`` (a key of :data:`REDIS_DB`), or through the redis-py
    client ``where``."""
    client = connect_redis(where) if isinstance(where, str) else where
    try:
        names = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if names:
            client.delete(*names)
    finally:
        if isinstance(where, str):
            client.close()


def sql_url(engine: str) -> str:
    """The URL of the shared SQL server of ``engine`` ("postgresql", or "mysql"/"mariadb")."""
    return SERVERS.postgresql if engine == "postgresql" else SERVERS.mariadb


def sqlalchemy_url(engine: str) -> str:
    """The same server as :func:`sql_url`, with the driver SQLAlchemy is to use."""
    url = sql_url(engine)
    scheme, rest = url.split("://", 1)
    return f"{scheme}+{'psycopg' if engine == 'postgresql' else 'pymysql'}://{rest}"


def mariadb_args(url: str | None = None) -> dict[str, Any]:
    """``pymysql.connect`` arguments of a MariaDB URL (default: the shared server's)."""
    parts = urlsplit(url or SERVERS.mariadb)
    return {
        "host": parts.hostname or "127.0.0.1",
        "port": parts.port or 3306,
        "user": unquote(parts.username or "root"),
        "password": unquote(parts.password or ""),
        "database": parts.path.lstrip("/") or "test",
    }


def sql_connect(engine: str, *, autocommit: bool = False, url: str | None = None) -> Any:
    """A DB-API connection to PostgreSQL or MariaDB (``engine`` "mysql") at ``url``
    (default: the shared server)."""
    if engine == "postgresql":
        import psycopg

        return psycopg.connect(url or SERVERS.postgresql, autocommit=autocommit)
    import pymysql

    return pymysql.connect(**mariadb_args(url), autocommit=autocommit)


def run_statement(conn: Any, sql: str, params: Any = ()) -> list[Any]:
    """Runs one statement on a DB-API connection: its rows (none for a statement without)."""
    cur = conn.cursor()
    try:
        cur.execute(sql, params)
        return list(cur.fetchall()) if cur.description else []
    finally:
        cur.close()


def pg_connect(url: str | None = None, *, patience: float = 120.0, **kwargs: Any) -> Any:
    """``psycopg.connect``, retried while the server is out of connection slots.

    Other test suites share this PostgreSQL; one that holds many connections
    for a while must not fail these tests.
    """
    import psycopg

    deadline = time.monotonic() + patience
    while True:
        try:
            return psycopg.connect(url or SERVERS.postgresql, **kwargs)
        except psycopg.OperationalError as exc:
            if "too many clients" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def uid(prefix: str) -> str:
    """A name no other test run uses (an SQL identifier, a key prefix, a queue or stream)."""
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


# -- whether they answer -----------------------------------------------------------------


def reachable(name: str, port: int | None = None) -> bool:
    """Whether server ``name`` accepts a TCP connection (on ``port``, if given)."""
    host, default = address(name)
    try:
        with socket.create_connection((host, port or default), timeout=2):
            return True
    except OSError:
        return False


def require_server(name: str, port: int | None = None) -> None:
    """Skips (or, in CI, fails) the test when server ``name`` does not answer."""
    if reachable(name, port):
        return
    host, default = address(name)
    where = f"{host}:{port or default}"
    message = f"{name} is not reachable on {where} (scripts/services.sh starts it)"
    if not IN_CI:
        # A developer's machine without this server: the test cannot run, and the
        # reason is shown. CI starts every server first, so there it is a failure.
        pytest.skip(message)
    pytest.fail(message)


# -- fixtures ----------------------------------------------------------------------------


def flushed_redis(suite: str) -> Iterator[Any]:
    """A fixture's body: a client on the database of ``suite``, flushed before and after."""
    require_server("redis")
    client = connect_redis(suite)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def redis_client() -> Iterator[Any]:
    """A redis-py client on the database of tests/authorities, flushed before and after."""
    yield from flushed_redis("authorities")


@pytest.fixture
def pg() -> Iterator[Any]:
    """A psycopg connection to the shared PostgreSQL (autocommit off)."""
    require_server("postgresql")
    conn = pg_connect()
    yield conn
    conn.close()


@pytest.fixture
def pg_tables() -> Iterator[list[str]]:
    """Append table names; they are dropped from the shared PostgreSQL after the test."""
    names: list[str] = []
    yield names
    if not names:
        return
    with pg_connect(autocommit=True) as conn:
        for name in names:
            conn.execute(f"DROP TABLE IF EXISTS {name}")
