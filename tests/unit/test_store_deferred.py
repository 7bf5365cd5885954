"""The split claim/complete/release calls the daemon uses: an answer and the log
position it depends on, then wait_durable (docs/daemon.md)."""

from __future__ import annotations

import time
from array import array
from pathlib import Path
from typing import Any

import pytest

from dedupcore.api import ChangeBatch, ClaimBatch, pack_result
from dedupcore.api.deferred import FORM_CHECK, FORM_CLAIMS, FORM_COLUMNS, bounded_reply
from dedupcore.errors import BatchTooLargeError, ConflictError
from dedupcore.store import DedupStore, Outcome


@pytest.fixture
def store(tmp_path: Path):
    s = DedupStore.open(tmp_path / "data")
    yield s
    s.close()


def _claim(
    store: DedupStore,
    keys: list[str],
    form: int = FORM_CLAIMS,
    reply_limit: int | None = None,
    **options: Any,
) -> tuple[Any, int]:
    """The daemon's call: a checked batch, decided now, durable at the lsn answered."""
    batch = ClaimBatch(keys, namespace="ns", limits=store.limits, **options)
    admit = None if reply_limit is None else bounded_reply(len(batch), reply_limit, 0)
    return store.claim_deferred(batch, form=form, admit=admit)


def _change(store: DedupStore, items: list[Any], *, completing: bool) -> int:
    batch = ChangeBatch(items, namespace="ns", completing=completing, limits=store.limits)
    return store.change_deferred(batch)


def _durable(store: DedupStore) -> int:
    return int(store.stats()["wal_last_lsn"])


def test_a_deferred_claim_is_logged_but_not_durable_until_waited_for(store: DedupStore) -> None:
    claims, lsn = _claim(store, ["a", "b"])
    assert [c.outcome for c in claims] == [Outcome.NEW, Outcome.NEW]
    assert lsn > _durable(store)  # queued, not yet acknowledged by the log
    store.wait_durable(lsn)
    assert _durable(store) >= lsn
    # Answered from durable records only: nothing to wait for.
    again, lsn2 = _claim(store, ["a"])
    assert again[0].outcome is Outcome.IN_PROGRESS and lsn2 == 0


def test_a_duplicate_of_an_undurable_completion_depends_on_its_lsn(store: DedupStore) -> None:
    (c,), lsn = _claim(store, ["k"])
    store.wait_durable(lsn)
    done = _change(store, [("k", c.token, b"r")], completing=True)
    assert done > _durable(store)
    (dup,), depends = _claim(store, ["k"])
    # The DUPLICATE answer rests on the completion, which is not durable yet.
    assert dup.outcome is Outcome.DUPLICATE and dup.result == b"r"
    assert depends >= done
    store.wait_durable(depends)
    assert _claim(store, ["k"])[1] == 0


def test_release_deferred_returns_the_lsn_to_wait_for(store: DedupStore) -> None:
    (c,) = store.claim_many(["k"], namespace="ns")
    lsn = _change(store, [("k", c.token)], completing=False)
    assert lsn > _durable(store)
    store.wait_durable(lsn)
    assert store.claim("k", namespace="ns").outcome is Outcome.NEW


def test_check_claim_many_applies_nothing_and_raises_what_a_claim_would(
    store: DedupStore,
) -> None:
    (c,) = store.claim_many(["k"], namespace="ns", fingerprints=[b"one"])
    store.complete("k", c.token, namespace="ns", result=b"x" * 100)
    held = _claim(store, ["k", "fresh"], FORM_CHECK)[0]
    assert held > 100  # the duplicate's stored result is counted
    assert store.get("fresh", namespace="ns") is None
    with pytest.raises(ConflictError):
        _claim(store, ["fresh", "k"], FORM_CHECK, fingerprints=[None, b"two"])
    with pytest.raises(BatchTooLargeError):
        _claim(store, ["k"], FORM_CHECK, reply_limit=50)
    with pytest.raises(ValueError):
        _claim(store, ["fresh", ""], FORM_CHECK)
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
        claims, lsn_a = _claim(a, keys)
        (outcomes, tokens, result_index, results, cold, takeovers), lsn_b = _claim(
            b, keys, FORM_COLUMNS
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
        assert _claim(b, [], FORM_COLUMNS) == ((b"", b"", [], [], [], []), 0)
        with pytest.raises(ValueError):
            _claim(b, ["x", ""], FORM_COLUMNS)
        assert b.get("x", namespace="ns") is None
    finally:
        a.close()
        b.close()


def test_a_check_answers_the_result_bytes_a_claim_would_carry(store: DedupStore) -> None:
    _prepare(store)
    before = store.stats()["wal_last_lsn"]
    held = _claim(store, ["done", "bare", "fresh", "late"], FORM_CHECK)[0]
    assert held == len(pack_result({"n": 1}, 1 << 20))
    assert store.get("fresh", namespace="ns") is None
    assert store.stats()["wal_last_lsn"] == before  # nothing logged
