"""``claim(wait=)`` between processes: a waiter gets the answer of an owner that is
another process, on every store several processes share.

The owner (wait_child.py) holds a key on the daemon, Redis, PostgreSQL, MariaDB or a
SQLite file, and completes or releases it when the test tells it to: only once this
test's claim was answered IN_PROGRESS and waits (its store's ``_wait_change`` was
entered). The waiter then gets DUPLICATE with the owner's result, or NEW.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from dedupcore.api import Claim
from tests.support.procs import PATIENCE, LineProcess
from tests.support.servers import redis_url
from tests.support.stores import (
    OWNER_ENDINGS,
    SQL_ENGINES,
    Stores,
    assert_ending,
    end_owner,
    sql_table,
)

CHILD = Path(__file__).with_name("wait_child.py")
KINDS = ["daemon", "redis", "postgresql", "mariadb", "sqlite"]


@pytest.fixture
def shared(request: pytest.FixtureRequest, stores: Stores, tmp_path: Path) -> Iterator[Any]:
    """(this test's store, how the child opens the same one) for the test's ``kind``."""
    kind = request.param
    if kind == "daemon":
        store = stores.open("daemon", timeout=60.0)
        yield store, {"kind": "daemon", "socket": str(store.path)}
    elif kind == "redis":
        store = stores.open("redis")
        yield (
            store,
            {"kind": "redis", "url": redis_url("conformance"), "prefix": store.prefix.decode()},
        )
    else:  # a table of its own, which the child opens by its URL
        table = sql_table(SQL_ENGINES[kind], tmp_path)
        store = table.store()
        store.init_schema()
        try:
            yield store, {"kind": "sql", "url": table.url, "table": table.table}
        finally:
            store.close()
            table.drop()


def waiting_claim(store: Any, ns: str, pool: ThreadPoolExecutor) -> tuple[Any, threading.Event]:
    """``claim("k", wait=PATIENCE)`` in a thread (its future), and an event set once the
    claim was answered IN_PROGRESS and waits on the store's ``_wait_change``."""
    waits = threading.Event()
    wait_change = store._wait_change

    def spied(*args: Any) -> Any:
        waits.set()
        return wait_change(*args)

    store._wait_change = spied

    def claim() -> Claim:
        c: Claim = store.claim("k", namespace=ns, owner="waiter", wait=PATIENCE)
        return c

    return pool.submit(claim), waits


@pytest.mark.parametrize("shared", KINDS, indirect=True)
@pytest.mark.parametrize(("command", "outcome", "result"), OWNER_ENDINGS)
def test_a_waiter_gets_the_answer_of_an_owner_in_another_process(
    shared: Any, ns: str, command: str, outcome: str, result: Any
) -> None:
    store, config = shared
    config = {**config, "key": "k", "ns": ns, "lease": 600.0}
    with (
        ThreadPoolExecutor(1) as pool,
        LineProcess(
            [sys.executable, str(CHILD), json.dumps(config)], stdin=True, name="owner"
        ) as owner,
    ):
        token = int(owner.expect("HELD"))
        claimed, waits = waiting_claim(store, ns, pool)
        assert waits.wait(PATIENCE), "the waiter did not wait"
        end_owner(owner, command)
        assert_ending(claimed.result(PATIENCE), token, outcome, result)
    if config["kind"] == "daemon":  # woken by the daemon, never told to poll
        figures = store.stats()["daemon"]
        assert figures["waits_woken"] >= 1 and figures["waits_polled"] == 0
