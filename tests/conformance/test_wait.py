"""Waiting on a key another owner holds: ``claim(..., wait=)``, one answer from every store.

The waiter is answered DUPLICATE with the first attempt's result once it
completed, NEW once it was released or its lease ran out, and IN_PROGRESS
when its time is up. The holder acts from another thread only after the
waiter has started waiting (the store's ``_wait_change`` was entered), so no
case depends on timing; a lease's end is awaited, never asserted at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from dedupcore.api import ClaimAPI, Outcome


def _when_waiting(api: Any, act: Callable[[], None]) -> threading.Thread:
    """Runs ``act`` in a thread once ``api`` is waiting on a key for the first time."""
    waiting = threading.Event()
    original = api._wait_change

    def spy(*args: Any, **kwargs: Any) -> Any:
        waiting.set()
        return original(*args, **kwargs)

    api._wait_change = spy

    def run() -> None:
        assert waiting.wait(60), "the claim never waited"
        act()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.fixture
def waiter(api: ClaimAPI) -> Any:
    yield api
    api.__dict__.pop("_wait_change", None)


def test_a_waiter_gets_the_first_attempts_result(waiter: Any, ns: str) -> None:
    first = waiter.claim("k", namespace=ns, owner="first", lease=600)
    t = _when_waiting(waiter, lambda: waiter.complete("k", first.token, namespace=ns, result="r1"))
    got = waiter.claim("k", namespace=ns, owner="second", wait=120)
    t.join()
    assert got.outcome is Outcome.DUPLICATE and got.result == "r1" and got.token == first.token


def test_a_waiter_gets_the_key_when_it_is_released(waiter: Any, ns: str) -> None:
    first = waiter.claim("k", namespace=ns, owner="first", lease=600)
    t = _when_waiting(waiter, lambda: waiter.release("k", first.token, namespace=ns))
    got = waiter.claim("k", namespace=ns, owner="second", wait=120)
    t.join()
    assert got.outcome is Outcome.NEW and not got.takeover
    waiter.complete("k", got.token, namespace=ns)


def test_a_waiter_takes_the_key_over_when_its_lease_runs_out(api: ClaimAPI, ns: str) -> None:
    first = api.claim("k", namespace=ns, owner="first", lease=0.3)
    got = api.claim("k", namespace=ns, owner="second", wait=120)
    assert got.outcome is Outcome.NEW and got.takeover and got.token == first.token + 1


def test_a_waiter_whose_time_is_up_gets_in_progress(api: ClaimAPI, ns: str) -> None:
    first = api.claim("k", namespace=ns, owner="first", lease=600)
    got = api.claim("k", namespace=ns, owner="second", wait=0.2)
    assert got.outcome is Outcome.IN_PROGRESS and got.token == first.token
    api.complete("k", first.token, namespace=ns)


def test_a_batch_waits_only_for_keys_others_hold(waiter: Any, ns: str) -> None:
    done = waiter.claim("done", namespace=ns)
    waiter.complete("done", done.token, namespace=ns, result=1)
    held = waiter.claim("held", namespace=ns, owner="first", lease=600)
    t = _when_waiting(waiter, lambda: waiter.complete("held", held.token, namespace=ns, result=2))
    got = waiter.claim_many(["fresh", "done", "held", "fresh"], namespace=ns, wait=120)
    t.join()
    assert [c.outcome for c in got] == [
        Outcome.NEW,
        Outcome.DUPLICATE,
        Outcome.DUPLICATE,
        Outcome.IN_PROGRESS,  # its own NEW copy: not waited on
    ]
    assert [got[1].result, got[2].result] == [1, 2]


def test_bad_waits_are_refused_before_anything_is_claimed(api: ClaimAPI, ns: str) -> None:
    for bad in (-1, float("inf"), float("nan"), 3601):
        with pytest.raises(ValueError, match="wait"):
            api.claim("k", namespace=ns, wait=bad)
    for bad_type in ("1", True, [1]):
        with pytest.raises(TypeError, match="wait"):
            api.claim("k", namespace=ns, wait=bad_type)  # type: ignore[arg-type]
    assert api.get("k", namespace=ns) is None
    # wait=0: answered at once, as without it.
    c = api.claim("k", namespace=ns, owner="a", lease=600)
    assert api.claim("k", namespace=ns, owner="b", wait=0).outcome is Outcome.IN_PROGRESS
    api.complete("k", c.token, namespace=ns)
