"""The embedded DedupStore: outcomes, transitions, leases, durability across reopen, retention."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dedupcore.api.batches import digests_of as _digests_of
from dedupcore.config import Retention
from dedupcore.errors import ConflictError, DedupError, StaleTokenError
from dedupcore.record import State
from dedupcore.store import DedupStore, InProgressError, Outcome, StoreLockedError
from tests.support.procs import PATIENCE
from tests.support.stores import lmdb_writer_held, namespace_writes

NS = "orders/billing"


@pytest.fixture
def store(tmp_path: Path):
    s = DedupStore.open(tmp_path / "data")
    yield s
    s.close()


def test_new_then_in_progress_then_duplicate_with_result(store: DedupStore) -> None:
    c = store.claim("order-42", namespace=NS)
    assert c.outcome is Outcome.NEW and c.token == 1 and c.exact
    assert store.claim("order-42", namespace=NS).outcome is Outcome.IN_PROGRESS
    store.complete("order-42", c.token, namespace=NS, result={"charged": 100})
    dup = store.claim("order-42", namespace=NS)
    assert dup.outcome is Outcome.DUPLICATE
    assert dup.result == {"charged": 100}
    assert dup.exact


def test_release_lets_the_work_run_again_with_a_higher_token(store: DedupStore) -> None:
    c = store.claim(b"k", namespace=NS)
    store.release(b"k", c.token, namespace=NS)
    again = store.claim(b"k", namespace=NS)
    assert again.outcome is Outcome.NEW
    assert again.token == c.token + 1
    with pytest.raises(StaleTokenError):
        store.complete(b"k", c.token, namespace=NS)


def test_same_owner_gets_its_own_claim_back(store: DedupStore) -> None:
    c = store.claim("k", namespace=NS, owner="worker-1")
    again = store.claim("k", namespace=NS, owner="worker-1")
    assert again.outcome is Outcome.NEW and again.token == c.token
    assert store.claim("k", namespace=NS, owner="worker-2").outcome is Outcome.IN_PROGRESS


def test_expired_lease_is_taken_over_once_and_late_owner_is_fenced(store: DedupStore) -> None:
    first = store.claim("k", namespace=NS, lease=0.05, owner="a")
    time.sleep(0.1)
    results = []

    def contend(n: int) -> None:
        # Distinct owners: thread idents are reused, and the same owner would
        # rightly get its own claim back.
        results.append(store.claim("k", namespace=NS, owner=f"b-{n}"))

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    new = [c for c in results if c.outcome is Outcome.NEW]
    assert len(new) == 1
    assert new[0].takeover and new[0].token == first.token + 1
    with pytest.raises(StaleTokenError):
        store.complete("k", first.token, namespace=NS)
    store.complete("k", new[0].token, namespace=NS)
    assert store.claim("k", namespace=NS).outcome is Outcome.DUPLICATE


def test_fingerprint_mismatch_is_a_conflict(store: DedupStore) -> None:
    c = store.claim("k", namespace=NS, fingerprint=b"body-a")
    store.complete("k", c.token, namespace=NS, result=b"first")
    assert store.claim("k", namespace=NS, fingerprint=b"body-a").result == b"first"
    with pytest.raises(ConflictError):
        store.claim("k", namespace=NS, fingerprint=b"body-b")


def test_complete_is_idempotent_for_the_same_token(store: DedupStore) -> None:
    c = store.claim("k", namespace=NS)
    store.complete("k", c.token, namespace=NS, result=1)
    store.complete("k", c.token, namespace=NS, result=1)  # a retry after a lost reply
    with pytest.raises(StaleTokenError):
        store.release("k", c.token, namespace=NS)


def test_complete_or_release_without_claim(store: DedupStore) -> None:
    with pytest.raises(StaleTokenError, match="not claimed"):
        store.complete("never", 1, namespace=NS)
    with pytest.raises(StaleTokenError, match="not claimed"):
        store.release("never", 1, namespace=NS)


def test_claim_many_batch_semantics(store: DedupStore) -> None:
    keys = [b"a", b"b", b"a", b"c"]
    claims = store.claim_many(keys, namespace=NS)
    assert [c.outcome for c in claims] == [
        Outcome.NEW,
        Outcome.NEW,
        Outcome.IN_PROGRESS,
        Outcome.NEW,
    ]
    store.complete_many(
        [(c.key, c.token) for c in claims if c.outcome is Outcome.NEW], namespace=NS
    )
    assert all(c.outcome is Outcome.DUPLICATE for c in store.claim_many(keys, namespace=NS))


def test_namespaces_are_separate_keys(store: DedupStore) -> None:
    store.claim("k", namespace="topic/group-a")
    assert store.claim("k", namespace="topic/group-b").outcome is Outcome.NEW


def test_a_new_namespace_waits_for_lmdb_without_holding_up_the_others(
    store: DedupStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first claim in a namespace records it in LMDB, which waits while a checkpoint
    holds LMDB's writer. It waits outside the store lock: a claim in a namespace the
    store knows is answered meanwhile; the new one is answered once LMDB is free, and
    the namespace is recorded."""
    store.claim("k", namespace="known")
    recording = namespace_writes(store, monkeypatch)
    answers: dict[str, Outcome] = {}

    def claim(ns: str, key: str) -> None:
        answers[ns] = store.claim(key, namespace=ns).outcome

    first = threading.Thread(target=claim, args=("brand-new", "k"))
    with lmdb_writer_held(store):
        first.start()
        assert recording.wait(PATIENCE)
        other = threading.Thread(target=claim, args=("known", "k2"))
        other.start()
        other.join(PATIENCE)
        assert not other.is_alive(), "a claim in a known namespace waited for LMDB"
        assert answers == {"known": Outcome.NEW}
        assert first.is_alive()
        assert not store.has_namespace("brand-new")
    first.join(PATIENCE)
    assert answers == {"known": Outcome.NEW, "brand-new": Outcome.NEW}
    assert store.has_namespace("brand-new") and store.has_namespace("known")
    assert b"brand-new" in store._lmdb.namespaces()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"key": b""}, ValueError),
        ({"key": b"x" * 513}, ValueError),
        ({"key": 42}, TypeError),
        ({"key": None}, TypeError),
        ({"namespace": ""}, ValueError),
        ({"namespace": "a b"}, ValueError),
        ({"namespace": "x" * 129}, ValueError),
        ({"namespace": 5}, TypeError),
        ({"lease": 0}, ValueError),
        ({"lease": -1.0}, ValueError),
        ({"lease": float("nan")}, ValueError),
        ({"lease": "30"}, TypeError),
        ({"lease": 1e39}, ValueError),  # past MAX_LEASE_SECONDS: refused, never half-logged
        ({"lease": 30 * 86400 + 1}, ValueError),
        ({"fingerprint": "text"}, TypeError),
        ({"owner": 12}, TypeError),
    ],
)
def test_bad_claim_input_is_a_precise_error(store: DedupStore, kwargs, error) -> None:
    args = {"key": b"ok", "namespace": NS, **kwargs}
    key = args.pop("key")
    with pytest.raises(error):
        store.claim(key, **args)
    assert store.claim(b"ok", namespace=NS).outcome is Outcome.NEW  # nothing was claimed


