"""The store's searches for claims in flight, a bounded step per hold of its lock.

The checkpoint's aged scan puts the keys of claims held longer than half the
front window into the front filter again; the sweep releases claims abandoned
past their exact window. Both search the claim table in steps that each hold
the store lock and let it go between two (docs/engine.md, "Scans in steps").
These tests make the steps small, count them through a stand-in of the table,
and run claims and completions between every two steps (from the hook the
store calls there), then check that no claim in flight throughout was missed.
The store's clocks are moved on through the maintenance module's ``time``.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dedupcore.keys as _keys
import dedupcore.store.maintenance as maintenance
from dedupcore.record import State
from dedupcore.store import DedupStore, Outcome

NS = "scan"
STEP = 64  # slots per step
FOUND = 16  # records found per step of the sweep
INF = float("inf")


class CountingTable:
    """The store's ClaimTable, counting the search's steps and what each saw; each
    step must run under the store lock."""

    def __init__(self, table: Any, store: DedupStore) -> None:
        self._table = table
        self._store = store
        self.steps: list[tuple[int, int]] = []  # (slots visited, records found)

    def scan_step(self, *args: Any) -> tuple[bytes, list[Any], int, bool]:
        assert self._store._lock._is_owned()  # type: ignore[attr-defined]
        digests, info, visited, more = self._table.scan_step(*args)
        self.steps.append((visited, len(digests) // 16))
        return digests, info, visited, more

    def __getattr__(self, name: str) -> Any:
        return getattr(self._table, name)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DedupStore]:
    s = DedupStore.open(
        tmp_path / "data", checkpoint_interval=1e9, sweep_interval=1e9, checkpoint_records=1 << 40
    )
    monkeypatch.setattr(maintenance, "_scan_pacing", lambda: (STEP, True))
    monkeypatch.setattr(maintenance, "_SCAN_FOUND", FOUND)
    yield s
    s.close()


def digest(key: str) -> bytes:
    return _keys.digest(NS.encode(), key.encode())


def clocks_ahead(monkeypatch: pytest.MonkeyPatch, wall: float, mono: float) -> None:
    """The maintenance code's wall and monotonic clocks run ``wall`` and ``mono`` s ahead."""
    real = time
    monkeypatch.setattr(
        maintenance,
        "time",
        types.SimpleNamespace(
            time=lambda: real.time() + wall,
            monotonic=lambda: real.monotonic() + mono,
            sleep=real.sleep,
        ),
    )


@contextlib.contextmanager
def between_steps(store: DedupStore, work: Any) -> Iterator[list[int]]:
    """Within: runs ``work(n)`` between the n-th and the next step, outside the
    store lock (where the store pauses for a waiting batch)."""
    calls: list[int] = []

    def let_in() -> None:
        assert not store._lock._is_owned()  # type: ignore[attr-defined]
        calls.append(len(calls))
        work(len(calls))

    store._let_batch_in = let_in  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del store._let_batch_in
        if isinstance(store._table, CountingTable):
            store._table = store._table._table


