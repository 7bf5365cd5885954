"""Lease heartbeats: ``extend``/``extend_many`` and ``processing(heartbeat=True)``,
one answer from every store.

A renewal keeps a claim past its first lease; a renewal by a token that no
longer holds its key (completed, released, taken over) is a StaleTokenError
and renews nothing; a claim whose lease ran out is renewed while nobody took
it over. Leases are decided on each authority's clock, so a test never
asserts that a lease *ran out* at a time: it waits for a takeover by polling
(``take_over``) and asserts only what a long renewed lease guarantees.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from dedupcore.api import ClaimAPI, Outcome
from dedupcore.errors import StaleTokenError
from dedupcore.record import State
from tests.support.stores import CONFORMANCE, take_over

SHORT = 0.2
LONG = 600.0


@pytest.fixture(params=[*CONFORMANCE, "writebehind", "instrumented"])
def api(request: pytest.FixtureRequest) -> Any:
    """The conformance matrix (tests/conformance/conftest.py), and the write-behind and
    instrumented stores, which renew claims of their own."""
    kind = CONFORMANCE.get(request.param, request.param)
    if kind == "embedded":
        return request.getfixturevalue("store")
    if kind == "daemon":
        return request.getfixturevalue("client")
    return request.getfixturevalue("module_stores").shared(kind)


def _sleep_past(started: float, lease: float) -> None:
    """Sleeps until ``lease`` (plus a margin) has passed since ``started`` on this host."""
    left = started + lease + 0.3 - time.monotonic()
    if left > 0:
        time.sleep(left)


def test_a_renewed_claim_is_held_past_its_first_lease(api: ClaimAPI, ns: str) -> None:
    started = time.monotonic()
    first = api.claim("k", namespace=ns, lease=SHORT, owner="a")
    api.extend("k", first.token, namespace=ns, lease=LONG)
    _sleep_past(started, SHORT)
    # The first lease has run out on every clock; the renewed one has not.
    other = api.claim("k", namespace=ns, owner="b")
    assert other.outcome is Outcome.IN_PROGRESS and other.token == first.token
    api.complete("k", first.token, namespace=ns, result="done")
    assert api.claim("k", namespace=ns).result == "done"


def test_extend_many_renews_all_or_nothing(api: ClaimAPI, ns: str) -> None:
    held = api.claim_many(["a", "b", "c"], namespace=ns, lease=LONG)
    api.complete("c", held[2].token, namespace=ns)
    items = [("a", held[0].token), ("b", held[1].token), ("c", held[2].token)]
    with pytest.raises(StaleTokenError, match="already completed"):
        api.extend_many(items, namespace=ns, lease=LONG)
    api.extend_many(items[:2], namespace=ns, lease=LONG)
    api.extend_many([], namespace=ns)
    for key in ("a", "b"):
        record = api.get(key, namespace=ns)
        assert record is not None and record.state is State.PROCESSING


def test_a_renewal_after_a_takeover_is_refused(api: ClaimAPI, ns: str) -> None:
    first = api.claim("k", namespace=ns, lease=SHORT, owner="a")
    second = take_over(api, "k", ns, owner="b", lease=LONG)
    assert second.takeover and second.token == first.token + 1
    with pytest.raises(StaleTokenError):
        api.extend("k", first.token, namespace=ns, lease=LONG)
    # The new owner's claim is untouched: still held, by its token.
    api.extend("k", second.token, namespace=ns, lease=LONG)
    assert api.claim("k", namespace=ns, owner="c").outcome is Outcome.IN_PROGRESS


def test_renewals_of_keys_not_held_are_refused(api: ClaimAPI, ns: str) -> None:
    with pytest.raises(StaleTokenError, match="not claimed"):
        api.extend("never", 1, namespace=ns)
    c = api.claim("k", namespace=ns, lease=LONG)
    api.release("k", c.token, namespace=ns)
    with pytest.raises(StaleTokenError):
        api.extend("k", c.token, namespace=ns)
    d = api.claim("j", namespace=ns, lease=LONG)
    with pytest.raises(StaleTokenError):
        api.extend("j", d.token + 1, namespace=ns)


def test_bad_arguments_raise_before_anything_is_renewed(api: ClaimAPI, ns: str) -> None:
    c = api.claim("k", namespace=ns, lease=LONG)
    bad: list[tuple[Any, dict[str, Any]]] = [
        ([("k", 0)], {}),
        ([("k", "1")], {}),
        ([("k",)], {}),
        ([("", c.token)], {}),
        ([("k", c.token)], {"lease": 0}),
        ([("k", c.token)], {"lease": "long"}),
        ([("k", c.token)], {"lease": float("nan")}),
    ]
    for items, options in bad:
        with pytest.raises((TypeError, ValueError)):
            api.extend_many(items, namespace=ns, **options)
    with pytest.raises(ValueError):
        api.extend("k", c.token, namespace="", lease=LONG)
    api.complete("k", c.token, namespace=ns)


def test_a_heartbeat_holds_a_long_block_and_stops_with_it(api: ClaimAPI, ns: str) -> None:
    renewed = threading.Event()
    renewals: list[int] = []
    extend = api.extend

    def counting_extend(*args: Any, **kwargs: Any) -> None:
        extend(*args, **kwargs)
        renewals.append(1)
        if len(renewals) >= 4:
            renewed.set()

    api.extend = counting_extend  # type: ignore[method-assign]
    try:
        started = time.monotonic()
        with api.processing("k", namespace=ns, lease=2.0, heartbeat=True) as c:
            assert c.outcome is Outcome.NEW
            assert renewed.wait(60), "no four renewals within a minute"
            # Four beats of a third of the lease: past the first lease, held by the renewals.
            assert time.monotonic() - started > 2.0
            assert api.claim("k", namespace=ns, owner="other").outcome is Outcome.IN_PROGRESS
            c.result = "long work"
        count = len(renewals)
    finally:
        del api.extend
    assert api.claim("k", namespace=ns).result == "long work"
    time.sleep(1.0)  # longer than a beat: one after the block would be counted here
    assert len(renewals) == count


def test_a_block_without_a_heartbeat_renews_nothing(api: ClaimAPI, ns: str) -> None:
    calls: list[Any] = []
    api.extend = lambda *a, **k: calls.append(a)  # type: ignore[method-assign]
    try:
        with api.processing("k", namespace=ns, lease=LONG) as c:
            assert c.outcome is Outcome.NEW
    finally:
        del api.extend
    assert calls == []