def test_store_config_refuses_a_lease_past_the_bound(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="30 days"):
        DedupStore.open(tmp_path / "d", lease=1e39)


def test_bad_key_in_batch_claims_nothing(store: DedupStore) -> None:
    with pytest.raises(TypeError):
        store.claim_many([b"a", b"b", 3], namespace=NS)  # type: ignore[list-item]
    assert store.claim("a", namespace=NS).outcome is Outcome.NEW


def test_conflict_in_batch_claims_nothing(store: DedupStore) -> None:
    store.claim("k", namespace=NS, fingerprint=b"one")
    with pytest.raises(ConflictError):
        store.claim_many(["fresh", "k"], namespace=NS, fingerprints=[None, b"two"])
    assert store.claim("fresh", namespace=NS).outcome is Outcome.NEW


def test_results_are_checked(store: DedupStore) -> None:
    c = store.claim("k", namespace=NS)
    with pytest.raises(TypeError):
        store.complete("k", c.token, namespace=NS, result=object())
    with pytest.raises(ValueError, match="max_result_bytes"):
        store.complete("k", c.token, namespace=NS, result=b"x" * 70000)
    store.complete("k", c.token, namespace=NS, result=b"fits")


def test_processing_completes_on_success_and_releases_on_error(store: DedupStore) -> None:
    with store.processing("ok", namespace=NS) as c:
        assert c.outcome is Outcome.NEW
        c.result = "done"
    assert store.claim("ok", namespace=NS).result == "done"
    with pytest.raises(RuntimeError), store.processing("fails", namespace=NS):
        raise RuntimeError("business write failed")
    assert store.claim("fails", namespace=NS).outcome is Outcome.NEW


