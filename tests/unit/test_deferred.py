"""The daemon's fast path is chosen by what a store is (a DeferredStore), never by probing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from dedupcore.api import ClaimBatch
from dedupcore.api.deferred import FORM_CHECK, DeferredStore, bounded_reply
from dedupcore.daemon.dispatch import Abilities
from dedupcore.errors import BatchTooLargeError
from dedupcore.memory import MemoryTable
from dedupcore.metrics import Metrics, instrument
from dedupcore.store import DedupStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DedupStore]:
    s = DedupStore.open(tmp_path / "data", durability="power-loss-unsafe", max_result_bytes=4096)
    yield s
    s.close()


def test_the_embedded_store_is_deferred_and_declares_its_limits(store: DedupStore) -> None:
    assert isinstance(store, DeferredStore)
    abilities = Abilities.of(store)
    assert abilities.decides_on_loop and abilities.unsynced_commits
    assert abilities.max_result_bytes == 4096


def test_an_instrumented_store_is_served_the_ordinary_way(store: DedupStore) -> None:
    # Its attributes forward to the store inside; the deferred calls would pass
    # its counters by, so it is not a DeferredStore.
    wrapped = instrument(store, Metrics(CollectorRegistry()))
    assert not isinstance(wrapped, DeferredStore)
    abilities = Abilities.of(wrapped)
    assert not abilities.decides_on_loop and not abilities.unsynced_commits
    assert abilities.max_result_bytes == 4096  # the store's limits, read through it


def test_a_memory_table_is_not_deferred() -> None:
    table = MemoryTable(max_result_bytes=100)
    assert not isinstance(table, DeferredStore)
    assert Abilities.of(table) == Abilities(False, False, 100)


def test_admit_refuses_a_reply_over_its_limit_and_nothing_changes(store: DedupStore) -> None:
    (c,) = store.claim_many(["done"], namespace="ns")
    store.complete("done", c.token, namespace="ns", result=b"x" * 100)
    batch = ClaimBatch(["done", "fresh"], namespace="ns", limits=store.limits)
    held, lsn = store.claim_deferred(batch, form=FORM_CHECK)
    assert lsn == 0 and held > 100
    with pytest.raises(BatchTooLargeError, match="the answer to a claim of these 2 keys"):
        store.claim_deferred(batch, admit=bounded_reply(2, 100, 0))
    assert store.get("fresh", namespace="ns") is None  # nothing was claimed
    claims, _ = store.claim_deferred(batch, admit=bounded_reply(2, held, 0))
    assert [c.outcome.value for c in claims] == ["duplicate", "new"]
