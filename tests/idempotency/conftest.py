"""Stores for the idempotency tests: embedded, through the daemon, and on the real Redis.

The daemon fixtures are the shared ones of ``tests/support/daemon.py``; Redis
uses database 9 of its own, flushed before and after each test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupcore import DedupStore
from dedupcore.api import ClaimAPI
from tests.support.daemon import Daemon, Lab
from tests.support.servers import require_server

REDIS_URL = "redis://127.0.0.1:6379/9"
STORE_KINDS = ("embedded", "daemon", "redis")


@pytest.fixture
def redis_store() -> Iterator[ClaimAPI]:
    """A RedisStore on database 9, flushed before and after."""
    require_server("redis", 6379)
    from dedupcore.tiers.redis import RedisStore

    store = RedisStore.from_url(REDIS_URL)
    store.client.flushdb()
    try:
        yield store
    finally:
        store.client.flushdb()
        store.client.close()


@pytest.fixture(params=STORE_KINDS)
def any_store(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    module_lab: Lab,
) -> Iterator[ClaimAPI]:
    """Each kind of ClaimAPI store in turn."""
    kind = request.param
    if kind == "embedded":
        store: Any = DedupStore.open(tmp_path / "store")
        try:
            yield store
        finally:
            store.close()
    elif kind == "daemon":
        d: Daemon = request.getfixturevalue("daemon")
        client = d.client()
        try:
            yield client
        finally:
            client.close()
    else:
        yield request.getfixturevalue("redis_store")
