"""Heartbeats over the in-process memory table: the contract's ``extend`` and the
renewals of ``processing(heartbeat=True)``, without a server (the same cases run
over every store in tests/conformance/test_heartbeat.py)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from dedupcore.api import HEARTBEAT_LEASE, Outcome
from dedupcore.api.conveniences import Heartbeat
from dedupcore.errors import StaleTokenError, UnavailableError
from dedupcore.memory import MemoryTable

NS = "beats"


def test_extend_renews_a_claim_on_the_tables_clock() -> None:
    m = MemoryTable()
    c = m.claim("k", namespace=NS, lease=0.05)
    m.extend("k", c.token, namespace=NS, lease=600)
    time.sleep(0.1)
    assert m.claim("k", namespace=NS, owner="b").outcome is Outcome.IN_PROGRESS


def test_an_expired_claim_nobody_took_over_is_renewed() -> None:
    m = MemoryTable()
    c = m.claim("k", namespace=NS, lease=0.01)
    time.sleep(0.05)
    m.extend("k", c.token, namespace=NS, lease=600)
    assert m.claim("k", namespace=NS, owner="b").outcome is Outcome.IN_PROGRESS


def test_a_stale_extension_names_the_action() -> None:
    m = MemoryTable()
    c = m.claim("k", namespace=NS)
    m.complete("k", c.token, namespace=NS)
    with pytest.raises(StaleTokenError, match="cannot be extended"):
        m.extend("k", c.token, namespace=NS)


def test_the_heartbeat_lease_is_the_default_under_a_heartbeat() -> None:
    m = MemoryTable(lease=600)
    leases: list[Any] = []
    extend = m.extend

    def spy(*args: Any, **kwargs: Any) -> None:
        leases.append(kwargs["lease"])
        extend(*args, **kwargs)

    m.extend = spy  # type: ignore[method-assign]
    beat = Heartbeat  # the interval is a third of the lease
    assert beat(m.claim("x", namespace=NS), HEARTBEAT_LEASE, lambda: None).interval == 10.0
    with m.processing("k", namespace=NS, heartbeat=True, lease=0.06) as c:
        assert c.outcome is Outcome.NEW
        while not leases:
            time.sleep(0.01)
    assert set(leases) == {0.06}


def test_a_beat_that_cannot_reach_the_store_retries_and_one_that_lost_the_key_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = MemoryTable()
    c = m.claim("k", namespace=NS)
    calls: list[str] = []
    lost = threading.Event()

    def renew() -> None:
        calls.append("renew")
        if len(calls) == 1:
            raise UnavailableError("store down")
        if len(calls) == 2:
            raise StaleTokenError("taken over")
        lost.set()  # a third renewal must not happen

    with caplog.at_level(logging.WARNING, logger="dedupcore"), Heartbeat(c, 0.03, renew) as beat:
        while beat.lost is None:
            time.sleep(0.01)
        time.sleep(0.1)  # ten beats' time: none after the loss
    assert calls == ["renew", "renew"] and not lost.is_set()
    assert isinstance(beat.lost, StaleTokenError)
    assert "could not renew" in caplog.text and "the claim is lost" in caplog.text


def test_a_duplicate_gets_no_heartbeat() -> None:
    m = MemoryTable()
    c = m.claim("k", namespace=NS)
    m.complete("k", c.token, namespace=NS)
    m.extend = lambda *a, **k: pytest.fail("renewed a duplicate")  # type: ignore[method-assign]
    with m.processing("k", namespace=NS, heartbeat=True, lease=0.03) as d:
        assert d.outcome is Outcome.DUPLICATE
        time.sleep(0.1)
