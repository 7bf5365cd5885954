"""The stores every conformance test runs against, as ``api``.

``api`` is, in turn: the embedded store in this process, a
:class:`dedupcore.Client` talking to ``dedupcore serve`` (a real subprocess,
from tests/support/daemon.py), Redis and each SQL engine as the authority
(the machine's real servers), a stack with a front filter, a Redis cache and
a cold archive over PostgreSQL, and a store sharded over Redis and SQLite.
Servers and the daemon are shared by a test module; each test works in a
namespace of its own (``ns``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from dedupcore.api import Claim, ClaimAPI, Outcome
from dedupcore.client import Client
from dedupcore.stack import ShardedStore, TieredStore
from dedupcore.store import DedupStore
from dedupcore.tiers.cache import RedisCache
from dedupcore.tiers.redis import RedisStore
from dedupcore.tiers.sql import SqlStore
from tests.authorities.test_sql_store import MY_URL, PG_URL
from tests.support.daemon import PATIENCE, Daemon
from tests.support.servers import require_server

#: The authorities and stacks that live outside this process's data directory.
SERVER_APIS = ["redis_store", "sql_postgresql", "sql_mysql", "sql_sqlite", "tiered", "sharded"]
#: Every ``api``.
ALL_APIS = ["store", "client", *SERVER_APIS]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DedupStore]:
    s = DedupStore.open(tmp_path / "data")
    yield s
    s.close()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    c = daemon.client(timeout=60.0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def redis_store() -> Iterator[ClaimAPI]:
    require_server("redis", 6379)
    client = redis.Redis(host="127.0.0.1", port=6379, db=14)
    s = RedisStore(client, prefix=f"parity{uuid.uuid4().hex[:8]}")
    yield s
    for name in client.scan_iter(match=s.prefix + b":*", count=1000):
        client.delete(name)
    s.close()


def _sql(url: str, tmp: Path, **options: Any) -> Iterator[SqlStore]:
    table = f"parity_{uuid.uuid4().hex[:10]}"
    s = SqlStore.from_url(url.format(tmp=tmp), table=table, **options)
    s.init_schema()
    yield s
    s._drop()
    s.close()


@pytest.fixture(scope="module")
def sql_postgresql(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SqlStore]:
    require_server("postgresql", 5432)
    yield from _sql(PG_URL, tmp_path_factory.mktemp("pg"))


@pytest.fixture(scope="module")
def sql_mysql(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SqlStore]:
    require_server("mariadb", 3306)
    yield from _sql(MY_URL, tmp_path_factory.mktemp("my"))


@pytest.fixture(scope="module")
def sql_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SqlStore]:
    yield from _sql("sqlite:///{tmp}/parity.db", tmp_path_factory.mktemp("sqlite"))


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TieredStore]:
    """Front filter + Redis cache + cold archive over PostgreSQL."""
    require_server("redis", 6379)
    require_server("postgresql", 5432)
    tmp = tmp_path_factory.mktemp("tiered")
    authority = next(_sql(PG_URL, tmp))
    cache = RedisCache(redis.Redis(host="127.0.0.1", port=6379, db=14), prefix="paritycache")
    s = TieredStore(authority, cache=cache, archive=tmp / "cold")
    yield s
    authority._drop()
    s.close()


@pytest.fixture(scope="module")
def sharded(redis_store: RedisStore, tmp_path_factory: pytest.TempPathFactory) -> ShardedStore:
    """Keys routed over Redis and SQLite by jump hash (the shards are closed by their fixtures)."""
    sqlite = next(_sql("sqlite:///{tmp}/shard.db", tmp_path_factory.mktemp("shard")))
    return ShardedStore([redis_store, sqlite])


@pytest.fixture(params=ALL_APIS)
def api(request: pytest.FixtureRequest) -> ClaimAPI:
    """The embedded store, a daemon client, or one of the store stacks."""
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def wait_until(
    done: Callable[[], bool], what: str, timeout: float = PATIENCE, step: float = 0.05
) -> None:
    """Polls ``done`` until it is true; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(step)


def take_over(api: ClaimAPI, key: str, ns: str, **options: Any) -> Claim:
    """Claims ``key`` until its lease has run out and the claim is NEW (a takeover).

    The lease is decided on the authority's clock (the Redis or SQL server's
    for those), so the test polls rather than sleeping a fixed time.
    """
    got: list[Claim] = []

    def claimed() -> bool:
        c = api.claim(key, namespace=ns, **options)
        if c.outcome is Outcome.IN_PROGRESS:
            return False
        got.append(c)
        return True

    wait_until(claimed, f"lease of {key!r} taken over")
    return got[0]
