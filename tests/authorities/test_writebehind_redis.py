"""WriteBehindStore against the machine's real Redis (db 12) with both kinds of local table."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupcore.api import Outcome
from dedupcore.errors import UnavailableError
from dedupcore.record import State
from dedupcore.redis import RedisStore
from dedupcore.store import DedupStore
from dedupcore.writebehind import WriteBehindStore
from tests.support.cluster import free_port
from tests.support.servers import redis_url

NS = "orders/billing"
URL = redis_url("authorities")
NEVER = 3600.0


@pytest.fixture
def authority(redis_client: Any) -> Iterator[RedisStore]:
    # redis_client flushes db 12 (and only db 12) before and after.
    s = RedisStore.from_url(URL)
    yield s
    s.close()


@pytest.fixture
def second(redis_client: Any) -> Iterator[RedisStore]:
    """Another consumer's connection to the same authority."""
    s = RedisStore.from_url(URL)
    yield s
    s.close()


@pytest.fixture(params=["memory", "embedded"])
def wb(request: Any, authority: RedisStore, tmp_path: Path) -> Iterator[WriteBehindStore]:
    local = None if request.param == "memory" else tmp_path / "local"
    s = WriteBehindStore(authority, local=local, flush_interval=NEVER, flush_keys=1_000_000)
    yield s
    s.close()


def test_window_against_redis(wb: WriteBehindStore, second: RedisStore) -> None:
    # Answered NEW locally, not pushed: the second consumer is answered NEW too.
    assert wb.claim("in-window", namespace=NS).outcome is Outcome.NEW
    assert second.get("in-window", namespace=NS) is None
    taken = second.claim("in-window", namespace=NS)
    assert taken.outcome is Outcome.NEW
    # Pushed: the second consumer waits, and after the completion gets the result.
    c = wb.claim("pushed", namespace=NS)
    wb.flush()
    assert second.claim("pushed", namespace=NS).outcome is Outcome.IN_PROGRESS
    wb.complete("pushed", c.token, namespace=NS, result={"charged": 100})
    assert second.claim("pushed", namespace=NS).outcome is Outcome.IN_PROGRESS
    wb.flush()
    dup = second.claim("pushed", namespace=NS)
    assert dup.outcome is Outcome.DUPLICATE and dup.result == {"charged": 100}
    # The key answered NEW on both sides is the conflict found by the push.
    (conflict,) = wb.conflicts
    assert conflict.key == "in-window" and conflict.authority_outcome is Outcome.IN_PROGRESS
    assert wb.stats()["write_behind"]["conflicts"] == 1
    second.complete("in-window", taken.token, namespace=NS, result="second")
    assert second.claim("in-window", namespace=NS).result == "second"


def test_conflict_is_logged(
    wb: WriteBehindStore, second: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    c = second.claim("k", namespace=NS)
    second.complete("k", c.token, namespace=NS)
    assert wb.claim("k", namespace=NS).outcome is Outcome.NEW  # the local table never saw it
    with caplog.at_level(logging.WARNING, logger="dedupcore.writebehind"):
        wb.flush()
    assert any("write-behind conflict" in r.getMessage() for r in caplog.records)
    (conflict,) = wb.conflicts
    assert conflict.kind == "claimed" and conflict.authority_outcome is Outcome.DUPLICATE


def test_background_push_reaches_redis(authority: RedisStore, second: RedisStore) -> None:
    with WriteBehindStore(authority, flush_interval=0.02) as s:
        c = s.claim("k", namespace=NS)
        s.complete("k", c.token, namespace=NS, result=7)
        deadline = time.monotonic() + 60
        while s.stats()["write_behind"]["pushed_completions"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    rec = second.get("k", namespace=NS)
    assert rec is not None and rec.state is State.PROCESSED and rec.result == 7


def test_embedded_local_table_answers_after_a_restart(
    authority: RedisStore, second: RedisStore, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    s = WriteBehindStore(authority, local=local, flush_interval=NEVER)
    with s.processing("k", namespace=NS) as c:
        assert c.outcome is Outcome.NEW
        c.result = "done"
    s.close()
    # close() flushed: the authority has it ...
    assert second.claim("k", namespace=NS).result == "done"
    # ... and the local table still answers after a restart, without the authority.
    with WriteBehindStore(authority, local=local, flush_interval=NEVER) as s:
        dup = s.claim("k", namespace=NS)
        assert dup.outcome is Outcome.DUPLICATE and dup.result == "done"
        assert s.stats()["write_behind"]["flushes"] == 0
    with DedupStore.open(local, readonly=True) as ro:
        rec = ro.get("k", namespace=NS)
        assert rec is not None and rec.state is State.PROCESSED


def test_redis_down_claims_answered_locally_push_fails(tmp_path: Path) -> None:
    down = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
    s = WriteBehindStore(down, flush_interval=NEVER)
    try:
        assert s.claim("k", namespace=NS).outcome is Outcome.NEW
        with pytest.raises(UnavailableError):
            s.flush()
        st = s.stats()["write_behind"]
        assert st["push_errors"] == 1 and st["window_keys"] == 1
    finally:
        with pytest.raises(UnavailableError):
            s.close()
        down.close()


def _deadline(authority: RedisStore, key: str) -> int:
    """The authority's deadline of ``key``'s claim (ms of the Redis server's clock)."""
    (name,) = authority._names(NS.encode(), [key.encode()])
    return int(authority.client.hget(name, "d"))


def test_a_renewal_is_pushed_to_the_authority(
    wb: WriteBehindStore, authority: RedisStore, second: RedisStore
) -> None:
    pushed = wb.claim("pushed", namespace=NS, lease=30.0)
    wb.flush()
    before = _deadline(authority, "pushed")
    waiting = wb.claim("waiting", namespace=NS, lease=30.0)  # not pushed yet
    wb.extend_many(
        [("pushed", pushed.token), ("waiting", waiting.token)], namespace=NS, lease=NEVER
    )
    assert _deadline(authority, "pushed") == before  # not pushed yet
    wb.flush()
    # Renewed at the authority for the new lease, on its clock; the claim pushed
    # after its renewal is pushed with the renewal's lease.
    assert _deadline(authority, "pushed") - before > (NEVER - 60) * 1000
    assert _deadline(authority, "waiting") - before > (NEVER - 60) * 1000
    # A renewal of a claim lost at the authority is a conflict, and the key is given up.
    lost = wb.claim("lost", namespace=NS, lease=30.0)
    wb.flush()
    (name,) = authority._names(NS.encode(), [b"lost"])
    authority.client.hset(name, "d", 0)  # its authority lease ran out ...
    assert second.claim("lost", namespace=NS).takeover  # ... and another consumer took it
    wb.extend("lost", lost.token, namespace=NS, lease=NEVER)
    wb.flush()
    assert [(c.key, c.kind) for c in wb.conflicts] == [("lost", "lease_lost")]
    wb.complete("lost", lost.token, namespace=NS)
    wb.complete("pushed", pushed.token, namespace=NS)
    wb.flush()
    assert second.get("lost", namespace=NS).state is State.PROCESSING  # type: ignore[union-attr]
    assert second.get("pushed", namespace=NS).state is State.PROCESSED  # type: ignore[union-attr]
