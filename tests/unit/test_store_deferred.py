"""The split claim/complete/release calls the daemon uses: an answer and the log
position it depends on, then wait_durable (docs/daemon.md)."""

from __future__ import annotations

import time
from array import array
from pathlib import Path

import pytest

from dedupcore.api import pack_result
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


def _prepare(store: DedupStore) -> None:
    """Keys in every state a claim answers from: completed with and without a result,
    held, held with a lease that ran out (taken over next), demoted to the cold archive."""
    (old,) = store.claim_many(["cold"], namespace="ns")
    store.complete("cold", old.token, namespace="ns", result=b"gone")
    assert store.sweep(now=time.time() + 8 * 86400) == 1
    done, bare, _held = store.claim_many(["done", "bare", "held"], namespace="ns")
    store.complete_many([("done", done.token, {"n": 1}), ("bare", bare.token)], namespace="ns")
    store.claim_many(["late"], namespace="ns", lease=0.01)


def test_columns_answer_what_the_claims_answer(tmp_path: Path) -> None:
    keys = ["done", "held", "fresh", "cold", "late", "fresh", "bare", "other"]
    a = DedupStore.open(tmp_path / "a")
    b = DedupStore.open(tmp_path / "b")
    try:
        _prepare(a)
        _prepare(b)
        time.sleep(0.05)  # the lease of "late" runs out in both
        claims, lsn_a = a.claim_many_deferred(keys, namespace="ns")
        (outcomes, tokens, result_index, results, cold, takeovers), lsn_b = (
            b.claim_columns_deferred(keys, namespace="ns")
        )
        codes = {Outcome.NEW: 0, Outcome.DUPLICATE: 1, Outcome.IN_PROGRESS: 2}
        assert list(outcomes) == [codes[c.outcome] for c in claims]
        assert list(array("Q", tokens)) == [c.token for c in claims]
        assert result_index == [i for i, c in enumerate(claims) if c.result is not None] == [0]
        assert results == [c.result for c in claims if c.result is not None] == [{"n": 1}]
        assert cold == [i for i, c in enumerate(claims) if not c.exact] == [3]
        assert takeovers == [i for i, c in enumerate(claims) if c.takeover] == [4]
        assert (lsn_a > 0) and (lsn_b > 0)
        b.wait_durable(lsn_b)
        # Applied as a claim is: the same records afterwards.
        for key in keys:
            ra, rb = a.get(key, namespace="ns"), b.get(key, namespace="ns")
            assert (ra is None) == (rb is None)
            if ra is not None and rb is not None:
                assert (ra.state, ra.token, ra.result) == (rb.state, rb.token, rb.result)
        assert b.claim_columns_deferred([], namespace="ns") == ((b"", b"", [], [], [], []), 0)
        with pytest.raises(ValueError):
            b.claim_columns_deferred(["x", ""], namespace="ns")
        assert b.get("x", namespace="ns") is None
    finally:
        a.close()
        b.close()


def test_a_check_answers_the_result_bytes_a_claim_would_carry(store: DedupStore) -> None:
    _prepare(store)
    before = store.stats()["wal_last_lsn"]
    held = store.check_claim_many(["done", "bare", "fresh", "late"], namespace="ns")
    assert held == len(pack_result({"n": 1}, 1 << 20))
    assert store.get("fresh", namespace="ns") is None
    assert store.stats()["wal_last_lsn"] == before  # nothing logged