def test_idempotent_decorator_runs_once(store: DedupStore) -> None:
    calls = []

    @store.idempotent(namespace=NS, key=lambda msg: msg["id"])
    def handle(msg: dict) -> int:
        calls.append(msg["id"])
        return msg["amount"] * 2

    assert handle({"id": "t1", "amount": 5}) == 10
    assert handle({"id": "t1", "amount": 5}) == 10
    assert calls == ["t1"]
    store.claim("busy", namespace=NS)
    with pytest.raises(InProgressError):
        handle({"id": "busy", "amount": 1})


def test_acknowledged_state_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "data"
    with DedupStore.open(path) as s:
        done = s.claim_many([f"k{i}" for i in range(1000)], namespace=NS)
        s.complete_many([(c.key, c.token, i) for i, c in enumerate(done)], namespace=NS)
        held = s.claim("held", namespace=NS, owner="w1")
    with DedupStore.open(path) as s:
        again = s.claim_many([f"k{i}" for i in range(1000)], namespace=NS)
        assert [c.result for c in again] == list(range(1000))
        assert all(c.outcome is Outcome.DUPLICATE for c in again)
        # The holder gets a fresh lease after a restart and can still finish.
        assert s.claim("held", namespace=NS).outcome is Outcome.IN_PROGRESS
        s.complete("held", held.token, namespace=NS)


def test_log_only_state_survives_without_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "data"
    s = DedupStore.open(path, checkpoint_records=10**9, checkpoint_interval=3600.0)
    c = s.claim("k", namespace=NS)
    s.complete("k", c.token, namespace=NS, result=b"r")
    # Simulate a crash: drop the store without close() (no checkpoint, no front save).
    s._closed = True
    s._wal.close()
    s._lmdb.close()
    s._release_lock()
    with DedupStore.open(path) as s2:
        assert s2.claim("k", namespace=NS).result == b"r"


def _open_in_child(path: str, queue: multiprocessing.Queue) -> None:
    try:
        DedupStore.open(path)
        queue.put("opened")
    except StoreLockedError as exc:
        queue.put(str(exc))


def test_second_process_is_refused_with_owner_pid(tmp_path: Path) -> None:
    path = tmp_path / "data"
    with DedupStore.open(path) as s:
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        p = ctx.Process(target=_open_in_child, args=(str(path), queue))
        p.start()
        message = queue.get(timeout=60)
        p.join(60)
        assert str(os.getpid()) in message and "dedupcore serve" in message
        assert s.claim("still-works", namespace=NS).outcome is Outcome.NEW


def test_readonly_open_sees_checkpointed_records(tmp_path: Path) -> None:
    path = tmp_path / "data"
    # (py-lmdb opens an environment once per process, so the owner closes first here.)
    with DedupStore.open(path) as s:
        c = s.claim("k", namespace=NS)
        s.complete("k", c.token, namespace=NS, result=7)
    ro = DedupStore.open(path, readonly=True)
    rec = ro.get("k", namespace=NS)
    assert rec is not None and rec.state is State.PROCESSED and rec.result == 7
    with pytest.raises(DedupError, match="read-only"):
        ro.claim("x", namespace=NS)
    ro.close()


def test_retention_moves_keys_warm_to_cold_to_gone(tmp_path: Path) -> None:
    policy = Retention(exact_window=100.0, cold_window=1000.0)
    with DedupStore.open(tmp_path / "data", retention=policy) as s:
        c = s.claim("k", namespace=NS)
        s.complete("k", c.token, namespace=NS, result=b"r")
        processing = s.claim("p", namespace=NS)
        now = time.time()
        assert s.sweep(now=now + 50) == 0
        assert s.claim("k", namespace=NS).exact
        assert s.sweep(now=now + 200) == 1
        cold = s.claim("k", namespace=NS)
        assert cold.outcome is Outcome.DUPLICATE and not cold.exact
        # A PROCESSING record is never demoted.
        assert s.claim("p", namespace=NS).outcome is Outcome.IN_PROGRESS
        s.complete("p", processing.token, namespace=NS)
        s.sweep(now=now + 200 + 2000)
        assert s.claim("k", namespace=NS).outcome is Outcome.NEW