def test_the_aged_scan_goes_in_steps_and_misses_no_key_in_flight(
    store: DedupStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """600 claims held past half the front window; between two steps of the
    checkpoint's aged scan (the first 60) 40 fresh keys are claimed (the table
    grows from 2048 slots during the search) and 3 of the old ones completed.
    Every old key still in flight at the end went into the front filter again."""
    old = [f"old-{i}" for i in range(600)]
    claims = {c.key: c for c in store.claim_many(old, namespace=NS)}
    table = CountingTable(store._table, store)
    store._table = table  # type: ignore[assignment]
    done: set[str] = set()

    def work(n: int) -> None:
        if n > 60:
            return
        store.claim_many([f"new-{n}-{i}" for i in range(40)], namespace=NS)
        for key in old[3 * n : 3 * n + 3]:
            store.complete(key, claims[key].token, namespace=NS)
            done.add(key)

    inserted: list[int] = []
    insert_many = store._front.insert_many

    def spy(keys: Any, now: float, **kw: Any) -> None:
        inserted.extend(keys)
        insert_many(keys, now, **kw)

    monkeypatch.setattr(store._front, "insert_many", spy)
    clocks_ahead(monkeypatch, maintenance.front_window(store.config), 0.0)
    with between_steps(store, work) as steps_between:
        store.checkpoint()
    assert table.steps and all(v <= STEP for v, _ in table.steps)
    assert len(table.steps) == len(steps_between) + 1 >= (2048 + 4096) // STEP
    assert store._table.nbytes >= 4096 * 72, "the table grew during the search"
    in_flight = [k for k in old if k not in done]
    assert len(in_flight) > 300
    want = _keys.front_hashes_of(b"".join(digest(k) for k in in_flight))
    assert set(want) <= set(inserted)
    assert all(store._front.contains_digests(digest(k))[0] for k in in_flight)


def test_the_sweep_releases_the_abandoned_claims_step_by_step(
    store: DedupStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 claims past their exact window with their leases run out; between two
    steps of the sweep's search 2 of them are completed and 5 fresh keys claimed
    with a lease that has not run out. Each step finds at most FOUND records; every
    abandoned claim not completed meanwhile is released once, with its token; the
    completed ones and the fresh ones are left as they are."""
    old = [f"old-{i}" for i in range(300)]
    tokens = {c.key: c.token for c in store.claim_many(old, namespace=NS)}
    table = CountingTable(store._table, store)
    store._table = table  # type: ignore[assignment]
    completed: set[str] = set()
    fresh: list[str] = []

    def state(key: str) -> tuple[int, int]:
        got = store._table.get(digest(key))
        assert got is not None
        return got[0], got[2]

    def work(n: int) -> None:
        for key in old[n * 7 : n * 7 + 7]:
            if len(completed) < 2 * n and state(key)[0] == State.PROCESSING:
                store.complete(key, tokens[key], namespace=NS)
                completed.add(key)
        keys = [f"fresh-{n}-{i}" for i in range(5)]
        assert all(
            c.outcome is Outcome.NEW for c in store.claim_many(keys, namespace=NS, lease=2 * 86400)
        )
        fresh.extend(keys)

    clocks_ahead(monkeypatch, 0.0, 86400.0)  # every 30 s lease ran out
    window = store.config.longest_exact_window()
    with between_steps(store, work):
        store._release_abandoned(time.time() + window + 1)
    assert len(table.steps) > 300 // FOUND
    assert all(v <= STEP and found <= FOUND for v, found in table.steps)
    assert len(completed) > 10
    for key in old:
        want = State.PROCESSED if key in completed else State.RELEASED
        assert state(key) == (want, tokens[key]), key
    assert all(state(k)[0] == State.PROCESSING for k in fresh)
    again = store.claim_many(old, namespace=NS)
    assert [c.outcome for c in again] == [
        Outcome.DUPLICATE if k in completed else Outcome.NEW for k in old
    ]
    assert all(c.token == tokens[c.key] + 1 for c in again if c.key not in completed)


def test_a_search_that_fails_half_way_is_ended(
    store: DedupStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error between two steps (here: in the work between them) ends the
    table's search; the next one starts afresh and finds every claim."""
    keys = [f"k-{i}" for i in range(300)]
    store.claim_many(keys, namespace=NS)

    def fail(n: int) -> None:
        raise RuntimeError("between two steps")

    clocks_ahead(monkeypatch, maintenance.front_window(store.config), 0.0)
    with between_steps(store, fail), pytest.raises(RuntimeError, match="between two steps"):
        store.checkpoint()
    assert store._table.scan_step(INF, INF, 1 << 20) == (b"", [], 0, False)
    with between_steps(store, lambda n: None):
        store._aged_scan = -INF
        store.claim("one more", namespace=NS)
        store.checkpoint()
    assert all(store._front.contains_digests(digest(k))[0] for k in keys)
