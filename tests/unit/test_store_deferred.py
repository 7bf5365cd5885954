"""The split claim/complete/release calls the daemon uses: an answer and the log
position it depends on, then wait_durable (docs/daemon.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dedupcore.errors import BatchTooLargeError, ConflictError
from dedupcore.store import DedupStore, Outcome


@pytest.fixture
def store(tmp_path: Path):
    s = DedupStore.open(tmp_path / "data")
    yield s
    s.close()


def _durable(store: DedupStore) -> int:
    return int(store.stats()["wal_last_lsn"])


def test_a_deferred_claim_is_logged_but_not_durable_until_waited_for(store: DedupStore) -> None:
    claims, lsn = store.claim_many_deferred(["a", "b"], namespace="ns")
    assert [c.outcome for c in claims] == [Outcome.NEW, Outcome.NEW]
    assert lsn > _durable(store)  # queued, not yet acknowledged by the log
    store.wait_durable(lsn)
    assert _durable(store) >= lsn
    # Answered from durable records only: nothing to wait for.
    again, lsn2 = store.claim_many_deferred(["a"], namespace="ns")
    assert again[0].outcome is Outcome.IN_PROGRESS and lsn2 == 0


def test_a_duplicate_of_an_undurable_completion_depends_on_its_lsn(store: DedupStore) -> None:
    (c,), lsn = store.claim_many_deferred(["k"], namespace="ns")
    store.wait_durable(lsn)
    done = store.complete_many_deferred([("k", c.token, b"r")], namespace="ns")
    assert done > _durable(store)
    (dup,), depends = store.claim_many_deferred(["k"], namespace="ns")
    # The DUPLICATE answer rests on the completion, which is not durable yet.
    assert dup.outcome is Outcome.DUPLICATE and dup.result == b"r"
    assert depends >= done
    store.wait_durable(depends)
    assert store.claim_many_deferred(["k"], namespace="ns")[1] == 0


def test_release_deferred_returns_the_lsn_to_wait_for(store: DedupStore) -> None:
    (c,) = store.claim_many(["k"], namespace="ns")
    lsn = store.release_many_deferred([("k", c.token)], namespace="ns")
    assert lsn > _durable(store)
    store.wait_durable(lsn)
    assert store.claim("k", namespace="ns").outcome is Outcome.NEW


def test_check_claim_many_applies_nothing_and_raises_what_a_claim_would(
    store: DedupStore,
) -> None:
    (c,) = store.claim_many(["k"], namespace="ns", fingerprints=[b"one"])
    store.complete("k", c.token, namespace="ns", result=b"x" * 100)
    held = store.check_claim_many(["k", "fresh"], namespace="ns")
    assert held > 100  # the duplicate's stored result is counted
    assert store.get("fresh", namespace="ns") is None
    with pytest.raises(ConflictError):
        store.check_claim_many(["fresh", "k"], namespace="ns", fingerprints=[None, b"two"])
    with pytest.raises(BatchTooLargeError):
        store.check_claim_many(["k"], namespace="ns", reply_limit=50)
    with pytest.raises(ValueError):
        store.check_claim_many(["fresh", ""], namespace="ns")
    assert store.get("fresh", namespace="ns") is None