def test_use_after_close_and_after_fork(tmp_path: Path) -> None:
    s = DedupStore.open(tmp_path / "data")
    s.close()
    with pytest.raises(DedupError, match="closed"):
        s.claim("k", namespace=NS)
    s = DedupStore.open(tmp_path / "data")
    pid = os.fork()
    if pid == 0:
        try:
            s.claim("k", namespace=NS)
            os._exit(1)
        except DedupError as exc:
            os._exit(0 if "fork" in str(exc) else 2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    s.close()


def test_threads_claiming_the_same_keys_get_one_new_each(store: DedupStore) -> None:
    keys = [f"k{i}" for i in range(20000)]
    new_counts: list[int] = []

    def worker(seed: int) -> None:
        import random

        order = keys[:]
        random.Random(seed).shuffle(order)
        n = 0
        for i in range(0, len(order), 500):
            n += sum(
                c.outcome is Outcome.NEW for c in store.claim_many(order[i : i + 500], namespace=NS)
            )
        new_counts.append(n)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(new_counts) == len(keys)


def test_sweep_releases_abandoned_claims(tmp_path: Path) -> None:
    policy = Retention(exact_window=100.0, cold_window=1000.0)
    with DedupStore.open(tmp_path / "data", retention=policy) as s:
        gone = s.claim("gone", namespace=NS, lease=0.01)
        live = s.claim("live", namespace=NS, lease=3600.0)
        time.sleep(0.05)
        now = time.time()
        s.sweep(now=now + 50)  # not yet older than the exact window
        assert s.get("gone", namespace=NS).state is State.PROCESSING  # type: ignore[union-attr]
        s.sweep(now=now + 200)
        # The abandoned claim became a tombstone; the held lease was left alone.
        assert s.get("gone", namespace=NS).state is State.RELEASED  # type: ignore[union-attr]
        assert s.get("live", namespace=NS).state is State.PROCESSING  # type: ignore[union-attr]
        again = s.claim("gone", namespace=NS)
        assert again.outcome is Outcome.NEW and again.token == gone.token + 1
        s.complete("live", live.token, namespace=NS)


def test_a_claim_whose_answer_would_pass_reply_limit_claims_nothing(store: DedupStore) -> None:
    from dedupcore.api import ClaimBatch
    from dedupcore.api.deferred import bounded_reply
    from dedupcore.errors import BatchTooLargeError

    def claim_many(keys: list[str], reply_limit: int) -> list[Any]:
        batch = ClaimBatch(keys, namespace=NS, limits=store.limits)
        claims, lsn = store.claim_deferred(batch, admit=bounded_reply(3, reply_limit, 40))
        store.wait_durable(lsn)
        return claims  # type: ignore[no-any-return]

    for key in ("big1", "big2"):
        c = store.claim(key, namespace=NS)
        store.complete(key, c.token, namespace=NS, result=b"x" * 40_000)
    keys = ["fresh", "big1", "big2"]
    with pytest.raises(BatchTooLargeError, match="nothing was claimed"):
        claim_many(keys, 80_000)
    assert store.get("fresh", namespace=NS) is None  # nothing applied
    claims = claim_many(keys, 81_000)
    assert [c.outcome for c in claims] == [Outcome.NEW, Outcome.DUPLICATE, Outcome.DUPLICATE]


def test_a_checkpoint_keeps_every_claim_in_flight_findable(tmp_path: Path) -> None:
    """Eviction after a checkpoint removes settled records in place (backward shift in
    the probe chains, clusters wrapping the table's end included): afterwards the
    table holds exactly the claims in flight, each found as IN_PROGRESS, and every
    completed key answers DUPLICATE from LMDB."""
    from dedupcore.config import StoreConfig

    config = StoreConfig(checkpoint_records=10**9, checkpoint_interval=10**6)
    with DedupStore.open(tmp_path / "d", config=config) as s:
        keys = [b"k%06d" % i for i in range(60_000)]
        claims = s.claim_many(keys, namespace=NS)
        done = [(c.key, c.token) for i, c in enumerate(claims) if i % 3]
        s.complete_many(done, namespace=NS)
        s.checkpoint()
        assert len(s._table) == s._table.inflight == 20_000
        # Found in the table itself (not read back from LMDB's copy).
        open_keys = [k for i, k in enumerate(keys) if not i % 3]
        joined = _digests_of(NS.encode(), open_keys, config.max_key_bytes)
        assert s._table.missing(joined) == []
        again = s.claim_many(keys, namespace=NS)
        assert [c.outcome for c in again] == [
            Outcome.DUPLICATE if i % 3 else Outcome.IN_PROGRESS for i in range(len(keys))
        ]
