"""Fixtures of the broker integration tests: real RabbitMQ, NATS JetStream, PostgreSQL, Redis.

Every test names its queues, streams and tables with a fresh uuid and
deletes them afterwards: other test runs use the same servers at the same
time. A server that does not answer skips its tests (fails them with
CI=true), through :func:`tests.support.servers.require_server`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import SERVERS, require_server, uid
from tests.support.stores import Stores


@pytest.fixture
def channel() -> Iterator[Any]:
    """A pika BlockingConnection channel; queues it declares via ``declare`` are deleted."""
    require_server("rabbitmq")
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(SERVERS.rabbitmq))
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
def store_factory(tmp_path: Path) -> Iterator[Callable[[str], Any]]:
    """``store_factory(kind)`` -> a new store of the matrix (tests/support/stores.py) of
    that kind ("sql": PostgreSQL; "daemon": a daemon of its own), closed after the test."""
    with Stores(tmp_path, "integrations") as stores:
        yield lambda kind: stores.open("postgresql" if kind == "sql" else kind)
