"""Fixtures of the broker integration tests: real RabbitMQ, NATS JetStream, PostgreSQL, Redis.

Every test names its queues, streams and tables with a fresh uuid and
deletes them afterwards: other test runs use the same servers at the same
time. A server that does not answer skips its tests (fails them with
CI=true), through :func:`tests.support.servers.require_server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupcore import DedupStore
from tests.support.servers import require_server

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
NATS_URL = "nats://127.0.0.1:4222"
REDIS_URL = "redis://127.0.0.1:6379/13"

STORE_KINDS = ("embedded", "daemon", "sql", "redis")


def pg_connect(url: str = PG_URL, *, patience: float = 120.0, **kwargs: Any) -> Any:
    """``psycopg.connect``, retried while the server is out of connection slots.

    Other test suites share this PostgreSQL; one that holds many connections
    for a while must not fail these tests.
    """
    import psycopg

    deadline = time.monotonic() + patience
    while True:
        try:
            return psycopg.connect(url, **kwargs)
        except psycopg.OperationalError as exc:
            if "too many clients" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class FirstBlocks:
    """A handler that records the keys it gets and blocks in the first call of ``key``.

    ``started`` is set when that call begins; it returns once ``release`` is
    set. ``__call__`` is the plain handler, ``handle_async`` the ``async
    def`` one (it waits in a worker thread, so the event loop goes on).
    """

    def __init__(self, key: str = "a", patience: float = 60.0) -> None:
        self.key = key
        self.patience = patience
        self.calls: list[Any] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def _first(self, d: Any) -> bool:
        self.calls.append(d.key)
        first = d.key == self.key and self.calls.count(self.key) == 1
        if first:
            self.started.set()
        return first

    def __call__(self, d: Any) -> None:
        if self._first(d):
            assert self.release.wait(self.patience)

    async def handle_async(self, d: Any) -> None:
        if self._first(d):
            assert await asyncio.to_thread(self.release.wait, self.patience)

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, self.patience)


def uid(prefix: str) -> str:
    """A name no other test run uses (an SQL identifier, a queue or stream name)."""
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


@pytest.fixture
def pg() -> Iterator[Any]:
    """A psycopg connection to the test database (autocommit off)."""
    require_server("postgresql", 5432)
    conn = pg_connect()
    yield conn
    conn.close()


@pytest.fixture
def pg_tables() -> Iterator[list[str]]:
    """Append table names; they are dropped after the test."""
    names: list[str] = []
    yield names
    if not names:
        return
    with pg_connect(autocommit=True) as conn:
        for name in names:
            conn.execute(f"DROP TABLE IF EXISTS {name}")


@pytest.fixture
def channel() -> Iterator[Any]:
    """A pika BlockingConnection channel; queues it declares via ``declare`` are deleted."""
    require_server("rabbitmq", 5672)
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    ch = conn.channel()
    queues: list[str] = []

    def declare(name: str | None = None, *, durable: bool = False, **arguments: Any) -> str:
        q = name or uid("dc_q")
        ch.queue_declare(q, durable=durable, auto_delete=False, arguments=arguments or None)
        queues.append(q)
        return q

    ch.declare = declare  # type: ignore[attr-defined]
    yield ch
    with contextlib.suppress(Exception):
        if not ch.is_open:
            ch = conn.channel()
        for q in queues:
            ch.queue_delete(q)
    with contextlib.suppress(Exception):
        conn.close()


@pytest.fixture
def store_factory(tmp_path: Path, pg_tables: list[str]) -> Iterator[Any]:
    """``store_factory(kind)`` -> a ClaimAPI store of that kind, closed after the test."""
    opened: list[Any] = []
    labs: list[Any] = []
    redis_clients: list[Any] = []

    def make(kind: str) -> Any:
        if kind == "embedded":
            s: Any = DedupStore.open(tmp_path / uid("store"))
        elif kind == "daemon":
            from tests.support.daemon import Lab

            lab = Lab()
            labs.append(lab)
            s = lab.daemon().client()
        elif kind == "sql":
            require_server("postgresql", 5432)
            from dedupcore.tiers.sql import SqlStore

            table = uid("dc_claims")
            pg_tables.append(table)
            s = SqlStore.from_url(PG_URL, table=table)
            s.init_schema()
        elif kind == "redis":
            require_server("redis", 6379)
            import redis

            from dedupcore.tiers.redis import RedisStore

            prefix = uid("dc")
            s = RedisStore.from_url(REDIS_URL, prefix=prefix)
            client = redis.Redis.from_url(REDIS_URL)
            redis_clients.append((client, prefix))
        else:
            raise ValueError(kind)
        opened.append(s)
        return s

    yield make
    for s in opened:
        with contextlib.suppress(Exception):
            s.close()
    for lab in labs:
        lab.close()
    for client, prefix in redis_clients:
        with contextlib.suppress(Exception):
            keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
            if keys:
                client.delete(*keys)
        client.close()
