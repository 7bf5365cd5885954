"""``claim(wait=)`` over the embedded store and the memory table, whose waiters are woken
when a key changes (not by polling), and the arithmetic of the polling default."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dedupcore.api import ClaimAPI, Outcome
from dedupcore.api.waiting import POLL_FIRST, POLL_MAX, backoff
from dedupcore.memory import MemoryTable
from dedupcore.store import DedupStore

NS = "waits"


@pytest.fixture(params=["embedded", "memory"])
def m(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ClaimAPI]:
    store = DedupStore.open(tmp_path / "d") if request.param == "embedded" else MemoryTable()
    yield store
    store.close()


def test_a_completion_wakes_the_waiter_without_polling(m: Any) -> None:
    first = m.claim("k", namespace=NS, owner="a", lease=600)
    rounds: list[float] = []
    waiting = threading.Event()
    original = m._wait_change

    def spy(batch: Any, timeout: float, attempt: int) -> None:
        rounds.append(timeout)
        waiting.set()
        original(batch, timeout, attempt)

    m._wait_change = spy  # type: ignore[method-assign]

    def complete() -> None:
        assert waiting.wait(60)
        m.complete("k", first.token, namespace=NS, result="r")

    t = threading.Thread(target=complete)
    t.start()
    got = m.claim("k", namespace=NS, owner="b", wait=600)
    t.join()
    # One wait, woken by the completion: a poll would have taken rounds of backoff.
    assert got.outcome is Outcome.DUPLICATE and got.result == "r" and len(rounds) == 1


def test_the_waiter_wakes_when_the_lease_runs_out(m: Any) -> None:
    m.claim("k", namespace=NS, owner="a", lease=0.2)
    rounds: list[float] = []
    original = m._wait_change

    def spy(batch: Any, timeout: float, attempt: int) -> None:
        rounds.append(timeout)
        original(batch, timeout, attempt)

    m._wait_change = spy  # type: ignore[method-assign]
    got = m.claim("k", namespace=NS, owner="b", wait=600)
    assert got.outcome is Outcome.NEW and got.takeover
    assert len(rounds) == 1  # slept until the deadline, then took the key over


def test_a_key_no_longer_held_is_asked_again_at_once(m: Any) -> None:
    c = m.claim("k", namespace=NS)
    m.release("k", c.token, namespace=NS)
    batch_of = m._claims(["k"], NS, None, None, None)
    t = threading.Thread(target=m._wait_change, args=(batch_of, 3600, 0), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "waited on a key nobody holds"


def test_the_polling_backoff_doubles_to_its_cap_and_never_passes_the_time_left() -> None:
    for attempt in range(20):
        step = backoff(attempt, 10.0)
        cap = min(POLL_MAX, POLL_FIRST * 2**attempt)
        assert cap / 2 <= step <= cap
    assert backoff(30, 0.001) <= 0.001 and backoff(3, 0.0) == 0.0
